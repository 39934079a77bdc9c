#!/usr/bin/python3
"""Writes the fuzzers' seed corpus (fuzz/corpus/<target>/): well-formed requests for
each method, frames, tenants files and configs, from which libFuzzer mutates. Run from
the repository root with the built Python package on the path:

    PYTHONPATH=build/python /usr/bin/python3 fuzz/make_seeds.py
"""
import os
import struct

import kvtier
from kvtier.v1 import kvtier_pb2 as pb

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
# The layout fuzz/requests_fuzz.cc registers.
LAYOUT = kvtier.Layout(model_id="fuzz", dtype="float16", num_layers=2, num_kv_heads=1,
                       head_dim=8, tokens_per_chunk=8)
NS = kvtier.namespace_id(LAYOUT)
CHUNK = 2 * 2 * 1 * 8 * 8 * 2  # layers * (K, V) * heads * head_dim * tokens * 2 bytes.
KEYS = kvtier.chunk_keys(NS, list(range(24)), 8)


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def framed(*messages):
    return b"".join(struct.pack("<H", len(m)) + m for m in messages)


def put_frames(key_index, split):
    data = bytes((i * 7 + key_index) % 251 for i in range(CHUNK))
    crc = kvtier.crc32c(data)
    frames = []
    for off in range(0, CHUNK, split):
        f = pb.PutFrame(namespace_id=NS, key=KEYS[key_index], offset=off,
                        data=data[off:off + split], token_count=8)
        if off + split >= CHUNK:
            f.crc32c = crc
        if key_index > 0:
            f.chunk_index = key_index
            f.prev_key = KEYS[key_index - 1]
        frames.append(f.SerializeToString())
    return frames


def main():
    layout = pb.Layout(model_id="fuzz", dtype=pb.DTYPE_FLOAT16, num_layers=2, num_kv_heads=1,
                       head_dim=8, tokens_per_chunk=8, tp_world_size=1,
                       key_position=pb.KEY_POSITION_POST_ROPE)
    # requests_fuzz: byte 0 picks the method (see requests_fuzz.cc).
    unary = [
        ("register", 0, pb.RegisterLayoutRequest(layout=layout)),
        ("lookup", 1, pb.LookupRequest(namespace_id=NS, keys=KEYS, lease_seconds=5)),
        ("pin", 2, pb.PinRequest(namespace_id=NS, keys=KEYS[:2], ttl_seconds=5)),
        ("unpin", 3, pb.UnpinRequest(namespace_id=NS, keys=KEYS[:2])),
        ("delete", 4, pb.DeleteRequest(namespace_id=NS, keys=KEYS[1:])),
        ("clear", 5, pb.ClearRequest(namespace_id=NS)),
        ("release", 6, pb.ReleaseLeaseRequest(namespace_id=NS, lease_id=1)),
        ("dataplane", 7, pb.DataPlaneRequest(namespace_id=NS)),
        ("hint", 8, pb.HintRequest(client_id="router", requests=[
            pb.HintedRequest(namespace_id=NS, keys=KEYS)])),
        ("stats", 9, pb.StatsRequest()),
    ]
    for name, pick, msg in unary:
        write("requests_fuzz", name, bytes([pick]) + msg.SerializeToString())
    write("requests_fuzz", "get", bytes([10]) + pb.GetRequest(
        namespace_id=NS, keys=KEYS, order=pb.GET_ORDER_LAYER_MAJOR,
        layer_range=pb.LayerRange(begin=0, end=2), max_frame_bytes=128).SerializeToString())
    write("requests_fuzz", "put_one", bytes([11]) + framed(*put_frames(0, CHUNK)))
    write("requests_fuzz", "put_chain", bytes([11]) + framed(*put_frames(0, 256),
                                                               *put_frames(1, 100),
                                                               *put_frames(2, CHUNK)))
    open_msg = pb.PrefillClientMessage(open=pb.PrefillOpen(namespace_id=NS, keys=KEYS,
                                                            max_frame_bytes=256))
    progress = pb.PrefillClientMessage(progress=pb.PrefillProgress(computed=1))
    write("requests_fuzz", "prefill", bytes([12]) + framed(open_msg.SerializeToString(),
                                                           progress.SerializeToString()))
    # frame_splitter_fuzz: byte 0 is where the bytes are cut into two slices.
    for i, f in enumerate(put_frames(1, 200)):
        write("frame_splitter_fuzz", f"put{i}", bytes([i * 37 % 256]) + f)
    g = pb.GetFrame(key_index=3, found=True, offset=64, data=b"x" * 300, last=True,
                    total_bytes=364, crc32c=0xdeadbeef, token_count=8, tier=pb.TIER_RAM,
                    layer=1)
    write("frame_splitter_fuzz", "get", bytes([150]) + g.SerializeToString())
    # tenants_file_fuzz
    write("tenants_file_fuzz", "full",
          "# teams\ntenant team-a\ntenant ops role=admin\n"
          "tenant batch requests_per_second=200 burst=400\n"
          "token team-a sha256:" + "ab" * 32 + "\n"
          "cert team-a worker-a.example\nuid batch 1001\n")
    write("tenants_file_fuzz", "bad", "tenant a\ntoken a plaintext\n")
    # config_fuzz: the shipped configuration and a few edits.
    with open(os.path.join(ROOT, "..", "..", "deploy", "kvtierd.toml")) as f:
        write("config_fuzz", "shipped", f.read())
    write("config_fuzz", "tls", 'listen = "0.0.0.0:1"\ntls_cert_file = "/c"\n'
                                'tls_key_file = "/k"\nram_capacity = "64MiB"\n')
    write("config_fuzz", "bad", 'ram_capacity = 12\nwrite_mode = "sideways"\n')


if __name__ == "__main__":
    main()
