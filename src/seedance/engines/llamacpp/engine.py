"""The ``llamacpp`` engine: GGUF models on the CPU through llama.cpp, continuously batched."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llguidance import LLTokenizer
from llguidance.llamacpp import lltokenizer_from_vocab

from seedance.engines.base import ModelInfo, SamplingParams
from seedance.engines.batching import BatchedEngine, BatchedFront
from seedance.engines.llamacpp.cpu import resolve_repack
from seedance.engines.llamacpp.native import ContextShape, LlamaContext, LlamaModel, on_abort
from seedance.engines.llamacpp.scheduler import Job, Scheduler
from seedance.engines.local import context_per_sequence, machine_cores
from seedance.engines.prompts import Prompts
from seedance.engines.template import ChatTemplate

logger = logging.getLogger(__name__)


class LlamaCppEngine(BatchedEngine):
    """Several sequences decoded together in one llama.cpp context (see ``scheduler``)."""

    loop: Scheduler

    def __init__(
        self,
        *,
        model_path: Path,
        name: str,
        parallel: int = 8,
        n_ctx: int = 0,
        threads: int = 0,
        n_batch: int = 512,
        state_cache_mb: float = 512.0,
        kv_reuse: bool = True,
        repack: str = "auto",
        flash_attn: str = "auto",
        chat_template: str | None = None,
    ) -> None:
        threads = threads or machine_cores()
        self.repack = resolve_repack(repack, model_path, threads)
        logger.info("llama.cpp: %s", self.repack.describe())
        self.model = model = LlamaModel(model_path, repack=self.repack.repack)
        n_ctx_seq = context_per_sequence(n_ctx, parallel, model.n_ctx_train)
        shape = ContextShape(parallel, n_ctx_seq, n_batch, threads, flash_attn)
        self.context = LlamaContext(model, shape)
        self.loop = Scheduler(
            model,
            self.context,
            state_cache_bytes=int(state_cache_mb * 1024 * 1024) if kv_reuse else 0,
            reuse=kv_reuse,
        )
        self.max_concurrency = parallel
        self._remove_abort_hook: Callable[[], None] = lambda: None
        self._info = ModelInfo(
            name=name,
            engine="llamacpp",
            context_length=self.context.n_ctx_seq,
            max_output_tokens=self.context.n_ctx_seq,
            version=Path(model_path).name,
        )
        self._use_prompts(model_prompts(model, chat_template, self._info.context_length))
        self._use_grammars(lambda: grammar_vocabulary(model))

    async def start(self) -> None:
        await super().start()
        self._remove_abort_hook = on_abort(self._aborted)
        logger.info("llama.cpp decode thread: %s", self.loop.thread_label())

    async def close(self) -> None:
        self._remove_abort_hook()
        await super().close()
        self.context.close()
        self.model.close()

    def _aborted(self, message: str) -> None:
        """llama.cpp is aborting the process: say where the engine was, fail what runs (in
        an engine process of its own, the server goes on with it in the next one instead)."""
        logger.critical("the llamacpp engine was at %s", self.loop.describe())
        if not self.own_process:
            self.loop.abort(f"llama.cpp aborted ({message}); the server is going down")

    def kv_cache_usage(self) -> float:
        return self.loop.cells_in_use() / (self.context.shape.n_seq * self.context.n_ctx_seq)

    def _job(
        self, prompt: list[int], params: SamplingParams, limit: int, seed: int, sink: Any
    ) -> Job:
        return Job(prompt, params, limit, seed, sink, self.model)


class LlamaCppFront(BatchedFront):
    """The ``llamacpp`` engine as the server needs it when the model runs in the engine
    process (``--engine-process``): the GGUF's vocabulary and chat template alone."""

    def __init__(self, *, model_path: Path, info: ModelInfo, chat_template: str | None) -> None:
        self.model = LlamaModel(model_path, vocab_only=True)
        super().__init__(info, model_prompts(self.model, chat_template, info.context_length))

    async def close(self) -> None:
        self.model.close()


def model_prompts(model: LlamaModel, chat_template: str | None, context_length: int) -> Prompts:
    """Prompts as ``model`` renders and tokenizes them (``chat_template``: its template's
    source instead of the model's own)."""
    return Prompts(
        model_template(model, chat_template),
        lambda text, special: model.tokenize(text, special=special),
        context_length,
        decode=model.detokenize,
        vocab_size=model.vocab_size,
        tokenize=lambda text, bos: model.tokenize(text, special=bos, parse_special=True),
    )


def grammar_vocabulary(model: LlamaModel) -> LLTokenizer:
    """``model``'s vocabulary as llguidance reads it (llguidance's own bridge; it calls a
    function llama-cpp-python 0.3.36 marks deprecated, once per token: silenced here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return lltokenizer_from_vocab(model.vocab)


def model_template(model: LlamaModel, source: str | None = None) -> ChatTemplate:
    """The chat template in ``model``'s metadata (or ``source``, one given instead), with its
    BOS and EOS texts."""
    return ChatTemplate(
        source or model.chat_template(),
        bos_token=model.token_text(model.bos_token()),
        eos_token=model.token_text(model.eos_token()),
    )
