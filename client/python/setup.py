"""Builds the kvtier package offline: `pip install --no-build-isolation ./client/python`.

The native extension and the generated kvtier/v1 modules are built by the project's own
CMake (target kvtier_python, client/python/CMakeLists.txt), so pip and the test suite use
the same build. It needs the build packages of scripts/deps.sh (gRPC, protobuf, Abseil,
pybind11-dev, python3-dev). Environment:
  KVTIER_CMAKE_BUILD_DIR  reuse this configured build tree (e.g. the repository's
                          build/) instead of configuring a fresh one in build_temp.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
SOURCE_ROOT = HERE.parent.parent  # The repository: client/python/../..


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        if not (SOURCE_ROOT / "proto" / "kvtier" / "v1" / "kvtier.proto").is_file():
            sys.exit(f"kvtier: {SOURCE_ROOT} is not the kvtier source tree")
        build_dir = os.environ.get("KVTIER_CMAKE_BUILD_DIR")
        if build_dir:
            build_dir = Path(build_dir).resolve()
        else:
            build_dir = Path(self.build_temp).resolve() / "cmake"
            subprocess.check_call([
                "cmake", "-S", str(SOURCE_ROOT), "-B", str(build_dir),
                "-DCMAKE_BUILD_TYPE=Release", "-DKVTIER_BUILD_TESTS=OFF",
                "-DKVTIER_BUILD_BENCH=OFF", f"-DPython3_EXECUTABLE={sys.executable}"])
        subprocess.check_call(["cmake", "--build", str(build_dir), "--target", "kvtier_python",
                               "-j", str(os.cpu_count() or 1)])
        built = build_dir / "python" / "kvtier"
        dest = Path(self.get_ext_fullpath(ext.name)).parent
        dest.mkdir(parents=True, exist_ok=True)
        for so in built.glob("_native*.so"):
            shutil.copy2(so, dest / so.name)
        (dest / "v1").mkdir(exist_ok=True)
        for gen in (built / "v1").glob("*.py"):
            shutil.copy2(gen, dest / "v1" / gen.name)


setup(
    packages=["kvtier"],
    ext_modules=[Extension("kvtier._native", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
