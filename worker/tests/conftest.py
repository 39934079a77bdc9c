"""Shared fixtures: small seeded models and, for the daemon tests, a real kvtierd.

The daemon is kvtier.testing.Daemon (build/server/kvtierd on port 0). Tests that need it
are skipped, with the reason, when the kvtier package or the binary is not built.
"""

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # kvtier_worker
_BUILD_PY = os.path.normpath(os.path.join(HERE, "..", "..", "build", "python"))
if os.path.isdir(_BUILD_PY) and _BUILD_PY not in sys.path:
    sys.path.insert(0, _BUILD_PY)

torch.set_num_threads(1)

from kvtier_worker.model import LlamaModel, ModelConfig  # noqa: E402

SMALL = ModelConfig(vocab_size=256, hidden=64, num_layers=3, num_heads=4, num_kv_heads=2,
                    head_dim=16, intermediate=128, max_position=512, tie_embeddings=False)


def small_model(**kw) -> LlamaModel:
    return LlamaModel(SMALL.with_(**kw))


def random_tokens(n, seed, vocab=SMALL.vocab_size):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="session")
def daemon(tmp_path_factory):
    try:
        import kvtier  # noqa: F401
        from kvtier.testing import Daemon, find_kvtierd
        find_kvtierd()
    except (ImportError, FileNotFoundError) as e:
        if os.environ.get("KVTIER_BUILD_DIR"):  # Under CTest: the build must provide them.
            pytest.fail(f"kvtier package or kvtierd missing from the build: {e}")
        pytest.skip(f"kvtier package or kvtierd not built: {e}")
    d = Daemon(str(tmp_path_factory.mktemp("kvtierd")),
               args=["--ram-capacity=256MiB", "--write-mode=ram-only"])
    yield d
    d.close()


@pytest.fixture
def client(daemon):
    import kvtier
    with kvtier.Client(daemon.target, connect_timeout=30) as c:
        yield c
