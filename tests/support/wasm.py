"""The WebAssembly modules of the tests, built from C (tests/wasm/*.c, examples/wasm/redact.c)
with Debian's clang, lld and wasi-libc (``.ci/run`` installs them); a test that needs one is
skipped, naming the package, where they are missing."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest

from tests.support.tools import tool

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "tests" / "wasm"
EXAMPLE = ROOT / "examples" / "wasm" / "redact.c"
CFLAGS = [
    "--target=wasm32-wasi",
    "-O2",
    "-nostartfiles",
    "-Wl,--no-entry",
    "-Wl,--export-dynamic",
]


@functools.cache
def _probe(workdir: Path) -> str | None:
    """Why clang cannot build a module that uses wasi-libc here (None: it can)."""
    probe = workdir / "probe.c"
    probe.write_text(
        "#include <stdlib.h>\n"
        '__attribute__((export_name("f"))) void *f(unsigned n) { return malloc(n); }\n'
    )
    result = subprocess.run(
        ["clang", *CFLAGS, "-o", str(workdir / "probe.wasm"), str(probe)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        # The linker's want of compiler-rt's builtins, else of wasi-libc.
        package = "libclang-rt-dev-wasm32" if "libclang_rt" in result.stderr else "wasi-libc"
        return (
            f"clang cannot build for wasm32-wasi (Debian package {package}; .ci/run installs "
            "it): " + result.stderr.strip()
        )
    return None


class Builder:
    """``build("upper")``: tests/wasm/upper.c compiled, once (``"redact"``: the example)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._built: dict[str, bytes] = {}

    def __call__(self, name: str) -> bytes:
        if name not in self._built:
            tool("clang", "clang")
            tool("wasm-ld", "lld")
            missing = _probe(self.workdir)
            if missing:
                pytest.skip(missing)
            source = EXAMPLE if name == "redact" else SOURCES / f"{name}.c"
            out = self.workdir / f"{name}.wasm"
            subprocess.run(
                ["clang", *CFLAGS, "-Wall", "-Werror", f"-I{SOURCES}", "-o", str(out), str(source)],
                check=True,
            )
            self._built[name] = out.read_bytes()
        return self._built[name]
