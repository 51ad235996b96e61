"""The ``llamacpp`` engine: GGUF models through llama.cpp, the embedded default.

- :mod:`~seedance.engines.llamacpp.native`: a typed layer over llama.cpp's C API;
- :mod:`~seedance.engines.llamacpp.scheduler`: the decode thread (continuous batching, KV reuse);
- :mod:`~seedance.engines.llamacpp.engine`: the :class:`~seedance.engines.base.Engine`.
"""

from seedance.engines.llamacpp.engine import LlamaCppEngine, create_engine
from seedance.engines.local import default_model_path

__all__ = ["LlamaCppEngine", "create_engine", "default_model_path"]
