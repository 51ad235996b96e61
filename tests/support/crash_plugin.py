"""An engine plugin for the crash tests: the ``llamacpp`` engine whose decode thread dies inside
native code at its first forward pass, the way a CPU-specific kernel or a llama.cpp assertion
kills a real server.

``SEEDANCE_TEST_CRASH=abort`` calls llama.cpp's own ``ggml_abort`` (what ``GGML_ABORT`` and
``GGML_ASSERT`` do); ``segv`` reads address 0 in C. Registered through the ``seedance.engines``
entry point group by a ``.dist-info`` folder that the test writes, like any installed plugin.
It takes the llamacpp engine's options, as a third-party engine built on it would.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

from llama_cpp.llama_cpp import _lib as libllama

from seedance.engines import llamacpp
from seedance.engines.llamacpp.engine import LlamaCppEngine
from seedance.engines.registry import EngineSpec


def create_engine(config: Any, options: llamacpp.LlamaCppOptions) -> LlamaCppEngine:
    engine = llamacpp.create_engine(config, options)
    how = os.environ["SEEDANCE_TEST_CRASH"]

    def crash() -> int:
        if how == "abort":
            libllama.ggml_abort(b"crash_plugin.py", 1, b"a deliberate abort (%s)", b"test")
        ctypes.string_at(0)  # SIGSEGV
        return 0

    engine.context.decode = crash  # type: ignore[method-assign]
    return engine


ENGINE = EngineSpec(
    create_engine, llamacpp.LlamaCppOptions, llamacpp.OPTIONS, front=llamacpp.create_front
)
