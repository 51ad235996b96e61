"""``AsyncLLM``: records what it is given and streams scripted replies, with vLLM's rules for
request ids, refusals and aborts (they changed at 0.14 and 0.27)."""

import asyncio
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm import version
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.sampling_params import SamplingParams, invalid
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

#: A reply: (text, token ids, finish reason or None) per output.
Script = list[tuple[str, list[int], str | None]]


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class Request:
    prompt: Any
    params: SamplingParams
    request_id: str
    priority: int


def _gguf_plugin() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm_gguf_plugin") is not None


def _client_errors() -> tuple[type[Exception], ...]:
    """What ``generate`` re-raises as it is from 0.27 (``VLLMClientError``)."""
    if version() < (0, 27):
        return ()
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError,)


def count_up(prompt: Any, params: SamplingParams) -> Script:
    """The default reply: ``max_tokens`` tokens ``t0 t1 ...``, then ``length``."""
    n = params.max_tokens or 16
    return [(f"t{i} ", [100 + i], "length" if i == n - 1 else None) for i in range(n)]


@dataclass
class ModelConfig:
    max_model_len: int
    generation_config: dict[str, Any] = field(default_factory=dict)

    def get_diff_sampling_param(self) -> dict[str, Any]:
        return dict(self.generation_config)


class OutputProcessor:
    def __init__(self) -> None:
        self.request_states: dict[str, Request] = {}

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)


class AsyncLLM:
    #: The engine made last, for the tests to look into.
    last: ClassVar["AsyncLLM | None"] = None
    #: The model's generation_config sampling defaults, for engines made from now on.
    generation_config: ClassVar[dict[str, Any]] = {}

    def __init__(self, args: AsyncEngineArgs) -> None:
        if args.model.endswith(".gguf") and version() >= (0, 24) and not _gguf_plugin():
            raise OSError(
                f"It looks like the config file at '{args.model}' is not a valid JSON file."
            )
        self.args = args
        self.model_config = ModelConfig(args.max_model_len or 2048, dict(self.generation_config))
        self.output_processor = OutputProcessor()
        self.requests: list[Request] = []
        self.aborted: list[str] = []
        self.script: Callable[[Any, SamplingParams], Script] = count_up
        self.refuse: str | None = None  # a message: the next requests are refused with it
        self.fail: Exception | None = None  # raised inside the engine for the next requests
        self.step_s = 0.0  # pause between outputs
        self.errored = False
        self.shut_down = False
        AsyncLLM.last = self

    @classmethod
    def from_engine_args(cls, args: AsyncEngineArgs) -> "AsyncLLM":
        return cls(args)

    def shutdown(self) -> None:
        self.shut_down = True

    async def abort(self, request_id: str, internal: bool = False) -> None:
        self.aborted.append(request_id)
        self.output_processor.request_states.pop(request_id, None)

    def _add(self, prompt: Any, params: SamplingParams, request_id: str, priority: int) -> str:
        live = self.output_processor.request_states
        if version() < (0, 14):
            if request_id in live:
                raise ValueError(f"Request id {request_id} already running.")
        else:
            request_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        if self.refuse is not None:
            raise invalid(self.refuse)
        request = Request(prompt, params, request_id, priority)
        self.requests.append(request)
        live[request_id] = request
        return request_id

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, *, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]:
        internal: str | None = None
        try:
            internal = self._add(prompt, sampling_params, request_id, priority)
            if self.fail is not None:
                raise self.fail
            script = self.script(prompt, sampling_params)
            for text, token_ids, finish in script:
                await asyncio.sleep(self.step_s)
                if finish is not None:
                    self.output_processor.request_states.pop(internal, None)
                output = CompletionOutput(text, token_ids, finish)
                yield RequestOutput(request_id, [output], finish is not None)
                if finish is not None:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            if internal is not None:
                await self.abort(internal, internal=True)
            raise
        except EngineDeadError:
            raise
        except ValueError:
            if version() >= (0, 27):  # plain ValueErrors are wrapped from 0.27
                raise EngineGenerateError() from None
            raise
        except Exception as exc:
            if isinstance(exc, _client_errors()):
                raise
            if internal is not None:
                await self.abort(internal, internal=True)
            raise EngineGenerateError() from exc
