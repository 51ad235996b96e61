"""Server-side sessions: conversation context, TTL expiry, one generation at a time."""

from seedance.sessions.context import fit_context
from seedance.sessions.session import Session, SessionKey, Turn
from seedance.sessions.store import MemorySessionStore, SessionStore

__all__ = ["MemorySessionStore", "Session", "SessionKey", "SessionStore", "Turn", "fit_context"]
