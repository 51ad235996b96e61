"""The ``vllm`` engine: vLLM in this process through its async engine (``AsyncLLM``).

vLLM does its own continuous batching, paged KV cache and prefix caching on CUDA GPUs; this
engine hands it token ids (rendered and counted by Seedance, so ``start`` and ``usage`` are
exact), reads its outputs as deltas, passes the request's priority through (vLLM's priority
scheduling) and aborts the request when the stream is closed (cancel, disconnect, shutdown).

vLLM is imported only when this engine is selected; it is installed with the extra
``seedance[vllm]`` and runs only on CUDA GPUs.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from seedance.config import ConfigError
from seedance.engines.base import EngineHealth, GenerationRequest, ModelInfo, TokenDelta
from seedance.engines.prompts import PromptedEngine
from seedance.protocol.errors import EngineError, InvalidRequest
from seedance.protocol.messages import FinishReason

if TYPE_CHECKING:
    from seedance.config import ServerConfig

logger = logging.getLogger(__name__)

INSTALL_HINT: Final = "pip install 'seedance[vllm]' (on a machine with a CUDA GPU)"
#: vLLM's default most sequences scheduled at once; Seedance's admission cap follows it.
VLLM_MAX_SEQS: Final = 256
_FINISH: Final[dict[str, FinishReason]] = {"stop": "stop", "length": "length"}


def require_vllm() -> Any:
    """The ``vllm`` module, or one line saying how to install it."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ConfigError(
            f"--engine vllm needs vLLM, which does not import here ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None


class VllmEngine(PromptedEngine):
    """Streams from an in-process ``vllm.v1.engine.async_llm.AsyncLLM``."""

    max_concurrency = VLLM_MAX_SEQS

    def __init__(
        self,
        *,
        model_path: Path,
        name: str,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int = 0,
    ) -> None:
        vllm = require_vllm()
        if not model_path.is_dir():
            raise ConfigError(
                f"--engine vllm needs a model folder in Hugging Face's layout: {model_path}"
            )
        from transformers import AutoTokenizer
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from seedance.engines.hf.loader import tokenizer_prompts

        self._vllm = vllm
        args = AsyncEngineArgs(
            model=str(model_path),
            served_model_name=name,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len or None,
            scheduling_policy="priority",
            enable_prefix_caching=True,
            max_num_seqs=VLLM_MAX_SEQS,
        )
        try:
            self.llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM reports bad models and GPUs in many ways
            raise ConfigError(f"vLLM cannot serve {model_path}: {exc}") from None
        context = int(self.llm.model_config.max_model_len)
        self._info = ModelInfo(
            name=name, engine="vllm", context_length=context, max_output_tokens=context
        )
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        self._use_prompts(tokenizer_prompts(tokenizer, context))

    async def close(self) -> None:
        self.llm.shutdown()

    def health(self) -> EngineHealth:
        if getattr(self.llm, "errored", False):
            return EngineHealth(ok=False, detail="the vLLM engine died")
        return EngineHealth(ok=True)

    def _sampling(self, request: GenerationRequest, prompt: list[int]) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = request.params
        return SamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=self.reply_limit(prompt, params),
            seed=params.seed,
            stop=list(params.stop) or None,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        prompt = self.prompts.tokens(request.messages, request.raw)
        sampling = self._sampling(request, prompt)
        stream = self.llm.generate(
            {"prompt_token_ids": prompt},
            sampling,
            request.request_id,
            priority=-request.priority,  # vLLM serves lower values first; Seedance higher
        )
        try:
            async for output in stream:
                for completion in output.outputs[:1]:
                    finish = completion.finish_reason
                    if finish is not None:
                        yield TokenDelta(
                            completion.text, len(completion.token_ids), _FINISH.get(finish, "stop")
                        )
                        return
                    if completion.token_ids:
                        yield TokenDelta(completion.text, len(completion.token_ids))
        except ValueError as exc:  # vLLM's validation of a request
            raise InvalidRequest(f"vLLM refused the request: {exc}") from None
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":
                raise EngineError("the vLLM engine died; the server must be restarted") from None
            raise
        finally:
            await stream.aclose()  # aborts the request in vLLM when it has not finished


def create_engine(config: ServerConfig) -> VllmEngine:
    """Entry point ``vllm``: ``--model-path`` (a Hugging Face model folder) on the GPUs."""
    require_vllm()
    if not config.model_path:
        raise ConfigError("--engine vllm needs --model-path (a Hugging Face model folder)")
    path = Path(config.model_path).expanduser()
    return VllmEngine(
        model_path=path,
        name=config.model or path.name,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=config.gpu_memory_utilization,
        max_model_len=config.n_ctx,
    )
