"""Typed messages of wire protocol v2 (``docs/protocol.md``).

Client messages are decoded and validated by :mod:`seedance.protocol.codec`; server messages
are ``msgspec`` structs whose JSON form carries ``"type"`` first. Nothing here does I/O.
"""

from __future__ import annotations

from typing import Any, Literal, NewType

import msgspec

from seedance.protocol.e2e import Offer

SessionId = NewType("SessionId", str)
RequestId = NewType("RequestId", str)
TenantId = NewType("TenantId", str)

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "cancelled"]

PROTOCOL_VERSION = "2.1"
SUBPROTOCOL = "seedance.v2"

# Compact binary heartbeat frames (PROTOCOL.md section 4).
HEARTBEAT_PING = b"\x01\x00"
HEARTBEAT_PONG = b"\x02\x00"


class ToolCallTurn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A call of a tool a reply made: ``arguments`` is its JSON text."""

    id: str
    name: str
    arguments: str


class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """One turn of a conversation: an assistant's may hold the tools it called
    (``tool_calls``), and a ``tool`` turn is a call's result (``tool_call_id``: which call)."""

    role: Role
    content: str
    tool_calls: tuple[ToolCallTurn, ...] | None = None
    tool_call_id: str | None = None


# --------------------------------------------------------------------------- client -> server


class Generate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``generate``: a request for a reply. Field rules are in the codec."""

    type: Literal["generate"] = "generate"
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: The prompt as the model's token ids, continued as they are (no chat template, no
    #: session history); ``prompt_tensor``: the same from a tensor frame of this request.
    prompt_ids: list[int] | None = None
    prompt_tensor: str | None = None
    stream: bool = True
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    request_id: str | None = None
    reset: bool = False
    #: W3C trace context for browsers, which cannot set handshake headers.
    traceparent: str | None = None
    #: -10 .. 10, higher first in the admission queue (a tenant may ask up to its maximum).
    priority: int = 0
    #: Quality of service, as the ``X-QoS-Priority`` header (for browsers, which cannot set
    #: it): ``CLASS; slatag=TAG; health_score=0.92`` (:mod:`seedance.protocol.qos`).
    qos: str | None = None
    #: Survive disconnects: the generation runs on for ``--resume-grace`` without a reader,
    #: and its frames can be read again (``resume``) for ``--resume-window`` after it ends.
    resumable: bool = False
    #: A JSON Schema the reply must be valid for (the engine constrains its tokens to it).
    schema: dict[str, Any] | None = None
    #: Log probabilities of the reply's tokens, each with this many likeliest alternatives
    #: (0 to 20; None: none).
    logprobs: int | None = None
    #: Go on past the model's end-of-text token, to ``max_tokens`` (vLLM's and llama-server's
    #: field, which benchmark tools send so that every reply has the same length).
    ignore_eos: bool = False
    #: Tenant WebAssembly modules the request runs through, by name (docs/modules.md).
    modules: list[str] | None = None
    #: Outputs sent as tensor frames beside the token frames (docs/protocol.md, section 10).
    tensors: list[Literal["token_ids", "logprobs", "top_logprobs"]] | None = None
    #: Functions the reply may call, OpenAI's way (:mod:`seedance.protocol.tools`).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def turns(self) -> list[ChatMessage]:
        """The turns this request appends to the session context."""
        if self.messages is not None:
            return list(self.messages)
        return [ChatMessage("user", self.prompt or "")]

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        if isinstance(self.stop, str):
            return (self.stop,)
        return tuple(self.stop)


class Cancel(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``cancel``: stop the running generation (``request_id`` optional)."""

    type: Literal["cancel"] = "cancel"
    request_id: str | None = None


class Resume(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``resume``: read a generation of this session from the token after ``after_seq``
    (-1: from the start), live to its ``done``."""

    type: Literal["resume"] = "resume"
    request_id: str
    after_seq: int = -1
    #: The ``epoch`` of the ``session`` frame the client's tokens came with.
    epoch: str | None = None


class Ping(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``ping``: answered by a ``pong`` carrying the same ``id``."""

    type: Literal["ping"] = "ping"
    id: Any = None


class EndSession(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``end_session``: delete the session now and close with 1000."""

    type: Literal["end_session"] = "end_session"


class EmbedFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """What an embedding request asks, in the ``embed`` frame and the body of
    ``POST /v1/embeddings`` alike (rules in :mod:`seedance.protocol.embeddings`)."""

    #: None is refused (the ``embed`` frame may give ``input_tensor`` instead).
    input: str | list[str | int | list[int]] | None
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


class Embed(EmbedFields, kw_only=True):
    """``embed``: vectors for ``input`` from an embedding model, answered by an
    ``embeddings`` frame (``encoding_format: tensor``: by a tensor frame before it)."""

    type: Literal["embed"] = "embed"
    request_id: str | None = None
    input: str | list[str | int | list[int]] | None = None
    encoding_format: Literal["float", "base64", "tensor"] = "float"  # type: ignore[assignment]
    #: The name of a tensor frame of this request sent before it, whose rows are the inputs'
    #: token ids (instead of ``input``).
    input_tensor: str | None = None


ClientMessage = Generate | Cancel | Resume | Ping | EndSession | Embed


# --------------------------------------------------------------------------- server -> client


class _ServerFrame(msgspec.Struct, tag_field="type", omit_defaults=True):
    pass


class ActiveStream(msgspec.Struct):
    """The session's generation that can be resumed: running, or done within the window."""

    request_id: str
    #: The index of the next token the server will log (the count logged so far).
    next_seq: int
    state: Literal["running", "done"]


class SessionFrame(_ServerFrame, tag="session"):
    session_id: str
    model: str
    created: bool
    context_turns: int
    expires_in: float
    heartbeat_interval: float
    idle_timeout: float
    server: str
    #: Changes whenever the server lost the session's stream log (a restart, in memory).
    epoch: str = ""
    active: ActiveStream | None = None
    #: The server's half of end-to-end encryption, when the client asked for it.
    e2e: Offer | None = None


class StartFrame(_ServerFrame, tag="start"):
    request_id: str
    trace_id: str
    model: str
    prompt_tokens: int


class TopLogprob(msgspec.Struct):
    """One of the likeliest tokens at a position: its text, log probability and UTF-8 bytes
    (a token may hold part of a character), as OpenAI gives them."""

    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct):
    """A reply token's log probability under the model (from its logits as computed, before
    temperature, top-p or a schema's mask), and the ``top_logprobs`` likeliest tokens there."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class TokenFrame(_ServerFrame, tag="token"):
    token: str
    seq: int
    request_id: str | None = None
    n: int = 1
    #: One per token of the frame, when the request asked for ``logprobs``.
    logprobs: list[TokenLogprob] | None = None


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timing(msgspec.Struct):
    queue_ms: float
    ttft_ms: float | None
    total_ms: float


def ms(seconds: float) -> float:
    """Seconds as the milliseconds frames, spans and records carry (to the microsecond)."""
    return round(seconds * 1000.0, 3)


class DoneFrame(_ServerFrame, tag="done"):
    done: bool
    request_id: str
    trace_id: str
    finish_reason: FinishReason
    usage: Usage
    timing: Timing
    text: str | None = None
    #: The version of the model that wrote the reply (a registry's models; else absent).
    model_version: str | None = None
    #: ``stream: false`` with ``logprobs``: one per token of ``text``.
    logprobs: list[TokenLogprob] | None = None
    #: The calls the reply made, when the request offered ``tools`` (checked against them).
    tool_calls: list[ToolCallTurn] | None = None
    #: The request's audit record's seq: its index in the audit log's Merkle tree, whose
    #: inclusion proof ``GET /v1/lineage/{request_id}`` gives (with ``--audit-file`` and
    #: ``--audit-fsync record``; else absent).
    audit_seq: int | None = None


class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    retryable: bool
    retry_after: float | None = None
    reason: str | None = None


class ErrorFrame(_ServerFrame, tag="error"):
    error: ErrorBody
    request_id: str | None = None


class PongFrame(_ServerFrame, tag="pong"):
    id: Any = None


class EmbeddingsUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsFrame(_ServerFrame, tag="embeddings"):
    """The answer to ``embed``: a vector per input, in order (``base64``: each one's
    little-endian float32 bytes); with ``encoding_format: tensor`` no ``data`` but the names
    of the tensor frames sent before it (``["embedding"]``)."""

    request_id: str
    model: str
    usage: EmbeddingsUsage
    data: list[list[float] | str] | None = None
    tensors: list[str] | None = None


ServerFrame = (
    SessionFrame | StartFrame | TokenFrame | DoneFrame | ErrorFrame | PongFrame | EmbeddingsFrame
)
