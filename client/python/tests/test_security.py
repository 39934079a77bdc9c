"""The Python client against a kvtierd with tenants and TLS: tokens name tenants, the
errors are typed, and TLS works with the daemon's certificate from the test CA."""

import hashlib
import os
import subprocess

import numpy as np
import pytest

import kvtier
from kvtier.testing import Daemon

from conftest import small_layout

_CERT_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests", "tls",
                            "make_test_certs.sh")


def _token_line(tenant, token):
    return f"token {tenant} sha256:{hashlib.sha256(token.encode()).hexdigest()}\n"


@pytest.fixture(scope="module")
def tenants_daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("kvtierd-tenants")
    tenants = base / "tenants"
    tenants.write_text("tenant team-a\ntenant team-b\ntenant ops role=admin\n" +
                       _token_line("team-a", "tok-a") + _token_line("team-b", "tok-b") +
                       _token_line("ops", "tok-ops"))
    d = Daemon(str(base / "data"), args=["--ram-capacity=256MiB", f"--tenants-file={tenants}"])
    yield d
    d.close()


def test_tokens_name_tenants_and_keep_them_apart(tenants_daemon):
    layout = small_layout(model_id="pytest-tenants")
    with kvtier.Client(tenants_daemon.target, connect_timeout=30, token="tok-a") as a, \
            kvtier.Client(tenants_daemon.target, connect_timeout=30, token="tok-b") as b:
        ns = a.register_layout(layout).namespace_id
        assert b.register_layout(layout).namespace_id == ns  # Same layout, same public id.
        keys = kvtier.chunk_keys(ns, list(range(layout.tokens_per_chunk)), layout.tokens_per_chunk)
        data = np.arange(layout.chunk_bytes, dtype=np.uint8)
        a.put(ns, keys, [data])
        assert a.lookup(ns, keys).prefix_hits == 1
        assert b.lookup(ns, keys).prefix_hits == 0  # team-b's namespace is its own.
        with pytest.raises(kvtier.PermissionDeniedError):
            a.stats()
    with kvtier.Client(tenants_daemon.target, connect_timeout=30, token="tok-ops") as ops:
        assert ops.stats().namespaces == 2


def test_missing_or_wrong_tokens_are_unauthenticated(tenants_daemon):
    for token in ("", "tok-forged"):
        with kvtier.Client(tenants_daemon.target, connect_timeout=30, token=token) as c:
            with pytest.raises(kvtier.UnauthenticatedError) as e:
                c.register_layout(small_layout())
            assert not e.value.retryable


def test_tls_with_the_daemons_ca(tmp_path):
    certs = tmp_path / "certs"
    subprocess.run(["bash", _CERT_SCRIPT, str(certs)], check=True)
    d = Daemon(str(tmp_path / "data"), args=[
        "--ram-capacity=256MiB", f"--tls-cert-file={certs / 'server.pem'}",
        f"--tls-key-file={certs / 'server.key'}"])
    try:
        with kvtier.Client(d.target, connect_timeout=30, tls_ca_file=str(certs / "ca.pem")) as c:
            assert c.register_layout(small_layout()).chunk_bytes > 0
        with kvtier.Client(d.target, rpc_deadline=10) as plain:
            with pytest.raises(kvtier.UnavailableError):
                plain.register_layout(small_layout())
    finally:
        d.close()
