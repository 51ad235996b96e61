"""Every open peer of the server, whatever its API: the ``/v2/infer`` connections, the Realtime
and Responses API WebSockets, and the HTTP calls being answered, behind one protocol.

Three things need them all: a credential that stops passing shuts out what it opened
(``unauthorized``; WebSockets close 4401), a shutdown closes the idle ones first, spread out,
and ends the rest with their final frames, and ``/metrics`` counts them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Protocol

from seedance.protocol.errors import Unauthorized
from seedance.tenants.auth import Principal

logger = logging.getLogger(__name__)

#: On shutdown, idle connections are closed over this long (at most the drain timeout).
DRAIN_STAGGER_S = 2.0
DRAIN_TICK_S = 0.02

Kind = Literal["infer", "realtime", "responses", "http"]
#: Why a peer's caller no longer passes (None: it still does).
Reason = Callable[[Principal, Mapping[str, Any]], "str | None"]


class Peer(Protocol):
    """What the server asks of an open peer."""

    kind: Kind
    #: For the log: ``conn c-1a2b3c4d``, ``realtime rt-...``.
    name: str
    principal: Principal

    @property
    def scope(self) -> Mapping[str, Any]:
        """The ASGI scope it came with (its client certificate, for one)."""

    @property
    def idle(self) -> bool:
        """Reads no stream and is not closing: a shutdown may close it at once."""

    @property
    def movable(self) -> bool:
        """Reads a resumable stream: in a cluster, its client can resume it on another node."""

    def shut_out(self, error: Unauthorized) -> None:
        """Its credential stopped passing: what it runs stops, ``error`` goes out, it closes."""

    def going_away(self) -> None:
        """Close now, ``1001``: the server is shutting down."""

    async def shutdown(self) -> None:
        """Server shutdown: end what runs with its final frame, then close."""


class Peers:
    """The registry of open peers."""

    def __init__(self) -> None:
        self._peers: dict[Peer, None] = {}  # in the order they came
        self._counts: dict[str, int] = {}

    def add(self, peer: Peer) -> None:
        self._peers[peer] = None
        self._counts[peer.kind] = self._counts.get(peer.kind, 0) + 1

    def discard(self, peer: Peer) -> None:
        if self._peers.pop(peer, 0) is None:
            self._counts[peer.kind] -= 1

    def count(self, kind: Kind) -> int:
        return self._counts.get(kind, 0)

    def of_kind(self, kind: Kind) -> list[Peer]:
        return [p for p in self._peers if p.kind == kind]

    def __iter__(self) -> Iterator[Peer]:
        return iter(list(self._peers))

    def __len__(self) -> int:
        return len(self._peers)

    def shut_out(self, reason: Reason) -> None:
        """Shut out every peer whose caller stopped passing: ``reason`` says why, None for one
        that still passes."""
        for peer in list(self._peers):
            why = reason(peer.principal, peer.scope)
            if why is not None:
                logger.info("%s closed: %s", peer.name, why)
                peer.shut_out(Unauthorized(why))

    async def close_idle(self, spread_s: float, *, movable: bool) -> None:
        """Close (1001) the peers that read no stream, spread over ``spread_s`` so that their
        clients do not all come back at once; with ``movable`` (a cluster) also those that
        read a resumable one: their clients resume it on another node."""

        def closable(peer: Peer) -> bool:
            return peer.idle or (movable and peer.movable)

        idle = [p for p in self._peers if closable(p)]
        if not idle:
            return
        batches = min(len(idle), max(1, int(spread_s / DRAIN_TICK_S)))
        per_batch = -(-len(idle) // batches)  # ceil
        for start in range(0, len(idle), per_batch):
            for peer in idle[start : start + per_batch]:
                if closable(peer):
                    peer.going_away()
            await asyncio.sleep(spread_s / batches)

    async def shutdown(self) -> None:
        """Every peer ends what it runs and closes."""
        await asyncio.gather(*(p.shutdown() for p in list(self._peers)), return_exceptions=True)

    async def gone(self, timeout_s: float) -> None:
        """Wait until every peer has left (at most ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout_s
        while self._peers and loop.time() < give_up:  # noqa: ASYNC110 - peers leave from many places
            await asyncio.sleep(0.02)
