"""A server's drain: new work refused, running generations given time to finish, then every
stream ended with its final frame and every peer closed."""

from __future__ import annotations

import asyncio
import logging
from typing import Final

from seedance.protocol.errors import Overloaded
from seedance.server.lifecycle.generations import Generations
from seedance.server.lifecycle.models import ModelTable
from seedance.server.lifecycle.peers import DRAIN_STAGGER_S, Peers

logger = logging.getLogger(__name__)

SHUTTING_DOWN: Final = "the server is shutting down; retry on another server"
#: How long the last peers have to leave after their final frames.
PEERS_GONE_S: Final = 5.0


class Shutdown:
    """Whether the server is draining, and the drain itself."""

    def __init__(
        self, models: ModelTable, generations: Generations, peers: Peers, *, clustered: bool
    ) -> None:
        self.models = models
        self.generations = generations
        self.peers = peers
        self.clustered = clustered
        self.draining = False
        self.hurry = False  # shutting down without waiting for running generations

    def check(self) -> None:
        """Refuse new work while draining (``overloaded``: another server takes it)."""
        if self.draining:
            raise Overloaded(SHUTTING_DOWN)

    async def drain(self, timeout_s: float) -> None:
        """Refuse new generations; close the peers that read no stream (1001), spread over a
        few seconds; let running generations (resumable ones without a reader too) finish
        for ``timeout_s`` (or until :attr:`hurry` is set), then end every stream with its
        final frame (in a cluster, a resumable one is handed over instead: its lock is
        released unfinished, and another node takes it over) and close every peer: a
        WebSocket's generation ends with ``done`` (``cancelled``) and the close 1001; an
        OpenAI API request with an ``overloaded`` error (an error event and ``[DONE]`` when
        its stream had begun)."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        models = self.models
        if models.running and not self.hurry:
            logger.info(
                "draining: waiting up to %.0f s for %d generation(s)", timeout_s, models.running
            )
        # Peers with nothing running go first, spread out, so that their clients do not all
        # come back at once to the servers that remain.
        spread = min(DRAIN_STAGGER_S, timeout_s)
        idle = asyncio.create_task(self.peers.close_idle(spread, movable=self.clustered))
        while models.running and loop.time() < deadline and not self.hurry:  # noqa: ASYNC110 - polls
            await asyncio.sleep(0.05)
        idle.cancel()
        await asyncio.gather(idle, return_exceptions=True)
        if models.running:
            why = "a second signal" if self.hurry else "drain timeout"
            logger.warning("%s: cancelling %d generation(s)", why, models.running)
        for generation in self.generations:
            if self.clustered and generation.log.resumable:
                generation.hand_off()  # another node takes it over where it stopped
            else:
                generation.cancel(silent=False)  # its readers get its done (HTTP: overloaded)
        await self.peers.shutdown()
        await self.peers.gone(PEERS_GONE_S)
