"""Fixtures: a real kvtierd (kvtier.testing.Daemon) on port 0 and clients of it."""

import os

import pytest

import kvtier
from kvtier.testing import Daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = Daemon(str(tmp_path_factory.mktemp("kvtierd") / "data"),
               args=["--ram-capacity=512MiB", "--write-mode=write-through"])
    yield d
    d.close()


@pytest.fixture
def client(daemon):
    with kvtier.Client(daemon.target, connect_timeout=30) as c:
        yield c


def small_layout(**kw):
    args = dict(model_id="pytest-model", dtype="float32", num_layers=4, num_kv_heads=2,
                head_dim=8, tokens_per_chunk=16)
    args.update(kw)
    return kvtier.Layout(**args)


@pytest.fixture
def layout():
    return small_layout()


@pytest.fixture
def ns(client, layout):
    return client.register_layout(layout).namespace_id


def vectors_path():
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "..", "tests", "vectors", "chunk_keys.json")
