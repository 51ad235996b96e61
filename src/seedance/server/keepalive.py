"""When a connection pings its client, and when it gives up on one: a sans-I/O state machine
over loop times, tested without sockets.

Two kinds of keepalive (:class:`Heartbeat`):

- ``CONTROL``: standard WebSocket ping frames, which every client answers by itself (a
  browser's ``WebSocket`` included) and which never reach the page's ``onmessage``: what a
  client gets until it speaks the binary heartbeat;
- ``BINARY``: the protocol's ``01 00`` (docs/protocol.md, section 4), for a client that sent a
  binary heartbeat of its own (the SDKs), and wherever the server cannot send ping frames.

A ping goes out after ``heartbeat_interval_s`` of silence (once per silence). A
connection is idle after ``idle_timeout_s`` without inbound traffic and without a stream: one
that streams a reply is never idle (a client that only reads a long reply is busy reading it),
and its silence counts from the stream's end. Whatever it does, a connection whose socket has
accepted nothing for ``write_timeout_s`` is cut off.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Heartbeat(enum.Enum):
    CONTROL = "control"
    BINARY = "binary"


class Action(enum.Enum):
    """What the timer does now."""

    NOTHING = "nothing"
    PING = "ping"
    CLOSE_IDLE = "close_idle"  # 4408
    CUT_OFF = "cut_off"  # the socket accepts nothing: dropped


@dataclass(slots=True)
class Keepalive:
    heartbeat_interval_s: float
    idle_timeout_s: float
    write_timeout_s: float
    #: Loop time of the last inbound frame (control frames included).
    last_inbound: float
    heartbeat: Heartbeat = Heartbeat.CONTROL
    #: Loop time of the last ping sent (None: none since the last inbound frame).
    ping_sent_at: float | None = None
    #: Since when a reply streams to the client (None: none streams), and when the last ended.
    streaming_since: float | None = None
    stream_ended_at: float = 0.0

    def inbound(self, now: float) -> None:
        self.last_inbound = max(self.last_inbound, now)

    def spoke_binary(self) -> None:
        """The client sent a binary heartbeat: it gets binary ones from now on."""
        self.heartbeat = Heartbeat.BINARY

    def stream_started(self, now: float) -> None:
        if self.streaming_since is None:
            self.streaming_since = now

    def stream_ended(self, now: float) -> None:
        if self.streaming_since is not None:
            self.streaming_since = None
            self.stream_ended_at = now

    @property
    def active_since(self) -> float:
        """The moment silence counts from for the idle timeout."""
        return max(self.last_inbound, self.stream_ended_at)

    def _ping_due(self) -> float | None:
        # The silence counts from a stream's end too: a ping at the very start of the idle
        # window would leave its pong no later than the window's start, and the timer that
        # looks at the window's end a hair late would close a client that answered.
        if self.ping_sent_at is not None and self.ping_sent_at >= self.active_since:
            return None  # one ping per silence
        return self.active_since + self.heartbeat_interval_s

    def due(self, now: float, stalled_since: float | None) -> float:
        """When the timer should next look (a loop time)."""
        due = (
            now + self.write_timeout_s
            if stalled_since is None
            else stalled_since + self.write_timeout_s
        )
        if self.streaming_since is None:
            due = min(due, self.active_since + self.idle_timeout_s)
        ping = self._ping_due()
        return due if ping is None else min(due, ping)

    def on_timer(self, now: float, stalled_since: float | None) -> Action:
        """What to do at ``now``; a ``PING`` is counted as sent."""
        if stalled_since is not None and now - stalled_since >= self.write_timeout_s:
            return Action.CUT_OFF
        if self.streaming_since is None and now - self.active_since >= self.idle_timeout_s:
            return Action.CLOSE_IDLE
        ping = self._ping_due()
        if ping is not None and now >= ping:
            self.ping_sent_at = now
            return Action.PING
        return Action.NOTHING
