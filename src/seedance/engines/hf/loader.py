"""Loading a model and its tokenizer with transformers, offline.

``--model-path`` is a folder in Hugging Face's layout (``config.json``, weights, tokenizer) or
a GGUF file, which transformers dequantizes on load (this needs the ``gguf`` package). Nothing
is fetched from a hub: a model that is not on disk is an error.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from seedance.config import ConfigError
from seedance.engines.prompts import Prompts
from seedance.engines.template import ChatTemplate

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

INSTALL_HINT: Final = "pip install 'seedance[transformers]'"


def require_torch() -> None:
    """Fail with one line when PyTorch or transformers is missing."""
    for module in ("torch", "transformers"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"--engine transformers needs {module}, which does not import ({exc}); "
                f"install it with: {INSTALL_HINT}"
            ) from None


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA GPU when there is one, else the CPU."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(
                f"--device {name}: PyTorch sees no CUDA GPU here "
                f"(torch {torch.__version__}); use --device cpu"
            )
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: there are {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(name)


@dataclass(frozen=True)
class Loaded:
    model: Any  # a transformers PreTrainedModel (causal LM, or not), in eval mode on ``device``
    tokenizer: Any  # a transformers tokenizer
    device: torch.device
    dtype: torch.dtype


def load(path: Path, device_name: str, threads: int, *, causal: bool = True) -> Loaded:
    """The model and tokenizer at ``path`` on ``device_name``: a causal LM, or with
    ``causal=False`` the bare transformer (an embedding model's)."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    device = resolve_device(device_name)
    if device.type == "cpu":
        torch.set_num_threads(threads)
        dtype = torch.float32
    else:
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    folder, extra = _files(path)
    logger.info("loading %s on %s with transformers (%s)", path, device, dtype)
    tokenizer = load_tokenizer(path)
    with _loading(path):
        kind = AutoModelForCausalLM if causal else AutoModel
        model: Any = kind.from_pretrained(
            folder, local_files_only=True, dtype=dtype, attn_implementation="sdpa", **extra
        )
    model = model.to(device).eval()
    return Loaded(model=model, tokenizer=tokenizer, device=device, dtype=dtype)


def load_tokenizer(path: Path) -> Any:
    """The tokenizer of the model at ``path`` (a folder or a GGUF file)."""
    from transformers import AutoTokenizer

    folder, extra = _files(path)
    with _loading(path):
        return AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)


def _files(path: Path) -> tuple[Path, dict[str, str]]:
    """The folder transformers loads from, and the GGUF file in it if ``path`` names one."""
    if not path.exists():
        raise ConfigError(f"model not found: {path} (give a model folder or a GGUF file)")
    if path.is_dir():
        return path, {}
    return path.parent, {"gguf_file": path.name}


@contextlib.contextmanager
def _loading(path: Path) -> Iterator[None]:
    """transformers' errors while loading ``path`` as one-line :class:`ConfigError`."""
    try:
        yield
    except ImportError as exc:  # gguf or accelerate missing
        raise ConfigError(f"cannot load {path}: {exc}; install with: {INSTALL_HINT}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"transformers cannot load {path}: {first}") from None


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2 and most recent models) writes each byte as one printable
    character: printable Latin-1 bytes as themselves, the others as U+0100 onwards."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in shown}
    hidden = (b for b in range(256) if b not in table.values())
    for offset, b in enumerate(hidden):
        table[chr(0x100 + offset)] = b
    return table


def token_pieces(tokenizer: Any) -> list[bytes]:
    """The bytes each token id stands for in generated text; special tokens stand for none.

    Byte-level BPE vocabularies map characters back to bytes, SentencePiece ones turn ``▁``
    into a space and ``<0xNN>`` into that byte; any other tokenizer decodes tokens one by one.
    """
    size = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", {}))
    special.update(i for i, token in added.items() if getattr(token, "special", False))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = type(getattr(backend, "decoder", None)).__name__
    alphabet = _byte_level_alphabet()
    names = tokenizer.convert_ids_to_tokens(list(range(size)))
    pieces: list[bytes] = []
    for token_id, name in enumerate(names):
        if token_id in special or name is None:
            pieces.append(b"")
        elif token_id in added:
            pieces.append(str(added[token_id].content).encode())
        elif decoder == "ByteLevel" and all(c in alphabet for c in name):
            pieces.append(bytes(alphabet[c] for c in name))
        elif name.startswith("<0x") and name.endswith(">") and len(name) == 6:
            pieces.append(bytes([int(name[3:5], 16)]))
        elif "\u2581" in name:
            pieces.append(name.replace("\u2581", " ").encode())
        else:
            pieces.append(tokenizer.decode([token_id]).encode())
    return pieces


def stop_tokens(loaded: Loaded) -> frozenset[int]:
    """Token ids that end a reply: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def tokenizer_prompts(
    tokenizer: Any, context_length: int, chat_template: str | None = None
) -> Prompts:
    """Prompts rendered with the tokenizer's chat template (``chat_template``, one given
    instead; ChatML when it has none) and tokenized by it."""
    template = ChatTemplate(
        chat_template or getattr(tokenizer, "chat_template", None),
        bos_token=tokenizer.bos_token or "",
        eos_token=tokenizer.eos_token or "",
    )
    return Prompts(
        template,
        lambda text, special: list(tokenizer.encode(text, add_special_tokens=special)),
        context_length,
        decode=lambda tokens: str(tokenizer.decode(list(tokens))),
        vocab_size=len(tokenizer),
    )
