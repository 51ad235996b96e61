"""A session: the turns of one conversation, and the generation running on it."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from seedance.protocol.messages import ChatMessage, RequestId, SessionId, TenantId

SessionKey = tuple[TenantId, SessionId]

#: What a turn holds beyond its text: the Turn and ChatMessage objects and a list slot.
TURN_OVERHEAD_BYTES = 160


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of the context with its token count under ``model``."""

    message: ChatMessage
    tokens: int
    model: str

    @property
    def size(self) -> int:
        """Bytes of memory this turn holds (its text as Python stores it, and the objects)."""
        return sys.getsizeof(self.message.content) + TURN_OVERHEAD_BYTES


class Session:
    """The state of one conversation. Owned by a :class:`~seedance.sessions.SessionStore`."""

    __slots__ = (
        "active_request",
        "attached",
        "cleared",
        "created_at",
        "key",
        "last_active",
        "size",
        "turns",
        "unsaved",
    )

    def __init__(self, key: SessionKey, now: float) -> None:
        self.key = key
        self.turns: list[Turn] = []
        self.created_at = now
        self.last_active = now
        self.active_request: RequestId | None = None
        self.attached = 0
        self.size = 0  # bytes of memory the turns hold
        #: Since its store last saved it: turns appended, and whether the context was cleared
        #: first (a store that keeps the turns elsewhere writes only what changed).
        self.unsaved = 0
        self.cleared = False

    @property
    def tenant(self) -> TenantId:
        return self.key[0]

    @property
    def session_id(self) -> SessionId:
        return self.key[1]

    @property
    def busy(self) -> bool:
        return self.active_request is not None

    @property
    def idle(self) -> bool:
        """No connection holds it and no generation runs on it: it may expire or be evicted."""
        return self.attached == 0 and self.active_request is None

    def begin(self, request_id: RequestId) -> bool:
        """Claim the session for one generation; false when one is already running."""
        if self.active_request is not None:
            return False
        self.active_request = request_id
        return True

    def end(self, request_id: RequestId) -> None:
        if self.active_request == request_id:
            self.active_request = None

    def commit(self, turns: Sequence[Turn], *, reset: bool, max_tokens: int) -> None:
        """Append a finished exchange (after clearing the context when ``reset``).

        The stored context is trimmed from the oldest turns to at most ``max_tokens``.
        """
        if reset:
            self.turns.clear()
            self.cleared, self.unsaved = True, 0
        self.turns.extend(turns)
        self.unsaved += len(turns)
        total = sum(t.tokens for t in self.turns)
        drop = 0
        while total > max_tokens and drop < len(self.turns) - 1:
            total -= self.turns[drop].tokens
            drop += 1
        if drop:
            del self.turns[:drop]
        self.size = sum(t.size for t in self.turns)

    def saved(self) -> None:
        """Its store holds every turn now."""
        self.unsaved, self.cleared = 0, False

    def unsaved_turns(self) -> list[Turn]:
        """The turns appended since the last save that the context still holds (oldest
        first): its turns are those its store holds (none if ``cleared``), these appended,
        the oldest dropped until ``len(turns)`` remain."""
        return self.turns[len(self.turns) - min(self.unsaved, len(self.turns)) :]
