"""The ``llamacpp`` engine: GGUF models on the CPU through llama.cpp, continuously batched."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from seedance.engines.base import (
    Engine,
    EngineHealth,
    GenerationRequest,
    ModelInfo,
    TokenDelta,
)
from seedance.engines.batching import SchedulerStats, run_job
from seedance.engines.llamacpp.native import ContextShape, LlamaContext, LlamaModel
from seedance.engines.llamacpp.scheduler import Job, Scheduler
from seedance.engines.local import (
    context_per_sequence,
    machine_cores,
    model_source,
)
from seedance.engines.prompts import Prompts
from seedance.engines.template import ChatTemplate
from seedance.eventloop import LightQueue
from seedance.protocol.messages import ChatMessage

if TYPE_CHECKING:
    from seedance.config import ServerConfig


class LlamaCppEngine(Engine):
    """Several sequences decoded together in one llama.cpp context (see ``scheduler``)."""

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
    ) -> None:
        self.model = LlamaModel(model_path)
        n_ctx_seq = context_per_sequence(n_ctx, parallel, self.model.n_ctx_train)
        shape = ContextShape(
            n_seq=parallel, n_ctx_seq=n_ctx_seq, n_batch=n_batch, threads=threads or machine_cores()
        )
        self.context = LlamaContext(self.model, shape)
        self.scheduler = Scheduler(
            self.model,
            self.context,
            state_cache_bytes=int(state_cache_mb * 1024 * 1024) if kv_reuse else 0,
            reuse=kv_reuse,
        )
        self.max_concurrency = parallel
        self._info = ModelInfo(
            name=name,
            engine="llamacpp",
            context_length=self.context.n_ctx_seq,
            max_output_tokens=self.context.n_ctx_seq,
        )
        model = self.model
        self.prompts = Prompts(
            model_template(model),
            lambda text, special: model.tokenize(text, special=special),
            self._info.context_length,
        )
        self.message_overhead_tokens, self.reply_overhead_tokens = self.prompts.overheads()

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    async def start(self) -> None:
        self.scheduler.start(asyncio.get_running_loop())

    async def close(self) -> None:
        await asyncio.to_thread(self.scheduler.stop)
        self.context.close()
        self.model.close()

    def health(self) -> EngineHealth:
        failure = self.scheduler.failure
        return EngineHealth(ok=failure is None, detail=failure or "")

    def kv_cache_usage(self) -> float:
        return self.scheduler.cells_in_use() / (self.context.shape.n_seq * self.context.n_ctx_seq)

    # -- tokens ------------------------------------------------------------------------------

    def count_tokens(self, text: str) -> int:
        return self.prompts.count(text)

    def prompt_tokens(
        self, messages: Sequence[ChatMessage], estimate: int | None = None, *, raw: bool = False
    ) -> int:
        return len(self.prompts.tokens(messages, raw))

    # -- generation --------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        prompt = self.prompts.tokens(request.messages, request.raw)
        params = request.params
        limit = min(params.max_tokens, self._info.context_length - len(prompt))
        seed = params.seed if params.seed is not None else secrets.randbits(32)
        events = LightQueue()  # filled a decode step at a time
        job = Job(prompt, params, limit, seed, events)
        async for delta in run_job(self.scheduler, job, events, request.request_id):
            yield delta


def model_template(model: LlamaModel) -> ChatTemplate:
    """The chat template in ``model``'s metadata, with its BOS and EOS texts."""
    return ChatTemplate(
        model.chat_template(),
        bos_token=model.token_text(model.bos_token()),
        eos_token=model.token_text(model.eos_token()),
    )


def create_engine(config: ServerConfig) -> LlamaCppEngine:
    """Entry point ``llamacpp``: ``--model-path`` or the embedded SmolLM2."""
    path, name = model_source(config.model_path, config.model)
    return LlamaCppEngine(
        model_path=path,
        name=name,
        parallel=config.parallel,
        n_ctx=config.n_ctx,
        threads=config.threads,
        kv_reuse=config.kv_reuse,
    )
