"""The messages between the server and its engine process (msgpack through msgspec).

The server sends :class:`Hello` until a :class:`Ready` answers (the engine process's ``epoch``
is its pid, so a message meant for a process that died never reaches the one that replaced
it), then :class:`Submit` and :class:`Cancel`. The engine process answers with
:class:`Deltas`: every delta its requests produced in one round of its event loop, in one
message, and now and then (:data:`STATS_INTERVAL_S`) with :class:`Stats`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

import msgspec
import zmq
import zmq.asyncio

from seedance.engines.base import GenerationRequest, ModelInfo
from seedance.protocol.messages import FinishReason, TokenLogprob

#: How often the engine process says how it is (health, requests inside it, KV cache use).
STATS_INTERVAL_S: Final = 0.5


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """The server asks the engine process who it is (again, after each restart)."""


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The engine process is serving: its pid (``epoch``) and the model it serves."""

    epoch: int
    info: ModelInfo
    max_concurrency: int


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not be built (a configuration error): why, in one line."""

    message: str


class Submit(msgspec.Struct, tag="submit", array_like=True):
    """Generate ``request``; its deltas come back under ``no`` (the server's number for it)."""

    epoch: int
    no: int
    request: GenerationRequest


class Cancel(msgspec.Struct, tag="cancel", array_like=True):
    """Stop request ``no`` and free what it holds (its deltas stop coming)."""

    epoch: int
    no: int


class Forget(msgspec.Struct, tag="forget", array_like=True):
    """The server named ``peer`` is gone (a worker that died): stop its requests."""

    peer: bytes


class Delta(msgspec.Struct, array_like=True, omit_defaults=True):
    """One :class:`~seedance.engines.base.TokenDelta` of request ``no``, or its failure
    (``error``: the error's code, then ``text`` is its message)."""

    no: int
    text: str
    tokens: int = 1
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    ids: list[int] | None = None
    error: str | None = None


class Deltas(msgspec.Struct, tag="deltas", array_like=True):
    items: list[Delta]


class Stats(msgspec.Struct, tag="stats", array_like=True):
    """How the engine is: its health, and what :class:`~seedance.engines.base.Engine` says
    about its requests and KV cache (None: it cannot tell)."""

    ok: bool
    detail: str
    unfinished: int | None
    kv_cache_usage: float | None
    prompt_cache: tuple[int, int] | None = None


ToEngine = Hello | Submit | Cancel | Forget
FromEngine = Ready | Failed | Deltas | Stats

encode = msgspec.msgpack.Encoder().encode
decode_to_engine = msgspec.msgpack.Decoder(ToEngine).decode
decode_from_engine = msgspec.msgpack.Decoder(FromEngine).decode


def send_now(socket: zmq.asyncio.Socket, frames: Sequence[bytes]) -> bool:
    """Send ``frames`` without waiting (false: the peer is not there and they were not
    sent). The sockets have no high-water mark, so a connected peer always takes them."""
    sent: asyncio.Future[None] = socket.send_multipart(frames, flags=zmq.NOBLOCK)  # type: ignore[assignment]
    return not (sent.done() and sent.exception() is not None)  # read: the error is handled
