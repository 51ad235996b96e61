"""The ``transformers`` engine: PyTorch models through Hugging Face transformers.

- :mod:`~seedance.engines.hf.loader`: model, tokenizer and device (PyTorch is imported only
  when this engine is selected);
- :mod:`~seedance.engines.hf.batch`: the KV cache of the sequences decoded together;
- :mod:`~seedance.engines.hf.engine`: the decode loop and the
  :class:`~seedance.engines.base.Engine`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seedance.config import ServerConfig
    from seedance.engines.hf.engine import TransformersEngine


def create_engine(config: ServerConfig) -> TransformersEngine:
    """Entry point ``transformers``: ``--model-path`` (a folder or a GGUF file) or the
    embedded SmolLM2, on ``--device``."""
    from seedance.engines.hf.loader import require_torch

    require_torch()
    from seedance.engines.hf.engine import TransformersEngine
    from seedance.engines.local import model_source

    path, name = model_source(config.model_path, config.model)
    return TransformersEngine(
        model_path=path,
        name=name,
        device=config.device,
        parallel=config.parallel,
        n_ctx=config.n_ctx,
        threads=config.threads,
    )
