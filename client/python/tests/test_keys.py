"""The Python key scheme against the normative vectors (the file the C++ tests load)."""

import json
import os
import re

import numpy as np
import pytest

import kvtier
from conftest import vectors_path

V = json.load(open(vectors_path()))


def layout_of(v):
    return kvtier.Layout(model_id=v["model_id"], model_revision=v["model_revision"],
                         dtype=v["dtype"], num_layers=v["num_layers"],
                         num_kv_heads=v["num_kv_heads"], head_dim=v["head_dim"],
                         tokens_per_chunk=v["tokens_per_chunk"],
                         tp_world_size=v["tp_world_size"], tp_rank=v["tp_rank"],
                         key_position=v["key_position"])


LAYOUTS = {v["name"]: v for v in V["layouts"]}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_vectors(name):
    v = LAYOUTS[name]
    lay = layout_of(v)
    assert lay.canonical_encoding().hex() == v["canonical_encoding_hex"]
    assert "%016x" % kvtier.namespace_id(lay) == v["namespace_id"]
    assert lay.namespace_id == kvtier.namespace_id(lay)
    assert lay.chunk_bytes == v["chunk_bytes"]
    assert lay.layer_bytes == v["layer_bytes"]


def test_first_and_next_chunk_keys():
    assert V["first_chunk_keys"] and V["next_chunk_keys"]
    for v in V["first_chunk_keys"]:
        toks = v["tokens"]
        if toks:
            keys = kvtier.chunk_keys(int(v["namespace_id"], 16), toks, len(toks))
            assert [k.hex() for k in keys] == [v["key"]]
        else:  # The key of no tokens hashes the namespace alone; chunk_keys never makes it.
            import struct, xxhash
            assert xxhash.xxh3_128_digest(struct.pack("<Q", int(v["namespace_id"], 16))).hex() == v["key"]
    for v in V["next_chunk_keys"]:
        # key[i] chains on key[i-1]: check through a two-chunk chain whose first key is
        # the vector's prev (first_chunk_keys[1] is that chain's start).
        first = V["first_chunk_keys"][1]
        assert first["key"] == v["prev"]
        toks = first["tokens"] + v["tokens"]
        if len(v["tokens"]) == len(first["tokens"]):
            keys = kvtier.chunk_keys(int(first["namespace_id"], 16), toks, len(v["tokens"]))
            assert keys[1].hex() == v["key"]
        else:
            import xxhash
            data = bytes.fromhex(v["prev"]) + np.asarray(v["tokens"], "<u4").tobytes()
            assert xxhash.xxh3_128_digest(data).hex() == v["key"]


@pytest.mark.parametrize("i", range(len(V["chunk_keys"])))
def test_chunk_key_chains(i):
    v = V["chunk_keys"][i]
    lay = layout_of(LAYOUTS[v["layout"]])
    c = v.get("tokens_per_chunk", lay.tokens_per_chunk)
    keys = kvtier.chunk_keys(lay.namespace_id, v["tokens"], c)
    assert [k.hex() for k in keys] == v["keys"]
    # Any integer sequence type gives the same keys.
    assert kvtier.chunk_keys(lay.namespace_id, np.asarray(v["tokens"], np.int64), c) == keys
    torch = pytest.importorskip("torch")
    assert kvtier.chunk_keys(lay.namespace_id, torch.tensor(v["tokens"], dtype=torch.int64), c) == keys


def test_partial_last_chunk_gets_no_key_and_keys_are_prefix_chained():
    toks = list(range(100))
    keys = kvtier.chunk_keys(7, toks, 16)
    assert len(keys) == 6 and all(len(k) == 16 for k in keys)
    assert kvtier.chunk_keys(7, toks[:64], 16) == keys[:4]
    other = list(toks)
    other[3] = 999
    changed = kvtier.chunk_keys(7, other, 16)
    assert all(a != b for a, b in zip(keys, changed))  # One token early changes every key.


@pytest.mark.parametrize("tokens,what", [([-1], "32 bits"), ([2**32], "32 bits"),
                                         ([1.5, 2.0], "integer"), ([[1, 2]], "1-D")])
def test_bad_tokens(tokens, what):
    with pytest.raises(kvtier.InvalidArgumentError, match=what):
        kvtier.chunk_keys(1, tokens, 1)


def test_bad_layouts_name_the_field():
    base = dict(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=8,
                tokens_per_chunk=4)
    for field, value in [("model_id", ""), ("dtype", "int4"), ("num_layers", 0),
                         ("tp_rank", 1), ("key_position", "sideways"), ("head_dim", -3)]:
        with pytest.raises(kvtier.InvalidArgumentError, match=field):
            kvtier.Layout(**dict(base, **{field: value}))
    assert kvtier.Layout(**dict(base, dtype="torch.bfloat16")).dtype == kvtier.DType.BFLOAT16


def _proto_enum(name):
    """{value: NAME} of enum `name` in kvtier.proto, the contract the daemon answers in."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = open(os.path.join(here, "..", "..", "..", "proto", "kvtier", "v1",
                             "kvtier.proto")).read()
    body = re.search(r"enum %s \{(.*?)\}" % name, text, re.S).group(1)
    return {int(v): k for k, v in re.findall(r"^\s*(\w+)\s*=\s*(\d+);", body, re.M)}


@pytest.mark.parametrize("enum_name,py", [("Tier", kvtier.Tier), ("DType", kvtier.DType),
                                          ("KeyPosition", kvtier.KeyPosition)])
def test_every_proto_enum_value_has_a_python_member(enum_name, py):
    # A value the daemon may answer that Python cannot name raised ValueError from
    # lookup() and get_into() (TIER_REMOTE, from a daemon with a shared tier), after the
    # bytes had arrived.
    values = _proto_enum(enum_name)
    assert len(values) >= 3
    for value, name in values.items():
        if value == 0:
            continue  # *_UNSPECIFIED: ABSENT for Tier, refused for the others.
        assert py(value).value == value, name
    assert kvtier.Tier(4) == kvtier.Tier.REMOTE
