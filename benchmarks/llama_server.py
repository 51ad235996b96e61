"""llama.cpp's own C++ server, ``llama-server``: the peer of ``make bench``'s suite 5.

Built from the llama.cpp source that the pinned llama-cpp-python's sdist vendors, so it runs
the very llama.cpp the ``llamacpp`` engine runs, with the same CMake flags as the engine's
build (``LLAMA_CMAKE_ARGS``, which the Makefile also gives to llama-cpp-python's build), and
cached per version and flags under the Seedance cache folder (about 5 minutes on 2 cores the
first time, nothing after).

    python -m benchmarks.llama_server             # builds if needed; prints the binary's path
    python -m benchmarks.llama_server --native    # the same, built for this CPU alone
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from seedance.engines.llamacpp.cpu import cache_dir

#: Flags every build gets: the server alone, nothing fetched from the network.
BASE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)


def engine_cmake_args() -> list[str]:
    """The engine's build flags, as the Makefile passes them (``LLAMA_CMAKE_ARGS``)."""
    return [
        arg
        for arg in shlex.split(os.environ.get("LLAMA_CMAKE_ARGS", ""))
        if not arg.startswith("-DCMAKE_INSTALL_")  # where pip's wheel puts files: not here
    ]


def binary_path(version: str, flags: list[str]) -> Path:
    key = hashlib.sha256(" ".join([version, *flags]).encode()).hexdigest()[:12]
    return cache_dir() / f"llama-server-{version}-{key}" / "build" / "bin" / "llama-server"


#: What a user who builds llama.cpp gets: tuned for the CPU it is built on (``-march=native``),
#: one CPU backend linked in, no runtime dispatch.
NATIVE_FLAGS = ["-DGGML_NATIVE=ON"]


def is_built(flags: list[str] | None = None) -> bool:
    """Whether the cached ``llama-server`` for these flags (default: the engine's) is there."""
    version = importlib.metadata.version("llama-cpp-python")
    return binary_path(version, engine_cmake_args() if flags is None else flags).exists()


def ensure_built(log: Callable[[str], None] = print, flags: list[str] | None = None) -> Path:
    """The cached ``llama-server`` binary built with ``flags`` (default: the engine's), built
    first if it is not there."""
    version = importlib.metadata.version("llama-cpp-python")
    flags = engine_cmake_args() if flags is None else flags
    binary = binary_path(version, flags)
    if binary.exists():
        return binary
    root = binary.parent.parent.parent
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log(f"building llama-server {version} with {' '.join(flags) or 'default flags'} in {root}")
    with tempfile.TemporaryDirectory() as download:
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"),
                *("--no-binary", ":all:", "--dest", download),
                f"llama-cpp-python=={version}",
            ],
            check=True,
        )
        (sdist,) = Path(download).glob("*.tar.gz")
        prefix = f"{sdist.name.removesuffix('.tar.gz')}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = []
            for member in archive.getmembers():
                if member.name.startswith(prefix):
                    member.name = member.name[len(prefix) :]
                    members.append(member)
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(root / "src", members=members, **safe)  # type: ignore[arg-type]
    build = root / "build"
    subprocess.run(
        ["cmake", "-S", str(root / "src"), "-B", str(build), *BASE_FLAGS, *flags],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    jobs = str(os.cpu_count() or 1)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    if not binary.exists():
        raise RuntimeError(f"the build made no {binary}")
    return binary


if __name__ == "__main__":
    native = sys.argv[1:] == ["--native"]
    print(ensure_built(lambda line: print(line, file=sys.stderr), NATIVE_FLAGS if native else None))


def ensure_gguf(folder: Path, name: str, log: Callable[[str], None] = print) -> Path:
    """A Hugging Face model ``folder`` as a GGUF file (float32, cached), converted by the
    ``convert_hf_to_gguf.py`` of the llama.cpp that ``llama-server`` is built from, so that
    the two agree."""
    source = ensure_built(log).parent.parent.parent / "src"
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()[:12]
    target = cache_dir() / f"{name}-{digest}-f32.gguf"
    if target.exists():
        return target
    log(f"converting {folder} to {target} with llama.cpp's convert_hf_to_gguf.py")
    partial = target.with_suffix(".part")
    subprocess.run(
        [
            *(sys.executable, str(source / "convert_hf_to_gguf.py"), str(folder)),
            *("--outfile", str(partial), "--outtype", "f32"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(source / "gguf-py")},
    )
    partial.rename(target)
    return target
