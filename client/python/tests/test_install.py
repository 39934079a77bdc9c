"""`pip install --no-build-isolation ./client/python` works offline and gives a
package that imports and talks to a daemon from any directory."""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)


def test_offline_pip_install(tmp_path, daemon):
    build = os.environ.get("KVTIER_BUILD_DIR")
    if not build:
        pytest.skip("KVTIER_BUILD_DIR not set (CTest sets it)")
    target = tmp_path / "site"
    env = dict(os.environ, KVTIER_CMAKE_BUILD_DIR=build, PIP_NO_INDEX="1")
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation",
                    "--no-deps", "--no-index", "--target", str(target), PKG],
                   check=True, env=env, capture_output=True)
    code = ("import kvtier, sys; c = kvtier.Client(sys.argv[1], connect_timeout=10); "
            "print(kvtier.__file__); print(c.stats().write_mode)")
    out = subprocess.run([sys.executable, "-c", code, daemon.target], check=True, text=True,
                         capture_output=True, cwd=str(tmp_path),
                         env=dict(env, PYTHONPATH=str(target))).stdout.split()
    assert out[0].startswith(str(target)) and out[1] == "write-through"
