"""Python client for Seedance's ``/v2/infer`` WebSocket protocol."""

from seedance.client.session import (
    ClientSession,
    Reconnect,
    Stream,
    TokenChunk,
    connect,
    infer_url,
)
from seedance.client.sync import SyncSession, SyncStream, connect_sync
from seedance.protocol.errors import (
    ConnectionClosed,
    ContextOverflow,
    EngineError,
    Forbidden,
    HistoryLost,
    InternalError,
    InvalidJSON,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    QuotaExceeded,
    SeedanceError,
    SessionBusy,
    Unauthorized,
    UnsupportedFrame,
)
from seedance.protocol.qos import QoS

__all__ = [
    "ClientSession",
    "ConnectionClosed",
    "ContextOverflow",
    "EngineError",
    "Forbidden",
    "HistoryLost",
    "InternalError",
    "InvalidJSON",
    "InvalidRequest",
    "ModelNotFound",
    "Overloaded",
    "PayloadTooLarge",
    "QoS",
    "QuotaExceeded",
    "Reconnect",
    "SeedanceError",
    "SessionBusy",
    "Stream",
    "SyncSession",
    "SyncStream",
    "TokenChunk",
    "Unauthorized",
    "UnsupportedFrame",
    "connect",
    "connect_sync",
    "infer_url",
]
