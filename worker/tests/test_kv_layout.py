"""KV <-> chunk payloads: the byte order, round trips, views, bad buffers."""

import numpy as np
import pytest
import torch

from conftest import random_tokens, small_model
from kvtier_worker.kv_layout import ChunkLayout, as_bytes


def layout_for(m, C=16):
    c = m.cfg
    return ChunkLayout(c.num_layers, c.num_kv_heads, c.head_dim, C, c.dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pack_unpack_round_trip_and_byte_offsets(dtype):
    m = small_model(dtype=dtype)
    lay = layout_for(m)
    _, kv = m.prefill(random_tokens(70, 1))  # 4 full chunks + 6 tokens.
    buf = lay.pack(kv)
    assert buf.shape[0] == 4 and buf.is_contiguous()
    assert buf.numel() * buf.element_size() == 4 * lay.chunk_bytes
    back = lay.unpack(buf)
    for (k, v), (k2, v2) in zip(kv, back):
        assert torch.equal(k[:, :64], k2) and torch.equal(v[:, :64], v2)
    # The documented offsets: K (head, token, dim) of layer l of chunk i at
    # i*chunk_bytes + l*layer_bytes + ((head*C + token)*head_dim + dim)*itemsize, V
    # half a layer later.
    raw = as_bytes(buf)
    H, C, d = lay.block_shape
    it = lay.itemsize
    for (i, l, h, t, e) in [(0, 0, 0, 0, 0), (2, 1, 1, 5, 7), (3, 2, 1, 15, 15)]:
        off = i * lay.chunk_bytes + l * lay.layer_bytes + ((h * C + t) * d + e) * it
        k_elem = torch.frombuffer(bytearray(raw[off:off + it]), dtype=lay.dtype)[0]
        v_off = off + lay.layer_bytes // 2
        v_elem = torch.frombuffer(bytearray(raw[v_off:v_off + it]), dtype=lay.dtype)[0]
        assert torch.equal(k_elem, kv[l][0][h, i * C + t, e])
        assert torch.equal(v_elem, kv[l][1][h, i * C + t, e])


def test_layer_slices_and_views():
    m = small_model()
    lay = layout_for(m)
    _, kv = m.prefill(random_tokens(48, 2))
    buf = lay.pack(kv)
    raw = bytes(as_bytes(buf))
    for l in range(lay.num_layers):
        a, b = lay.layer_byte_range(l)
        chunk1 = raw[lay.chunk_bytes:2 * lay.chunk_bytes]
        assert chunk1[a:b] == bytes(as_bytes(buf[1, l]))
    views = lay.chunk_views(buf, 1)
    assert views[2][0].data_ptr() == buf[1, 2, 0].data_ptr()  # Zero-copy.
    assert torch.equal(views[2][0], kv[2][0][:, 16:32])
    # Bytes -> tensors without a copy when the bytes are writable.
    ba = bytearray(raw)
    t = lay.view_bytes(ba)
    assert torch.equal(t, buf)
    t[0, 0, 0, 0, 0, 0] = 42.0
    assert np.frombuffer(ba, np.float32)[0] == 42.0
    assert torch.equal(lay.view_bytes(raw), buf)  # Read-only bytes: copied.
    assert torch.equal(lay.unpack(buf, 2, first_chunk=1)[0][0], kv[0][0][:, 16:48])


def test_bad_buffers():
    m = small_model()
    lay = layout_for(m)
    _, kv = m.prefill(random_tokens(32, 3))
    with pytest.raises(TypeError, match="dtype"):
        lay.pack([(k.bfloat16(), v.bfloat16()) for k, v in kv])
    with pytest.raises(ValueError, match="layers"):
        lay.pack(kv[:2])
    with pytest.raises(ValueError, match="2 chunks need 32"):
        lay.pack([(k[:, :20], v[:, :20]) for k, v in kv], num_chunks=2)
    with pytest.raises(ValueError, match="not contiguous"):
        lay.check_buffer(lay.alloc(4)[::2])
    with pytest.raises(TypeError, match="dtype"):
        lay.check_buffer(torch.zeros((1,) + lay.chunk_shape, dtype=torch.float64))
    with pytest.raises(ValueError, match="shape"):
        lay.check_buffer(torch.zeros(lay.chunk_bytes // 4))
    with pytest.raises(ValueError, match="whole number"):
        lay.view_bytes(bytearray(lay.chunk_bytes + 4))
    with pytest.raises(ValueError, match="1 chunks, expected 2"):
        lay.pack(kv, out=lay.alloc(1))
