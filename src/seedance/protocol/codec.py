"""Sans-I/O codec: bytes or text in, typed messages out, and back.

No asyncio and no sockets here: the server and the client both move frames through these
functions. Every rule of PROTOCOL.md sections 2-5 that concerns one frame lives here; an invalid
frame becomes a :class:`~seedance.protocol.errors.SeedanceError`, never another exception.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final, Literal

import msgspec

from seedance.protocol.errors import (
    InvalidJSON,
    InvalidRequest,
    PayloadTooLarge,
    SeedanceError,
    UnsupportedFrame,
)
from seedance.protocol.messages import (
    HEARTBEAT_PING,
    HEARTBEAT_PONG,
    Cancel,
    ClientMessage,
    Embed,
    EndSession,
    ErrorBody,
    ErrorFrame,
    Generate,
    Ping,
    Resume,
    ServerFrame,
    TokenLogprob,
)
from seedance.protocol.qos import parse_qos
from seedance.protocol.schemas import output_schema
from seedance.protocol.tensors import TENSOR
from seedance.protocol.tools import parse_tools

MAX_SEED: Final = 2**64 - 1
#: Most alternatives a token's log probability comes with (OpenAI's ``top_logprobs`` limit).
MAX_TOP_LOGPROBS: Final = 20
DEFAULT_MAX_TOKENS: Final = 256
MAX_PRIORITY: Final = 10
MAX_STOP_STRINGS: Final = 4
MAX_ID_CHARS: Final = 128

_SESSION_ID_RE: Final = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")
_PATH_RE: Final = re.compile(r" - at `\$\.?(.*)`$")

_MESSAGE_TYPES: Final[dict[str, type[ClientMessage]]] = {
    "generate": Generate,
    "cancel": Cancel,
    "resume": Resume,
    "ping": Ping,
    "end_session": EndSession,
    "embed": Embed,
}

_encoder: Final = msgspec.json.Encoder()
_server_decoder: Final = msgspec.json.Decoder(ServerFrame)


@dataclass(frozen=True, slots=True)
class FrameLimits:
    """The limits that one frame is checked against."""

    max_frame_bytes: int = 1024 * 1024
    max_tokens: int = 4096
    #: A lower cap for requests that do not set ``max_tokens`` (a tenant's quota, a model's
    #: signed limit).
    default_cap: int | None = None
    #: Ranges a model's signed manifest holds these to: a request that leaves one out gets
    #: the default moved inside it (one that sets it outside is refused with the model).
    temperature: tuple[float, float] | None = None
    top_p: tuple[float, float] | None = None

    def capped(self, cap: int | None) -> FrameLimits:
        """These limits, with requests that do not set ``max_tokens`` held to ``cap`` too."""
        if cap is None:
            return self
        return replace(self, default_cap=min(cap, self.default_cap or cap))

    def default_max_tokens(self, default: int = DEFAULT_MAX_TOKENS) -> int:
        """``max_tokens`` for a request that does not say: never over a limit."""
        return min(default, self.max_tokens, self.default_cap or default)

    def default_temperature(self, default: float) -> float:
        return _clamp(default, self.temperature)

    def default_top_p(self, default: float) -> float:
        return _clamp(default, self.top_p)


def _clamp(value: float, bounds: tuple[float, float] | None) -> float:
    return value if bounds is None else min(max(value, bounds[0]), bounds[1])


# --------------------------------------------------------------------------- client frames


def decode_client_text(data: str | bytes, limits: FrameLimits) -> ClientMessage:
    """Decode and validate one text frame from a client.

    Raises :class:`PayloadTooLarge`, :class:`InvalidJSON` or :class:`InvalidRequest`; the
    error carries the frame's ``request_id`` when one could be read.
    """
    check_frame_size(data, limits.max_frame_bytes)
    try:
        obj = msgspec.json.decode(data)
    except msgspec.ValidationError as exc:  # e.g. a number out of range
        raise InvalidJSON(f"frame is not valid JSON: {_describe(exc)}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSON(f"frame is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidJSON("frame is not valid JSON: nested too deeply") from None
    except UnicodeError:
        raise InvalidJSON("frame is not valid JSON: not valid UTF-8") from None
    if not isinstance(obj, dict):
        raise InvalidJSON(f"frame must be a JSON object, got {_json_type(obj)}")
    request_id = _peek_request_id(obj)
    kind = obj.get("type", "generate")
    cls = _MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        expected = ", ".join(_MESSAGE_TYPES)
        raise InvalidRequest(
            f"type: unknown message type {kind!r}; expected one of {expected}",
            request_id=request_id,
        )
    try:
        message = msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(_describe(exc), request_id=request_id) from None
    if isinstance(message, Generate):
        if "max_tokens" not in obj:  # the defaults never exceed the model's limits
            message.max_tokens = limits.default_max_tokens()
        if "temperature" not in obj and limits.temperature is not None:
            message.temperature = limits.default_temperature(message.temperature)
        if "top_p" not in obj and limits.top_p is not None:
            message.top_p = limits.default_top_p(message.top_p)
        validate_generate(message, limits, request_id)
    elif isinstance(message, (Cancel, Embed)) and message.request_id is not None:
        _check_id("request_id", message.request_id)
    elif isinstance(message, Resume):
        _check_id("request_id", message.request_id)
        if message.after_seq < -1:
            raise InvalidRequest(
                f"after_seq: must be -1 or more, got {message.after_seq}",
                request_id=message.request_id,
            )
    return message


def _check_tensors(msg: Generate, bad: Callable[[str], InvalidRequest]) -> None:
    """A ``generate`` frame's ``tensors``: each once, beside token frames, and the log
    probabilities only where the request asks for them."""
    tensors = msg.tensors or []
    if len(set(tensors)) != len(tensors):
        raise bad("tensors: each at most once")
    if not msg.stream:
        raise bad("tensors: they come beside token frames: not with stream false")
    if "logprobs" in tensors and msg.logprobs is None:
        raise bad("tensors: logprobs needs the logprobs field (0 or more alternatives)")
    if "top_logprobs" in tensors and not msg.logprobs:
        raise bad("tensors: top_logprobs needs logprobs of 1 or more")


def check_frame_size(data: str | bytes, max_bytes: int) -> None:
    """Raise :class:`PayloadTooLarge` when ``data`` is over ``max_bytes`` bytes (UTF-8)."""
    size = len(data)
    if isinstance(data, str) and size <= max_bytes < size * 4:
        size = len(data.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise PayloadTooLarge(f"frame of {size} bytes exceeds the limit of {max_bytes} bytes")


def classify_binary(data: bytes) -> Literal["ping", "pong", "tensor"]:
    """Classify a binary frame: the compact heartbeat ping or pong, or a tensor frame
    (:mod:`seedance.protocol.tensors`); anything else is an error."""
    if data == HEARTBEAT_PING:
        return "ping"
    if data == HEARTBEAT_PONG:
        return "pong"
    if data[:1] == bytes((TENSOR,)):
        return "tensor"
    raise UnsupportedFrame(
        "binary frames must be a heartbeat (01 00 ping, 02 00 pong) or a tensor frame (10 ...); "
        f"got {len(data)} byte(s) starting {data[:4].hex(' ') or '(empty)'}"
    )


def validate_session_id(session_id: str) -> str:
    if not _SESSION_ID_RE.fullmatch(session_id):
        raise InvalidRequest("session_id must be 1-128 characters of A-Z a-z 0-9 _ . : -")
    return session_id


def validate_generate(msg: Generate, limits: FrameLimits, request_id: str | None = None) -> None:
    """Check a request's fields against the rules of `generate` (also used by the HTTP API)."""

    def bad(text: str) -> InvalidRequest:
        return InvalidRequest(text, request_id=request_id)

    tokens = msg.prompt_ids is not None or msg.prompt_tensor is not None
    if msg.prompt_ids is not None and msg.prompt_tensor is not None:
        raise bad("give prompt_ids or prompt_tensor, not both")
    if sum([msg.prompt is not None, msg.messages is not None, tokens]) != 1:
        raise bad("exactly one of prompt, messages and prompt_ids (or prompt_tensor) is required")
    if msg.prompt_ids is not None and (not msg.prompt_ids or min(msg.prompt_ids) < 0):
        raise bad("prompt_ids: one token id or more, each 0 or more")
    if tokens and msg.tools:
        raise bad("prompt_ids: a prompt of token ids cannot offer tools (they need a template)")
    if msg.messages is not None and not msg.messages:
        raise bad("messages must hold at least one message")
    if not 1 <= msg.max_tokens <= limits.max_tokens:
        raise bad(f"max_tokens must be between 1 and {limits.max_tokens}")
    if not 0.0 <= msg.temperature <= 2.0:
        raise bad("temperature must be between 0 and 2")
    if not 0.0 < msg.top_p <= 1.0:
        raise bad("top_p must be greater than 0 and at most 1")
    if isinstance(msg.stop, list) and len(msg.stop) > MAX_STOP_STRINGS:
        raise bad(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    if any(not s for s in msg.stop_strings()):
        raise bad("stop strings must not be empty")
    if msg.seed is not None and not 0 <= msg.seed <= MAX_SEED:
        raise bad(f"seed must be an integer between 0 and {MAX_SEED}")
    if not -MAX_PRIORITY <= msg.priority <= MAX_PRIORITY:
        raise bad(f"priority must be between -{MAX_PRIORITY} and {MAX_PRIORITY}")
    if msg.request_id is not None:
        _check_id("request_id", msg.request_id)
    if msg.qos is not None:
        try:
            parse_qos(msg.qos)
        except InvalidRequest as exc:
            raise bad(exc.message) from None
    if msg.logprobs is not None and not 0 <= msg.logprobs <= MAX_TOP_LOGPROBS:
        raise bad(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
    if msg.tensors:
        _check_tensors(msg, bad)
    try:
        if msg.schema is not None:
            output_schema(msg.schema, "schema")
        if msg.tools or msg.tool_choice is not None:
            tools = parse_tools(msg.tools, msg.tool_choice, msg.parallel_tool_calls)
            if tools is not None and msg.schema is not None:
                raise InvalidRequest("schema: a reply to tools cannot be bound to a schema too")
            if tools is not None and msg.ignore_eos:
                raise InvalidRequest("ignore_eos: not with tools (a call ends when it is whole)")
        if msg.schema is not None and msg.ignore_eos:
            raise InvalidRequest("ignore_eos: not with a schema (a bound reply ends when whole)")
    except InvalidRequest as exc:
        exc.request_id = request_id
        raise


def _id_rule_broken(value: str) -> str | None:
    """The rule an id breaks (``None``: a valid id)."""
    if not 1 <= len(value) <= MAX_ID_CHARS:
        return f"must be 1-{MAX_ID_CHARS} characters"
    if _CONTROL_RE.search(value):
        return "must not contain control characters"
    return None


def _check_id(field: str, value: str) -> None:
    rule = _id_rule_broken(value)
    if rule is not None:
        raise InvalidRequest(f"{field} {rule}")


def _peek_request_id(obj: dict[str, Any]) -> str | None:
    """The frame's ``request_id`` when it is a valid one, for echoing in an error."""
    value = obj.get("request_id")
    if isinstance(value, str) and _id_rule_broken(value) is None:
        return value
    return None


def _describe(exc: msgspec.ValidationError) -> str:
    """Turn msgspec's message into one that names the field first: ``max_tokens: expected int``."""
    text = str(exc)
    match = _PATH_RE.search(text)
    rule = text[: match.start()] if match else text
    rule = rule.replace("`", "")
    if rule.startswith("Object contains unknown field "):
        return f"unknown field {rule.removeprefix('Object contains unknown field ')!r}"
    if rule.startswith("Object missing required field "):
        return f"missing field {rule.removeprefix('Object missing required field ')!r}"
    path = match.group(1) if match else ""
    if rule.startswith("Invalid enum value "):
        rule = f"invalid value {rule.removeprefix('Invalid enum value ')}"
        if path.endswith("role"):
            rule += "; expected system, user or assistant"
    rule = rule[:1].lower() + rule[1:]
    if path and "[...]" not in path:
        return f"{path}: {rule}"
    return rule


def _json_type(obj: object) -> str:
    if isinstance(obj, list):
        return "an array"
    if isinstance(obj, str):
        return "a string"
    if isinstance(obj, bool):
        return "a boolean"
    if isinstance(obj, int | float):
        return "a number"
    return "null"


# --------------------------------------------------------------------------- server frames


def encode_frame(frame: ServerFrame) -> str:
    """Encode a server frame as the text of a WebSocket text frame."""
    return _encoder.encode(frame).decode("utf-8")


def error_frame(error: SeedanceError, request_id: str | None = None) -> ErrorFrame:
    """The ``error`` frame that tells a client of ``error`` (for ``request_id``, else the
    error's own)."""
    body = ErrorBody(
        code=error.code,
        message=error.message,
        retryable=error.retryable,
        retry_after=error.retry_after_s,
        reason=error.reason,
    )
    return ErrorFrame(error=body, request_id=request_id or error.request_id)


def encode_error(error: SeedanceError, request_id: str | None = None) -> str:
    return encode_frame(error_frame(error, request_id))


class TokenFrameEncoder:
    """Builds the ``token`` frames of one request with no per-token dict or struct.

    The request's constant suffix is encoded once; each frame costs one JSON string escape
    and one string join.
    """

    __slots__ = ("_suffix",)

    _PREFIX: Final = '{"type":"token","token":'

    def __init__(self, request_id: str) -> None:
        self._suffix = ',"request_id":' + _encoder.encode(request_id).decode("utf-8") + "}"

    def encode(
        self, text: str, seq: int, n: int = 1, logprobs: list[TokenLogprob] | None = None
    ) -> str:
        token = _encoder.encode(text).decode("utf-8")
        if logprobs is not None:
            entries = _encoder.encode(logprobs).decode("utf-8")
            return f'{self._PREFIX}{token},"seq":{seq},"n":{n},"logprobs":{entries}{self._suffix}'
        if n == 1:
            return f'{self._PREFIX}{token},"seq":{seq}{self._suffix}'
        return f'{self._PREFIX}{token},"seq":{seq},"n":{n}{self._suffix}'


def decode_server_text(data: str | bytes) -> ServerFrame | None:
    """Decode a frame from the server; ``None`` for a frame type this client does not know."""
    try:
        return _server_decoder.decode(data)
    except msgspec.ValidationError as exc:
        if "Invalid value" in str(exc) and "$.type" in str(exc):
            return None
        raise InvalidJSON(f"server frame does not match the protocol: {_describe(exc)}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJSON(f"server frame is not valid JSON: {exc}") from None


def encode_client_message(message: ClientMessage) -> str:
    """Encode a client message with its ``type`` and the fields that differ from the defaults."""
    fields: dict[str, Any] = {"type": message.type}
    for info in msgspec.structs.fields(message):
        value = getattr(message, info.name)
        if info.name != "type" and value != info.default:
            fields[info.name] = value
    return _encoder.encode(fields).decode("utf-8")
