"""The ``openai`` engine (gateway mode): replies streamed from OpenAI-compatible servers.

Seedance adds its sessions, WebSocket protocol and controls in front of any server that speaks
OpenAI's chat completions API (vLLM, TGI, llama.cpp's server, Ollama, another Seedance).

- **Routing**: by SLA class and load (:mod:`seedance.engines.routing`): among the healthy
  upstreams that serve the request's class, the one with the lowest expected wait (its p99
  time to first token, times its requests in flight and waiting, over its free KV cache).
- **Circuit breaking**: an upstream that fails (connection error, timeout before the first
  byte, HTTP 429 or 5xx, a broken stream) is left out for ``upstream_cooldown_s``, then probed
  (``GET /models``) until it answers, and only then used again.
- **Retry**: a request that fails before its first token is tried once more on another
  upstream; after the first token a failure ends it with ``engine_error``.
- **Cancel**: closing the reply closes the upstream HTTP request, which aborts it there.
- **Schemas**: a reply bound to a JSON Schema is asked of the upstream as OpenAI's
  ``response_format`` (``json_schema``), on both of its endpoints; **log probabilities** as
  ``logprobs``/``top_logprobs`` (chat) or ``logprobs`` (completions), read back per chunk.
- **Tools** are passed on (``tools``, ``tool_choice``, ``parallel_tool_calls``; the history's
  calls and results as OpenAI's messages), and the upstream's streamed ``delta.tool_calls``
  are written as a reply in the generic format (:class:`~seedance.protocol.tools.CallWriter`),
  which every API reads and checks as it reads the embedded engine's.

Upstream 4xx answers other than 429 are the request's fault: they are passed on (400 as
``invalid_request``, with the upstream's message) and do not count against the upstream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.request
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import msgspec

from seedance.config import ConfigError
from seedance.engines.base import (
    Engine,
    EngineHealth,
    GenerationRequest,
    ModelInfo,
    TokenDelta,
    estimated_tokens,
)
from seedance.engines.registry import EngineSpec
from seedance.engines.routing import ROUTINGS, Upstream, choose, prefix_blocks
from seedance.protocol.errors import EngineError, InvalidRequest
from seedance.protocol.messages import ChatMessage, FinishReason
from seedance.protocol.openai import ChunkChoice, decode_stream_chunk, sse_data
from seedance.protocol.schemas import OutputSchema
from seedance.protocol.tools import CallWriter
from seedance.settings import Option, non_negative, one_of, positive, urls

if TYPE_CHECKING:
    from seedance.config import ServerConfig

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT: Final = 8192
_FINISH: Final[dict[str, FinishReason]] = {"stop": "stop", "length": "length"}


_encode = msgspec.json.Encoder().encode


class UpstreamFailure(Exception):
    """The upstream, not the request, failed: fail over and cool it down."""


class OpenAIUpstreamEngine(Engine):
    message_overhead_tokens = 4
    reply_overhead_tokens = 3
    logprobs = True  # the upstream's own, asked for and read back

    def __init__(
        self,
        upstreams: tuple[str, ...],
        *,
        name: str | None = None,
        upstream_model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        cooldown_s: float = 10.0,
        metrics_s: float = 5.0,
        max_concurrency: int = 1024,
        routing: str = "load",
    ) -> None:
        if not upstreams:
            raise ConfigError("the openai engine needs --upstream http://host:port/v1")
        self.upstreams = [Upstream.parse(u) for u in upstreams]
        self.routing = routing
        self._turn = 0  # requests routed so far (round-robin)
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self.metrics_s = metrics_s
        self.max_concurrency = max_concurrency
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        context = DEFAULT_CONTEXT
        if upstream_model is None:  # ask the upstreams, before serving starts
            upstream_model, context = self._discover()
        self.upstream_model: str = upstream_model
        self._info = ModelInfo(
            name=name or upstream_model,
            engine="openai",
            context_length=context,
            max_output_tokens=context,
            version=upstream_model,
        )
        self._session: aiohttp.ClientSession | None = None
        self._prober: asyncio.Task[None] | None = None
        self._scraper: asyncio.Task[None] | None = None

    @property
    def info(self) -> ModelInfo:
        return self._info

    def _discover(self) -> tuple[str, int]:
        """The first model an upstream lists, and its context length where it says."""
        problems = []
        for upstream in self.upstreams:
            request = urllib.request.Request(f"{upstream.base_url}/models", headers=self._headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    model = json.loads(response.read())["data"][0]
            except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                problems.append(f"{upstream.base_url}: {exc}")
                upstream.down_until = time.monotonic() + self.cooldown_s
                continue
            length = model.get("max_model_len") or model.get("context_length")
            return str(model["id"]), length if isinstance(
                length, int
            ) and length > 0 else DEFAULT_CONTEXT
        raise ConfigError(
            "no upstream lists a model (GET /models); pass --upstream-model NAME. "
            + "; ".join(problems)
        )

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=60),
            timeout=aiohttp.ClientTimeout(total=None, connect=self.timeout_s),
        )
        self._prober = asyncio.create_task(self._probe_forever(), name="upstream-prober")
        if self.metrics_s > 0:
            self._scraper = asyncio.create_task(self._scrape_forever(), name="upstream-metrics")

    async def close(self) -> None:
        for task in (self._prober, self._scraper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def health(self) -> EngineHealth:
        if any(u.up for u in self.upstreams):
            return EngineHealth(ok=True)
        return EngineHealth(ok=False, detail="every upstream is down")

    def prompt_cache(self) -> tuple[int, int] | None:
        """Its upstreams' prompt tokens and cache hits, as their /metrics last said (those
        that say)."""
        figures = [u.prompt_cache for u in self.upstreams if u.prompt_cache is not None]
        if not figures:
            return None
        return sum(p for p, _ in figures), sum(c for _, c in figures)

    def count_tokens(self, text: str) -> int:
        return estimated_tokens(text)  # the upstream's tokenizer is unknown

    # -- upstream choice and health ----------------------------------------------------------

    def _pick(
        self,
        request_id: str,
        exclude: Upstream | None,
        service_class: str | None,
        blocks: list[bytes],
    ) -> tuple[Upstream, int]:
        """The upstream a request goes to, and the blocks of its prompt it does not hold
        (one at least: the prompt's tail, shorter than a block)."""
        upstreams = (u for u in self.upstreams if u is not exclude)
        upstream = choose(upstreams, service_class, blocks, routing=self.routing, turn=self._turn)
        if upstream is None:
            raise EngineError("no upstream is available; retry later")
        self._turn += 1
        matched = upstream.prefixes.matched(blocks)
        if logger.isEnabledFor(logging.DEBUG):  # not the in-flight list of every request
            logger.debug(
                "request %s goes to %s: %d of its %d prefix blocks sent there before; "
                "requests in flight: %s",
                request_id,
                upstream.base_url,
                matched,
                len(blocks),
                " ".join(str(u.in_flight) for u in self.upstreams),
            )
        upstream.prefixes.remember(blocks)  # its KV cache holds them now
        return upstream, len(blocks) - matched + 1

    def _failed(self, upstream: Upstream, why: str) -> None:
        upstream.failures += 1
        if upstream.up:
            logger.warning(
                "upstream %s is out for %.0f s: %s", upstream.base_url, self.cooldown_s, why
            )
        upstream.down_until = time.monotonic() + self.cooldown_s

    async def _scrape_forever(self) -> None:
        """Each upstream's queue and KV cache use, from its /metrics (see routing)."""
        assert self._session is not None
        while True:
            for upstream in self.upstreams:
                if not upstream.up:
                    continue
                try:
                    async with self._session.get(
                        upstream.metrics_url,
                        headers=self._headers,
                        timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                    ) as response:
                        if response.status == 200:
                            upstream.read_metrics(await response.text())
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                    logger.debug("upstream %s: no metrics (%s)", upstream.base_url, exc)
            await asyncio.sleep(self.metrics_s)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.cooldown_s / 2))
            now = time.monotonic()
            for upstream in self.upstreams:
                if not upstream.up and now >= upstream.down_until:
                    if await self._probe(upstream):
                        upstream.down_until = 0.0
                        logger.info("upstream %s is back", upstream.base_url)
                    else:
                        upstream.down_until = now + self.cooldown_s

    async def _probe(self, upstream: Upstream) -> bool:
        assert self._session is not None
        try:
            async with self._session.get(
                f"{upstream.base_url}/models",
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    # -- generation ----------------------------------------------------------------------------

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        path, body = self._body(request)
        headers = self._headers
        if request.traceparent is not None:  # the trace goes on at the upstream (W3C)
            headers = {**headers, "traceparent": request.traceparent}
            if request.tracestate:
                headers["tracestate"] = request.tracestate
        blocks = []
        if self.routing == "prefix":
            blocks = prefix_blocks(f"{m.role}\x1f{m.content}" for m in request.messages)
        tried: Upstream | None = None
        for attempt in (1, 2):
            upstream, uncached = self._pick(request.request_id, tried, request.qos_class, blocks)
            tried = upstream
            upstream.in_flight += 1
            upstream.requests += 1
            upstream.prefilling.append(uncached)
            started = False
            asked = time.monotonic()
            try:
                stream = self._stream(upstream, path, body, headers, request.params.logprobs)
                async for delta in stream:
                    if not started:
                        started = True
                        upstream.ttft.add(time.monotonic() - asked)
                        upstream.prefilling.remove(uncached)
                    yield delta
                return
            except UpstreamFailure as exc:
                self._failed(upstream, str(exc))
                if started:
                    raise EngineError(
                        f"the upstream failed during request {request.request_id}: {exc}"
                    ) from None
                if attempt == 2 or not any(u.up for u in self.upstreams if u is not upstream):
                    raise EngineError(
                        f"no upstream could serve request {request.request_id}; retry"
                    ) from None
                logger.info(
                    "request %s: retrying on another upstream (%s)", request.request_id, exc
                )
            finally:
                upstream.in_flight -= 1
                if not started:
                    upstream.prefilling.remove(uncached)

    def _body(self, request: GenerationRequest) -> tuple[str, bytes]:
        """The upstream path and request body."""
        params = request.params
        body: dict[str, Any] = {
            "model": self.upstream_model,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            # The upstream's count of tokens: a chunk may carry several (vLLM's
            # stream_interval, a Seedance that merges frames).
            "stream_options": {"include_usage": True},
        }
        if request.raw:
            path = "/completions"
            body["prompt"] = "".join(m.content for m in request.messages) + request.continuation
        elif request.continuation:
            raise EngineError(
                "the upstream's chat API cannot continue a reply begun elsewhere (a generation "
                "taken over from a node that died); send the request again"
            )
        else:
            path = "/chat/completions"
            body["messages"] = [_message(m) for m in request.messages]
            if params.tools is not None:
                if params.logprobs is not None:
                    raise InvalidRequest(
                        "logprobs: not with tools in gateway mode (a call's parts carry none)",
                        param="logprobs",
                    )
                body.update(params.tools.openai())
        if params.stop:
            body["stop"] = list(params.stop)
        if params.seed is not None:
            body["seed"] = params.seed
        if params.ignore_eos:  # vLLM's, llama-server's and Seedance's extension
            body["ignore_eos"] = True
        if params.logprobs is not None:  # Chat Completions' fields, or the legacy one
            if request.raw:
                body["logprobs"] = params.logprobs
            else:
                body.update(logprobs=True, top_logprobs=params.logprobs)
        if params.schema is not None and params.schema.kind == "json":  # the upstream binds it
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": params.schema.name or "reply",
                    "schema": msgspec.Raw(params.schema.text.encode()),
                },
            }
        return path, _encode(body)

    def check_schema(self, schema: OutputSchema, field: str) -> None:
        """Any JSON Schema, and tools: the upstream decides what it can enforce (its 400 is
        passed on)."""

    async def _stream(
        self,
        upstream: Upstream,
        path: str,
        body: bytes,
        headers: dict[str, str],
        logprobs: int | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """The upstream's reply as deltas (with log probabilities, when ``logprobs`` asked for
        them: a delta of each chunk's tokens, as many as its entries)."""
        assert self._session is not None, "start() first"
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timeout_s, sock_read=self.timeout_s
        )
        try:
            async with self._session.post(
                upstream.base_url + path,
                data=body,
                headers=headers,
                timeout=timeout,
            ) as response:
                if response.status != 200:
                    await self._refuse(response)
                finish: FinishReason | None = None
                calls = _Calls()
                counted = reported = 0  # tokens yielded, and the upstream's own count
                async for data in sse_data(response.content):
                    chunk = decode_stream_chunk(data)
                    if chunk.error is not None:
                        raise UpstreamFailure(f"error event: {chunk.error.get('message', '')}")
                    if chunk.usage is not None:
                        reported = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        text = calls.text(choice)
                        if choice.finish_reason is not None:
                            finish = _FINISH.get(choice.finish_reason, "stop")
                            text += calls.end()
                        if not text:
                            continue
                        if logprobs is None:
                            counted += 1
                            yield TokenDelta(text, 1)
                            continue
                        entries = choice.logprobs.entries() if choice.logprobs else []
                        if not entries:
                            raise EngineError("the upstream sent no log probabilities")
                        counted += len(entries)
                        yield TokenDelta(text, len(entries), logprobs=entries)
                if finish is None:
                    raise UpstreamFailure("the stream ended without a finish reason")
                # Chunks of several tokens each: the rest of the upstream's count, so that
                # the usage and the token frames' seq are the upstream's tokens.
                yield TokenDelta("", max(0, reported - counted), finish)
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
            raise UpstreamFailure(f"{type(exc).__name__}: {exc}") from None

    async def _refuse(self, response: aiohttp.ClientResponse) -> None:
        text = await response.text()
        message = text[:500]
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            message = msgspec.json.decode(text)["error"]["message"]
        if response.status == 429 or response.status >= 500:
            raise UpstreamFailure(f"HTTP {response.status}: {message}")
        if response.status == 400:
            raise InvalidRequest(f"the upstream refused the request: {message}")
        raise EngineError(f"the upstream answered HTTP {response.status}: {message}")


def _message(message: ChatMessage) -> dict[str, Any]:
    """A turn as Chat Completions takes it: an assistant's calls, a tool's result."""
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id, "content": message.content}
    wire: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        wire["content"] = message.content or None
        wire["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    return wire


class _Calls:
    """A streamed reply's text, with its calls (``delta.tool_calls``) written in the generic
    format. Whitespace before the first call is held back (some servers send it, then the
    call); text and then a call is an error: a reply is one or the other."""

    def __init__(self) -> None:
        self.writer = CallWriter()
        self.held = ""
        self.texted = False  # text has been passed on

    def text(self, choice: ChunkChoice) -> str:
        content = choice.content or ""
        parts = choice.delta.tool_calls if choice.delta is not None else None
        if not parts:
            if self.writer.index is None and not self.texted and not content.strip():
                self.held += content
                return ""
            if content and self.writer.index is not None:
                raise EngineError("the upstream wrote text inside its tool calls")
            text, self.held = self.held + content, ""
            self.texted = self.texted or bool(text)
            return text
        if self.texted:
            raise EngineError(
                "the upstream replied with text and then a tool call; a reply is one or the other"
            )
        self.held = ""
        text = ""
        for part in parts:
            function = part.function or {}
            text += self.writer.part(part.index, function.get("name"), function.get("arguments"))
        return text

    def end(self) -> str:
        return self.writer.end()


@dataclass(frozen=True)
class UpstreamOptions:
    upstream: tuple[str, ...] = ()
    api_key: str | None = None
    model: str | None = None
    timeout_s: float = 30.0
    cooldown_s: float = 10.0
    metrics_s: float = 5.0
    routing: str = "load"


OPTIONS = (
    Option(
        "upstream",
        "--upstream",
        urls,
        "base URL(s) of OpenAI-compatible servers, comma-separated (http://host:port/v1); "
        "#critical+high after one: the service classes it serves (none: every class)",
    ),
    Option("api_key", "--upstream-api-key", str, "bearer key sent to the upstreams"),
    Option(
        "model",
        "--upstream-model",
        str,
        "model name asked of the upstreams (default: the first they list)",
    ),
    Option(
        "timeout_s",
        "--upstream-timeout",
        float,
        "seconds an upstream may send nothing (connect, first byte, between chunks) before it "
        "counts as failed",
        positive,
        "positive",
    ),
    Option(
        "cooldown_s",
        "--upstream-cooldown",
        float,
        "seconds a failed upstream is left out before it is probed again",
        positive,
        "positive",
    ),
    Option(
        "metrics_s",
        "--upstream-metrics-s",
        float,
        "how often each upstream's /metrics is read for its queue and KV cache use, seconds "
        "(0: never)",
        non_negative,
        "0 or more",
    ),
    Option(
        "routing",
        "--upstream-routing",
        str,
        "how a request's upstream is chosen among those that serve its class: load (the "
        "lowest expected wait), prefix (where the longest run of its prompt's beginning went "
        "before, within a bound on its load; else by load), round-robin",
        one_of(ROUTINGS),
        ", ".join(ROUTINGS),
    ),
)


def create_engine(config: ServerConfig, options: UpstreamOptions) -> OpenAIUpstreamEngine:
    return OpenAIUpstreamEngine(
        options.upstream,
        name=config.model,
        upstream_model=options.model,
        api_key=options.api_key,
        timeout_s=options.timeout_s,
        cooldown_s=options.cooldown_s,
        metrics_s=options.metrics_s,
        routing=options.routing,
    )


ENGINE = EngineSpec(
    create_engine,
    UpstreamOptions,
    OPTIONS,
    "A gateway: replies from OpenAI-compatible servers (vLLM, llama-server, a Seedance), "
    "with failover.",
)
