"""What the APIs and the request lifecycle are handed: the server's parts, each doing its own
work. :class:`~seedance.server.state.ServerState` builds and wires them; nothing else does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seedance.cluster.node import ClusterNode
    from seedance.config import ServerConfig
    from seedance.observability.metrics import Metrics
    from seedance.observability.tracing import Tracing
    from seedance.server.confidential import Confidential
    from seedance.server.lifecycle.audit import AuditGate
    from seedance.server.lifecycle.drain import Shutdown
    from seedance.server.lifecycle.generations import Generations
    from seedance.server.lifecycle.models import ModelTable
    from seedance.server.lifecycle.peers import Peers
    from seedance.server.lifecycle.refusals import Refusals
    from seedance.server.modules import ModuleTable
    from seedance.server.outbound import FrameMerger
    from seedance.sessions.store import SessionStore
    from seedance.streams.store import StreamStore
    from seedance.tenants.access import Access
    from seedance.tenants.usage import Usage


@dataclass(frozen=True, eq=False)
class Services:
    """The server's parts (see each one's module)."""

    config: ServerConfig
    #: The served models: the one place a model is resolved and its limits applied.
    models: ModelTable
    sessions: SessionStore
    streams: StreamStore
    #: The running generations, and where their stream logs open and close.
    generations: Generations
    #: Every open connection, socket and HTTP call, behind one protocol.
    peers: Peers
    access: Access
    usage: Usage
    audit: AuditGate
    #: The one reporter of calls that were not admitted.
    refusals: Refusals
    tracing: Tracing
    metrics: Metrics
    shutdown: Shutdown
    #: Merges the token frames of fast streams (None: one frame per token).
    merger: FrameMerger | None
    #: The cluster mode (``--redis``); None keeps everything in this process.
    cluster: ClusterNode | None
    #: End-to-end encryption of streams (``--e2e-key``; None: not offered).
    confidential: Confidential | None
    #: Tenants' WebAssembly modules (``--module-registry``; None: none served).
    modules: ModuleTable | None = None
