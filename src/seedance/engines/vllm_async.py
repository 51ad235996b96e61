"""The ``vllm`` engine: vLLM in this process through its async engine (``AsyncLLM``).

vLLM does its own continuous batching, paged KV cache and prefix caching on CUDA GPUs; this
engine hands it token ids (rendered and counted by Seedance, so ``start`` and ``usage`` are
exact), reads its outputs as deltas, passes the request's priority through (vLLM's priority
scheduling) and aborts the request when the stream is closed before its end (cancel,
disconnect, shutdown).

It is written against vLLM 0.10 to 0.33 (read from their source; see docs/engines.md), where
these differ:

- request ids must be unique among live requests up to 0.13 (0.14 adds a suffix itself): each
  request gets its own id here, so two clients may pick the same one;
- validation errors are ``ValueError`` up to 0.26 and ``VLLMClientError`` from 0.27;
- finish reasons: ``error`` from 0.13, ``repetition`` from 0.17;
- token prompts: ``tokens_input`` from 0.19 (a plain ``TokensPrompt`` is deprecated from 0.17);
- GGUF files are read by vLLM itself up to 0.23, and from 0.24 only with ``vllm-gguf-plugin``.

vLLM is imported only when this engine is selected; it is installed with the extra
``seedance[vllm]`` and runs only on CUDA GPUs.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import re
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from seedance.config import ConfigError
from seedance.engines.base import EngineHealth, GenerationRequest, ModelInfo, TokenDelta
from seedance.engines.prompts import PromptedEngine
from seedance.engines.registry import EngineSpec
from seedance.protocol.errors import EngineError, InvalidRequest, SeedanceError
from seedance.protocol.messages import FinishReason, TokenLogprob, TopLogprob
from seedance.protocol.schemas import OutputSchema
from seedance.settings import Option, non_negative

if TYPE_CHECKING:
    from seedance.config import ServerConfig

logger = logging.getLogger(__name__)

INSTALL_HINT: Final = "pip install 'seedance[vllm]' (on a machine with a CUDA GPU)"
#: vLLM's default most sequences scheduled at once; Seedance's admission cap follows it.
VLLM_MAX_SEQS: Final = 256
#: ``repetition`` ends a reply that repeats itself (only when a request asks for it).
_FINISH: Final[dict[str, FinishReason]] = {"stop": "stop", "length": "length", "repetition": "stop"}
#: Sampling settings a model's ``generation_config`` may give (what ``vllm serve`` applies).
_MODEL_DEFAULTS: Final = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
#: Settings of Seedance's own requests; the model's default applies only where the client left
#: them to the server (see ``SamplingParams.unset``).
_REQUESTED: Final = frozenset({"temperature", "top_p"})
_GGUF_PLUGIN: Final = "vllm_gguf_plugin"


def require_vllm() -> Any:
    """The ``vllm`` module, or one line saying how to install it."""
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ConfigError(
            f"--engine vllm needs vLLM, which does not import here ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from None


def structured_output(schema: OutputSchema) -> dict[str, Any]:
    """The ``SamplingParams`` field that binds a reply to ``schema``: ``structured_outputs``
    where this vLLM has ``StructuredOutputsParams`` (the later releases), else
    ``guided_decoding`` (``GuidedDecodingParams``, the releases before the rename). Found by
    import, not by version number: untested here (no GPU was lent)."""
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(json=schema.text)}
    return {"structured_outputs": StructuredOutputsParams(json=schema.text)}


def vllm_version(vllm: Any) -> tuple[int, int]:
    """(major, minor) of the installed vLLM; ``0.14.1.dev3+g1234`` is (0, 14)."""
    match = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return (int(match[1]), int(match[2])) if match else (0, 0)


def _refusals() -> tuple[type[BaseException], ...]:
    """The exceptions vLLM raises for a request it will not run (its validation)."""
    kinds: list[type[BaseException]] = [ValueError]  # up to 0.26
    try:
        exceptions = importlib.import_module("vllm.exceptions")  # 0.14 on
    except ImportError:
        return tuple(kinds)
    client = getattr(exceptions, "VLLMClientError", None)  # 0.27 on: not a ValueError
    if isinstance(client, type) and issubclass(client, BaseException):
        kinds.append(client)
    return tuple(kinds)


def _token_prompt() -> Callable[[list[int]], Any]:
    """How this vLLM takes a prompt of token ids."""
    inputs = importlib.import_module("vllm.inputs")
    tokens_input = getattr(inputs, "tokens_input", None)  # 0.19 on
    if tokens_input is not None:
        return tokens_input  # type: ignore[no-any-return]
    tokens_prompt = inputs.TokensPrompt
    return lambda ids: tokens_prompt(prompt_token_ids=ids)


def _load_tokenizer(model_path: Path, from_gguf: bool) -> Any:
    from transformers import AutoTokenizer

    where: dict[str, Any] = {"local_files_only": True}
    folder = model_path
    if not model_path.is_dir():
        folder = model_path.parent
        if from_gguf:
            where["gguf_file"] = model_path.name
    try:
        return AutoTokenizer.from_pretrained(folder, **where)
    except (OSError, ValueError, KeyError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"cannot load the tokenizer of {model_path}: {first}") from None


class VllmEngine(PromptedEngine):
    """Streams from an in-process ``vllm.v1.engine.async_llm.AsyncLLM``."""

    logprobs = True  # vLLM's own (``SamplingParams.logprobs``)

    def __init__(
        self,
        *,
        model_path: Path,
        name: str,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int = 0,
        max_num_seqs: int = VLLM_MAX_SEQS,
    ) -> None:
        vllm = require_vllm()
        self.version = vllm_version(vllm)
        shown = getattr(vllm, "__version__", "?")
        gguf = model_path.suffix.lower() == ".gguf"
        if gguf:
            self._check_gguf(model_path, shown)
        elif not model_path.is_dir():
            raise ConfigError(
                f"--engine vllm needs a model folder in Hugging Face's layout or a GGUF file: "
                f"{model_path}"
            )
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from seedance.engines.hf.loader import tokenizer_prompts

        self.max_concurrency = max_num_seqs
        args = AsyncEngineArgs(
            model=str(model_path),
            served_model_name=name,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len or None,
            scheduling_policy="priority",
            enable_prefix_caching=True,
            max_num_seqs=max_num_seqs,
        )
        try:
            self.llm = AsyncLLM.from_engine_args(args)
        except Exception as exc:  # vLLM reports bad models and GPUs in many ways
            raise ConfigError(f"vLLM {shown} cannot serve {model_path}: {exc}") from None
        context = int(self.llm.model_config.max_model_len)
        self._info = ModelInfo(
            name=name,
            engine="vllm",
            context_length=context,
            max_output_tokens=context,
            version=f"{model_path.name} (vLLM {shown})",
        )
        # vLLM reads the tokenizer of a GGUF file from the file up to 0.23; its plugin (0.24
        # on) from the folder beside it, as Seedance does then.
        tokenizer = _load_tokenizer(model_path, from_gguf=gguf and self.version < (0, 24))
        self._use_prompts(tokenizer_prompts(tokenizer, context))
        self._refusals = _refusals()
        self._prompt = _token_prompt()
        self._ids = itertools.count(1)
        wanted = self.llm.model_config.get_diff_sampling_param() or {}
        self.model_defaults = {k: v for k, v in wanted.items() if k in _MODEL_DEFAULTS}
        if self.model_defaults:
            logger.info("the model's generation_config sets %s", self.model_defaults)

    def _check_gguf(self, model_path: Path, shown: str) -> None:
        if not model_path.is_file():
            raise ConfigError(f"model not found: {model_path}")
        if self.version < (0, 24):
            return
        if importlib.util.find_spec(_GGUF_PLUGIN) is None:
            raise ConfigError(
                f"vLLM {shown} reads GGUF files only with its plugin (pip install "
                "vllm-gguf-plugin; vLLM 0.23 and older read them itself); or serve "
                f"{model_path.name} with --engine llamacpp"
            )
        if not (model_path.parent / "config.json").is_file():
            raise ConfigError(
                f"vLLM {shown} with vllm-gguf-plugin needs the model's Hugging Face config.json "
                f"and tokenizer files beside {model_path.name}, in {model_path.parent}"
            )

    async def close(self) -> None:
        self.llm.shutdown()

    def health(self) -> EngineHealth:
        if getattr(self.llm, "errored", False):
            return EngineHealth(ok=False, detail="the vLLM engine died")
        return EngineHealth(ok=True)

    def unfinished_requests(self) -> int | None:
        processor = getattr(self.llm, "output_processor", None)
        count = getattr(processor, "get_num_unfinished_requests", None)
        return None if count is None else int(count())

    def _sampling(self, request: GenerationRequest, prompt: list[int]) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = request.params
        model = self.model_defaults
        chosen = {k: v for k, v in model.items() if k not in _REQUESTED or k in params.unset}
        sampling: dict[str, Any] = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            **chosen,
            "n": 1,
            "max_tokens": self.reply_limit(prompt, params),
            "seed": params.seed,
            "stop": list(params.stop) or None,
            "output_kind": RequestOutputKind.DELTA,
        }
        if params.schema is not None:
            sampling.update(structured_output(params.schema))
        if params.logprobs is not None:
            sampling["logprobs"] = params.logprobs
        if params.ignore_eos:
            sampling["ignore_eos"] = True
        return SamplingParams(**sampling)

    def check_schema(self, schema: OutputSchema, field: str) -> None:
        """Any JSON Schema: vLLM's structured-output backend decides (its refusal is passed
        on). Tools are refused (the generic format's grammar is llguidance's dialect)."""
        if schema.kind != "json":
            super().check_schema(schema, field)

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        prompt = self.prompts.tokens(
            request.messages, request.raw, request.continuation, request.params.tools
        )
        request_id = request.request_id
        try:
            sampling = self._sampling(request, prompt)
        except self._refusals as exc:
            raise InvalidRequest(f"vLLM refused the request: {exc}") from None
        stream = self.llm.generate(
            self._prompt(prompt),
            sampling,
            f"{request_id}.{next(self._ids)}",  # clients may reuse ids; vLLM <= 0.13 may not
            priority=-request.priority,  # vLLM serves lower values first; Seedance higher
        )
        held = 0  # tokens of deltas that carried no text yet (a held-back stop, a cut char)
        top = request.params.logprobs
        entries: list[TokenLogprob] | None = None if top is None else []  # of held tokens too
        final: tuple[str, int, str] | None = None
        try:
            async for output in stream:
                for completion in output.outputs[:1]:
                    tokens = held + len(completion.token_ids)
                    if entries is not None and top is not None:
                        entries.extend(vllm_logprobs(completion, top))
                    if completion.finish_reason is not None:
                        final = (completion.text, tokens, str(completion.finish_reason))
                    elif completion.text:
                        held = 0
                        yield TokenDelta(completion.text, tokens, logprobs=entries)
                        entries = None if entries is None else []
                    else:
                        held = tokens
            # vLLM's generator ends right after its finished output: reading it to its end
            # (rather than closing it at that output) does not abort a finished request.
        except self._refusals as exc:
            raise InvalidRequest(f"vLLM refused the request: {exc}") from None
        except SeedanceError:
            raise
        except Exception as exc:
            if type(exc).__name__ == "EngineDeadError":
                raise EngineError("the vLLM engine died; the server must be restarted") from None
            logger.exception("vLLM failed request %s", request_id)
            raise EngineError(
                f"vLLM failed request {request_id} ({type(exc).__name__}); retry"
            ) from None
        finally:
            await stream.aclose()  # aborts the request in vLLM when it has not finished
        if final is None:
            raise EngineError(f"vLLM ended request {request_id} without a finish reason; retry")
        text, tokens, reason = final
        yield TokenDelta(text, tokens, _finish_reason(reason, request_id), entries)


def vllm_logprobs(completion: Any, top: int) -> list[TokenLogprob]:
    """The entries of a delta's tokens from vLLM's ``logprobs`` (per token, a map of token
    ids to ``Logprob(logprob, rank, decoded_token)``: the sampled token and the ``top``
    likeliest, from the raw logits in vLLM's default ``logprobs_mode``)."""

    def text(logprob: Any) -> str:
        return logprob.decoded_token or ""

    out = []
    for token, ranked in zip(completion.token_ids, completion.logprobs or (), strict=False):
        chosen = ranked[token]
        best = sorted(
            (lp for lp in ranked.values() if lp.rank is not None and lp.rank <= top),
            key=lambda lp: lp.rank,
        )
        tops = [TopLogprob(text(lp), lp.logprob, list(text(lp).encode())) for lp in best]
        out.append(TokenLogprob(text(chosen), chosen.logprob, list(text(chosen).encode()), tops))
    return out


def _finish_reason(reason: str, request_id: str) -> FinishReason:
    """Seedance's finish reason for vLLM's; a request vLLM ended otherwise is an error."""
    finish = _FINISH.get(reason)
    if finish is not None:
        return finish
    if reason == "abort":  # not by this engine: a closed stream is not read to its end
        logger.warning("vLLM aborted request %s", request_id)
        raise EngineError(f"vLLM aborted request {request_id}; retry")
    logger.error("vLLM ended request %s with finish reason %r", request_id, reason)
    raise EngineError(f"vLLM ended request {request_id} with an error ({reason}); retry")


@dataclass(frozen=True)
class VllmOptions:
    n_ctx: int = 0
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9


OPTIONS = (
    Option(
        "n_ctx",
        "--n-ctx",
        int,
        "the most tokens of one sequence (vLLM's max_model_len; 0: the model's)",
        non_negative,
        "0 or more",
    ),
    Option(
        "tensor_parallel_size",
        "--tensor-parallel-size",
        int,
        "GPUs the model is split across",
        lambda v: v >= 1,
        "1 or more",
    ),
    Option(
        "gpu_memory_utilization",
        "--gpu-memory-utilization",
        float,
        "share of each GPU's memory vLLM may take",
        lambda v: 0 < v <= 1,
        "above 0 and at most 1",
    ),
)


def create_engine(config: ServerConfig, options: VllmOptions) -> VllmEngine:
    """``--model-path`` (a Hugging Face model folder, or a GGUF file)."""
    require_vllm()
    if not config.model_path:
        raise ConfigError(
            "--engine vllm needs --model-path (a Hugging Face model folder or a GGUF file)"
        )
    path = Path(config.model_path).expanduser()
    return VllmEngine(
        model_path=path,
        name=config.model or path.name,
        tensor_parallel_size=options.tensor_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        max_model_len=options.n_ctx,
        max_num_seqs=config.max_running or VLLM_MAX_SEQS,
    )


ENGINE = EngineSpec(
    create_engine,
    VllmOptions,
    OPTIONS,
    "Models on NVIDIA GPUs through vLLM's AsyncLLM (pip install 'seedance[vllm]'; needs "
    "--model-path).",
    local_model=True,
)
