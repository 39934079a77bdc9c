"""A Llama-architecture decoder in torch, on the CPU, with weights from a fixed seed.

RMSNorm, rotary position embedding (theta configurable), grouped-query attention
(num_kv_heads divides num_heads), SwiGLU MLP, tied or untied embeddings. No weights are
downloaded: every parameter is drawn from ``torch.Generator().manual_seed(seed)`` and
scaled so that activations stay O(1) through the layers.

The forward API is built for a KV cache that lives outside the model:

* ``prefill(tokens, start, past)`` computes tokens ``[start, start + len(tokens))`` given the
  KV of positions ``[0, start)`` per layer, and returns the logits of the new tokens and
  their KV. Both K and V are ``[num_kv_heads, tokens, head_dim]`` per layer.
* ``past`` may be a list of ``(K, V)`` pairs or a callable ``past(layer) -> (K, V)``. The
  callable is invoked right before layer ``layer`` is computed and may block (for
  instance on ``LoadHandle.wait_layer``): that is the layer-wise overlap of loading layer
  ``l + 1`` while layer ``l`` computes.
* ``on_layer_kv(layer, K, V)`` is called with each layer's new KV as soon as it exists
  (vLLM's save_kv_layer seam).
* ``embed``, ``layer`` and ``logits`` are the same computation one step at a time.

Key position (``ModelConfig.key_position``): ``"post_rope"`` caches K after rotation (what
vLLM and SGLang cache); ``"pre_rope"`` caches K before rotation and rotates the whole
K (past and new) at use. Pre-RoPE caches can be reused at other positions
(CachedAttention's positional-encoding-decoupled truncation): ``past_positions`` gives
the positions at which the past keys are rotated, ``positions`` those of the new tokens.

Numerics: all matmuls run in ``config.dtype`` (float32 or bfloat16); softmax and
RMSNorm's mean square run in float32, then cast back, as Llama implementations do. The
rotary tables are computed in float32 then cast. Given the same inputs and shapes, every
function here is deterministic on the CPU, which is what the bitwise tests rely on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

KV = Tuple[torch.Tensor, torch.Tensor]
PastKV = Union[None, Sequence[KV], Callable[[int], KV]]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


def _torch_dtype(d) -> torch.dtype:
    if isinstance(d, torch.dtype):
        if d not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype: {d} is not float32 or bfloat16")
        return d
    if d not in _DTYPES:
        raise ValueError(f"dtype: {d!r} is not 'float32' or 'bfloat16'")
    return _DTYPES[d]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 512
    hidden: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate: int = 256
    max_position: int = 4096       # Context window: positions must be < max_position.
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: Union[str, torch.dtype] = "float32"
    key_position: str = "post_rope"  # or "pre_rope"
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "dtype", _torch_dtype(self.dtype))
        if self.key_position not in ("post_rope", "pre_rope"):
            raise ValueError(f"key_position: {self.key_position!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")

    @property
    def dtype_name(self) -> str:
        return "float32" if self.dtype == torch.float32 else "bfloat16"

    def with_(self, **kw) -> "ModelConfig":
        return replace(self, **kw)


class RotaryEmbedding:
    """Llama's rotary embedding in the "rotate_half" convention (HF LlamaRotaryEmbedding).

    Channel j of the first half pairs with channel j + head_dim/2, rotated by angle
    position * theta^(-2j/head_dim).
    """

    def __init__(self, head_dim: int, theta: float, max_position: int, dtype: torch.dtype):
        self.head_dim = head_dim
        self.max_position = max_position
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(dtype)  # [max_position, head_dim]
        self._sin = emb.sin().to(dtype)
        self._inv_freq = inv_freq

    def tables(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        if positions.numel() and (int(positions.min()) < 0 or
                                  int(positions.max()) >= self.max_position):
            raise ValueError(f"positions outside [0, {self.max_position}): the context "
                             "window is exceeded")
        return self._cos[positions], self._sin[positions]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], dim=-1)

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotates x [..., T, head_dim] at positions [T]."""
        cos, sin = self.tables(positions)
        return x * cos + self._rotate_half(x) * sin

    def rerotate(self, x: torch.Tensor, delta: int) -> torch.Tensor:
        """Moves keys rotated at p to p + delta (delta may be negative): R(delta) R(p) = R(p+delta).

        For post-RoPE caches. Exact in real arithmetic; in floating point it differs from
        rotating at p + delta directly by a few ulps (see tests/test_model.py).
        """
        ang = float(delta) * self._inv_freq.double()
        emb = torch.cat([ang, ang])
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + self._rotate_half(x) * sin


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, gen: torch.Generator, index: int):
        super().__init__()
        self.cfg = cfg
        h, d, dt = cfg.hidden, cfg.head_dim, cfg.dtype
        # Residual branches scaled by 1/sqrt(2 * num_layers) (GPT-2 style) so the residual
        # stream grows slowly with depth.
        out_scale = 1.0 / math.sqrt(2 * cfg.num_layers)

        def w(rows, cols, scale=1.0):
            t = torch.randn(rows, cols, generator=gen, dtype=torch.float32)
            return (t * (scale / math.sqrt(cols))).to(dt)

        self.wq = w(cfg.num_heads * d, h)
        self.wk = w(cfg.num_kv_heads * d, h)
        self.wv = w(cfg.num_kv_heads * d, h)
        self.wo = w(h, cfg.num_heads * d, out_scale)
        self.w_gate = w(cfg.intermediate, h)
        self.w_up = w(cfg.intermediate, h)
        self.w_down = w(h, cfg.intermediate, out_scale * 2.0)  # silu(x)*y has rms ~0.5
        self.attn_norm = RMSNorm(h, cfg.rms_eps, dt)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps, dt)


class LlamaModel(torch.nn.Module):
    """See the module docstring. Inference only (no autograd)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        dt = cfg.dtype
        # Embedding entries ~ N(0, 16/hidden): logits (unit-rms hidden state times an
        # embedding row) then have std ~4 whatever the width, and the embedding is about
        # as large as one residual branch's output.
        emb_std = 4.0 / math.sqrt(cfg.hidden)
        self.embedding = (torch.randn(cfg.vocab_size, cfg.hidden, generator=gen) * emb_std).to(dt)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, gen, i) for i in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden, cfg.rms_eps, dt)
        if cfg.tie_embeddings:
            self.lm_head = self.embedding
        else:
            self.lm_head = (torch.randn(cfg.vocab_size, cfg.hidden, generator=gen)
                            * emb_std).to(dt)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.max_position, dt)
        self.pre_rope = cfg.key_position == "pre_rope"

    # -- One step at a time ---------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.ndim != 1:
            raise ValueError(f"tokens: expected a 1-D tensor, got shape {tuple(tokens.shape)}")
        return self.embedding[tokens]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.final_norm(h) @ self.lm_head.t()

    def layer(self, index: int, h: torch.Tensor, positions: torch.Tensor,
              past: Optional[KV] = None,
              past_positions: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, KV]:
        """Layer ``index`` on hidden states h [T, hidden] at ``positions`` [T].

        ``past``: (K, V) of earlier tokens, [kv_heads, P, head_dim], in cache form (pre- or
        post-RoPE per the config). ``past_positions`` [P] (pre-RoPE only; default
        0..P-1) are the positions the past keys take in this computation. Token t attends
        to every past token and to new tokens up to itself. Returns (h', (K_new, V_new)) in
        cache form.
        """
        cfg = self.cfg
        L = self.layers[index]
        T = h.shape[0]
        H, Hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = L.attn_norm(h)
        q = (x @ L.wq.t()).view(T, H, d).transpose(0, 1)       # [H, T, d]
        k = (x @ L.wk.t()).view(T, Hkv, d).transpose(0, 1)     # [Hkv, T, d]
        v = (x @ L.wv.t()).view(T, Hkv, d).transpose(0, 1).contiguous()
        q = self.rope.apply(q, positions)
        if self.pre_rope:
            k_cache = k.contiguous()
            k_rot = self.rope.apply(k, positions)
        else:
            k_rot = self.rope.apply(k, positions).contiguous()
            k_cache = k_rot
        if past is not None and past[0].shape[1] > 0:
            pk, pv = past
            _check_past(pk, pv, Hkv, d, cfg.dtype)
            P = pk.shape[1]
            if self.pre_rope:
                pp = (torch.arange(P) if past_positions is None
                      else torch.as_tensor(past_positions, dtype=torch.long))
                pk = self.rope.apply(pk, pp)
            keys = torch.cat([pk, k_rot], dim=1)
            values = torch.cat([pv, v], dim=1)
        else:
            P = 0
            keys, values = k_rot, v
        group = H // Hkv
        if group > 1:
            keys = keys.repeat_interleave(group, dim=0)
            values = values.repeat_interleave(group, dim=0)
        scores = (q @ keys.transpose(1, 2)) * (1.0 / math.sqrt(d))  # [H, T, P+T]
        # Causal within the new tokens; every past token is visible.
        mask = torch.ones(T, P + T, dtype=torch.bool).tril(diagonal=P)
        scores = scores.float().masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(cfg.dtype)
        attn = (probs @ values).transpose(0, 1).reshape(T, H * d)
        h = h + attn @ L.wo.t()
        x = L.mlp_norm(h)
        gate = torch.nn.functional.silu(x @ L.w_gate.t())
        h = h + (gate * (x @ L.w_up.t())) @ L.w_down.t()
        return h, (k_cache, v)

    # -- Whole prefill --------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, tokens, start: int = 0, past: PastKV = None,
                positions: Optional[torch.Tensor] = None,
                past_positions: Optional[torch.Tensor] = None,
                on_layer_kv: Optional[Callable[[int, torch.Tensor, torch.Tensor], None]] = None,
                want_logits: bool = True) -> Tuple[Optional[torch.Tensor], List[KV]]:
        """Computes ``tokens`` (the request's tokens [start, start + len)) given the KV of
        [0, start). Returns (logits [len, vocab] or None, [(K, V)] per layer of the new
        tokens). ``past``: a list of (K, V) per layer, a callable layer -> (K, V) (called
        just before that layer is computed; it may block), or None when start == 0.
        ``positions`` defaults to start..start+len-1.
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        T = tokens.shape[0]
        if positions is None:
            positions = torch.arange(start, start + T)
        h = self.embed(tokens)
        new_kv: List[KV] = []
        for l in range(self.cfg.num_layers):
            if past is None:
                p = None
                if start:
                    raise ValueError(f"start={start} needs the past KV")
            elif callable(past):
                p = past(l)
            else:
                p = past[l]
            if p is not None and not self.pre_rope and past_positions is not None:
                raise ValueError("past_positions needs a pre-RoPE model")
            if p is not None and past_positions is None and p[0].shape[1] != start:
                raise ValueError(f"layer {l}: past holds {p[0].shape[1]} tokens, start={start}")
            h, kv = self.layer(l, h, positions, p, past_positions)
            new_kv.append(kv)
            if on_layer_kv is not None:
                on_layer_kv(l, kv[0], kv[1])
        logits = self.logits(h) if want_logits else None
        return logits, new_kv


def _check_past(pk: torch.Tensor, pv: torch.Tensor, Hkv: int, d: int, dtype: torch.dtype):
    for name, t in (("K", pk), ("V", pv)):
        if t.ndim != 3 or t.shape[0] != Hkv or t.shape[2] != d:
            raise ValueError(f"past {name}: expected [{Hkv}, P, {d}], got {tuple(t.shape)}")
        if t.dtype != dtype:
            raise ValueError(f"past {name}: dtype {t.dtype}, the model runs in {dtype}")
    if pk.shape[1] != pv.shape[1]:
        raise ValueError(f"past K holds {pk.shape[1]} tokens, V {pv.shape[1]}")


def concat_kv(parts: Sequence[List[KV]]) -> List[KV]:
    """Joins per-layer KV lists along the token axis (parts in token order)."""
    parts = [p for p in parts if p]
    if not parts:
        return []
    L = len(parts[0])
    return [(torch.cat([p[l][0] for p in parts], dim=1), torch.cat([p[l][1] for p in parts], dim=1))
            for l in range(L)]


def slice_kv(kv: List[KV], begin: int, end: int) -> List[KV]:
    return [(k[:, begin:end], v[:, begin:end]) for k, v in kv]
