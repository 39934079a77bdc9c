"""The model alone: split prefills, key positions, rotary re-rotation, bad input."""

import pytest
import torch

from conftest import random_tokens, small_model
from kvtier_worker.model import concat_kv

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}  # Unit roundoff.


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key_position", ["post_rope", "pre_rope"])
def test_prefill_in_pieces_matches_one_shot(dtype, key_position):
    m = small_model(dtype=dtype, key_position=key_position)
    tok = random_tokens(96, 1)
    full_logits, full_kv = m.prefill(tok)
    l1, kv1 = m.prefill(tok[:40])
    l2, kv2 = m.prefill(tok[40:], 40, kv1)
    # Same values up to summation order (see test_worker.py for the bound); K and V of
    # the first piece are computed from the same rows, hence identical.
    for a, b in zip(kv1, full_kv):
        assert torch.equal(a[0], b[0][:, :40]) and torch.equal(a[1], b[1][:, :40])
    tol = 8 * m.cfg.num_layers * U[m.cfg.dtype] * float(full_logits.float().abs().max())
    assert (torch.cat([l1, l2]).float() - full_logits.float()).abs().max() <= tol


def test_layer_callable_past_is_called_in_order_before_each_layer():
    m = small_model()
    tok = random_tokens(48, 2)
    _, kv = m.prefill(tok[:32])
    seen = []

    def past(l):
        seen.append(("load", l))
        return kv[l]

    saved = []
    logits, new = m.prefill(tok[32:], 32, past, on_layer_kv=lambda l, k, v: saved.append(l))
    ref, ref_new = m.prefill(tok[32:], 32, kv)
    assert torch.equal(logits, ref)
    assert seen == [("load", l) for l in range(m.cfg.num_layers)]
    assert saved == list(range(m.cfg.num_layers))


def test_pre_and_post_rope_models_agree():
    pre, post = small_model(key_position="pre_rope"), small_model(key_position="post_rope")
    tok = random_tokens(64, 3)
    lp, kvp = pre.prefill(tok)
    lq, kvq = post.prefill(tok)
    assert torch.equal(lp, lq)
    pos = torch.arange(64)
    for (k_pre, v_pre), (k_post, v_post) in zip(kvp, kvq):
        assert torch.equal(v_pre, v_post)
        assert torch.equal(pre.rope.apply(k_pre, pos), k_post)  # Rotating at use = cached post.


@pytest.mark.parametrize("delta", [-90, 7, 300, 3000])
def test_rerotation_equals_rotating_at_the_new_position(delta):
    m = small_model(key_position="pre_rope", max_position=4096)
    x = torch.randn(2, 64, m.cfg.head_dim, generator=torch.Generator().manual_seed(4))
    p = torch.arange(64) + 100
    direct = m.rope.apply(x, p + delta)
    # Pre-RoPE cache: the pipeline rotates the stored K at the new positions with the same
    # function, so reuse at new positions is bitwise the direct rotation.
    assert torch.equal(m.rope.apply(x.clone(), p + delta), direct)
    # Post-RoPE cache moved by R(delta): equal in exact arithmetic; in float32 each of
    # the two rotation tables carries an angle error of ~pos * u (angles are pos *
    # inv_freq rounded), so |diff| <= |x| * 2 * (max_pos + 1) * u * 2 (two tables).
    moved = m.rope.rerotate(m.rope.apply(x, p), delta)
    max_pos = int((p + max(delta, 0)).max())
    bound = float(x.abs().max()) * 4 * (max_pos + 1) * U[torch.float32] * 2
    assert (moved - direct).abs().max() <= bound


def test_layer0_kv_is_position_independent_before_rope():
    # The property positional-encoding-decoupled truncation rests on: layer 0's pre-RoPE K
    # and V of a token depend on the token alone, so reused at any position they are exact.
    m = small_model(key_position="pre_rope")
    tok = random_tokens(64, 5)
    _, kv_a = m.prefill(tok)
    _, kv_b = m.prefill(tok[32:])
    assert torch.equal(kv_a[0][0][:, 32:], kv_b[0][0])
    assert torch.equal(kv_a[0][1][:, 32:], kv_b[0][1])
    assert not torch.equal(kv_a[1][0][:, 32:], kv_b[1][0])  # Deeper layers saw context.


def test_bad_input():
    m = small_model()
    tok = random_tokens(32, 6)
    _, kv = m.prefill(tok[:16])
    with pytest.raises(ValueError, match="needs the past"):
        m.prefill(tok[16:], 16, None)
    with pytest.raises(ValueError, match="start=8"):
        m.prefill(tok[16:], 8, kv)
    with pytest.raises(ValueError, match="dtype"):
        m.prefill(tok[16:], 16, [(k.bfloat16(), v.bfloat16()) for k, v in kv])
    with pytest.raises(ValueError, match="expected"):
        m.prefill(tok[16:], 16, [(k[:1], v[:1]) for k, v in kv])
    with pytest.raises(ValueError, match="context window"):
        m.prefill(random_tokens(8, 7), 510, [(torch.zeros(2, 510, 16),) * 2] * 3)
    with pytest.raises(ValueError, match="past_positions needs a pre-RoPE"):
        m.prefill(tok[16:], 16, kv, past_positions=torch.arange(16))


def test_weights_come_from_the_seed():
    a, b, c = small_model(), small_model(), small_model(seed=1)
    tok = random_tokens(16, 8)
    assert torch.equal(a.prefill(tok)[0], b.prefill(tok)[0])
    assert not torch.equal(a.prefill(tok)[0], c.prefill(tok)[0])
