"""The ``llamacpp`` engine: GGUF models through llama.cpp, the embedded default.

- :mod:`~seedance.engines.llamacpp.native`: a typed layer over llama.cpp's C API;
- :mod:`~seedance.engines.llamacpp.scheduler`: the decode thread (continuous batching, KV reuse);
- :mod:`~seedance.engines.llamacpp.engine`: the :class:`~seedance.engines.base.Engine`.

This module only declares the engine's options: llama.cpp is loaded when the engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from seedance.engines.local import CHAT_TEMPLATE, N_CTX, PARALLEL, THREADS
from seedance.engines.registry import EngineSpec
from seedance.settings import Option, boolean, non_negative

if TYPE_CHECKING:
    from seedance.config import ServerConfig
    from seedance.engines.base import Engine, ModelInfo
    from seedance.engines.llamacpp.engine import LlamaCppEngine

SWITCH = ("auto", "on", "off")


@dataclass(frozen=True)
class LlamaCppOptions:
    parallel: int = 8
    n_ctx: int = 0
    threads: int = 0
    kv_reuse: bool = True
    cache_ram: int = 512
    repack: str = "auto"
    flash_attn: str = "auto"
    chat_template: str | None = None


OPTIONS = (
    PARALLEL,
    N_CTX,
    THREADS,
    CHAT_TEMPLATE,
    Option(
        "kv_reuse",
        "--kv-reuse",
        boolean,
        "reuse the KV cache of earlier turns (off: every prompt is prefilled whole)",
    ),
    Option(
        "cache_ram",
        "--cache-ram",
        int,
        "MiB of host memory for the KV cells of conversations and prompts that left their "
        "sequence, restored when a later prompt begins with one (when full, a state that "
        "shares most of its tokens with another is dropped first, then the least recently "
        "saved; 0: none), as llama-server's --cache-ram",
        non_negative,
        "0 or more",
    ),
    Option(
        "repack",
        "--repack",
        str.lower,
        "lay the weights out for this CPU's own kernels (llama.cpp's extra buffer types, AMX "
        "included); auto: measured once per CPU, build and model by a probe in a child "
        "process, off where it crashes or is not faster",
        lambda v: v in SWITCH,
        "auto, on or off",
    ),
    Option(
        "flash_attn",
        "--flash-attn",
        str.lower,
        "llama.cpp's flash attention (auto: on where the backend has it, the CPU included); off "
        "makes a short message after a long history faster and batches and long prompts slower",
        lambda v: v in SWITCH,
        "auto, on or off",
    ),
)


def create_engine(config: ServerConfig, options: LlamaCppOptions) -> LlamaCppEngine:
    """``--model-path`` (a GGUF file) or the embedded SmolLM2."""
    from seedance.engines.llamacpp.engine import LlamaCppEngine
    from seedance.engines.local import chat_template_source, model_source

    path, name = model_source(config.model_path, config.model)
    return LlamaCppEngine(
        model_path=path,
        name=name,
        parallel=options.parallel,
        n_ctx=options.n_ctx,
        threads=options.threads,
        kv_reuse=options.kv_reuse,
        state_cache_mb=options.cache_ram,
        repack=options.repack,
        flash_attn=options.flash_attn,
        chat_template=chat_template_source(options.chat_template),
    )


def create_front(config: ServerConfig, options: LlamaCppOptions, info: ModelInfo) -> Engine:
    """The vocabulary of the model the engine process serves (``--engine-process``)."""
    from seedance.engines.llamacpp.engine import LlamaCppFront
    from seedance.engines.local import chat_template_source, model_source

    path, _ = model_source(config.model_path, config.model)
    return LlamaCppFront(
        model_path=path, info=info, chat_template=chat_template_source(options.chat_template)
    )


ENGINE = EngineSpec(
    create_engine,
    LlamaCppOptions,
    OPTIONS,
    "GGUF models on llama.cpp, continuous batching and KV reuse (the default).",
    front=create_front,
    local_model=True,
)
