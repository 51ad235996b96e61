"""The ``transformers`` engine: PyTorch models through Hugging Face transformers.

- :mod:`~seedance.engines.hf.loader`: model, tokenizer and device (PyTorch is imported only
  when this engine is selected);
- :mod:`~seedance.engines.hf.batch`: the KV cache of the sequences decoded together;
- :mod:`~seedance.engines.hf.engine`: the decode loop and the
  :class:`~seedance.engines.base.Engine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from seedance.engines.local import CHAT_TEMPLATE, N_CTX, PARALLEL, THREADS
from seedance.engines.registry import EngineSpec
from seedance.settings import Option

if TYPE_CHECKING:
    from seedance.config import ServerConfig
    from seedance.engines.base import ModelInfo
    from seedance.engines.batching import BatchedFront
    from seedance.engines.hf.engine import TransformersEngine


@dataclass(frozen=True)
class TransformersOptions:
    device: str = "auto"
    parallel: int = 8
    n_ctx: int = 0
    threads: int = 0
    chat_template: str | None = None


def _device(value: str) -> bool:
    return value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())


OPTIONS = (
    Option(
        "device",
        "--device",
        str.lower,
        "where the model runs (auto: the first CUDA GPU if there is one)",
        _device,
        "auto, cpu, cuda or cuda:N",
    ),
    PARALLEL,
    N_CTX,
    THREADS,
    CHAT_TEMPLATE,
)


def create_engine(config: ServerConfig, options: TransformersOptions) -> TransformersEngine:
    """``--model-path`` (a folder or a GGUF file) or the embedded SmolLM2, on ``--device``."""
    from seedance.engines.hf.loader import require_torch

    require_torch()
    from seedance.engines.hf.engine import TransformersEngine
    from seedance.engines.local import chat_template_source, model_source

    path, name = model_source(config.model_path, config.model)
    return TransformersEngine(
        model_path=path,
        name=name,
        device=options.device,
        parallel=options.parallel,
        n_ctx=options.n_ctx,
        threads=options.threads,
        chat_template=chat_template_source(options.chat_template),
    )


def create_front(
    config: ServerConfig, options: TransformersOptions, info: ModelInfo
) -> BatchedFront:
    """The tokenizer of the model the engine process serves (``--engine-process``)."""
    from seedance.engines.batching import BatchedFront
    from seedance.engines.hf.loader import load_tokenizer, require_torch, tokenizer_prompts
    from seedance.engines.local import chat_template_source, model_source

    require_torch()
    path, _ = model_source(config.model_path, config.model)
    template = chat_template_source(options.chat_template)
    prompts = tokenizer_prompts(load_tokenizer(path), info.context_length, template)
    return BatchedFront(info, prompts)


ENGINE = EngineSpec(
    create_engine,
    TransformersOptions,
    OPTIONS,
    "PyTorch models through Hugging Face transformers, on the CPU or a CUDA GPU "
    "(pip install 'seedance[transformers]').",
    front=create_front,
    local_model=True,
)
