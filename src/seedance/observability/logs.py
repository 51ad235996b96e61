"""Request and trace ids on every log line written while a request is handled.

A request's task binds its ids once (:func:`bind_request`); tasks it starts inherit them. The
``seedance serve`` log format appends them (``request_id=... trace_id=...``) through
:class:`RequestIdsFilter`, to lines of any logger, Seedance's or an engine library's.
"""

from __future__ import annotations

import logging
import sys
import time
from contextvars import ContextVar
from typing import Final

_IDS: ContextVar[str] = ContextVar("seedance_log_ids", default="")

#: The format of ``seedance serve``'s log lines.
LOG_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_ids)s"


def configure_logging(level_name: str, process: str = "") -> None:
    """``seedance serve``'s log: one line a record on stderr, in :data:`LOG_FORMAT` (the
    server's process and its engine process alike); ``process`` (``worker=1``) ends each line
    of a process that shares the log with others."""
    level = getattr(logging, level_name.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestIdsFilter(f" {process}" if process else ""))
    handler.setFormatter(SafeFormatter(LOG_FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
    # uvicorn's own per-connection lines repeat ours; keep its warnings and errors.
    uvicorn_level = level if level <= logging.DEBUG else logging.WARNING
    logging.getLogger("uvicorn.error").setLevel(uvicorn_level)


def bind_request(request_id: str, trace_id: str) -> None:
    """Name this request on the log lines of the current task (and the tasks it starts)."""
    _IDS.set(f" request_id={request_id} trace_id={trace_id}")


#: Characters that could end a log line or steer a terminal, written as escapes instead: a
#: newline in a JWT claim, a header or a prompt must not forge a line of its own.
_ESCAPES: Final = {
    c: f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
    for c in (*range(0x09), *range(0x0A, 0x20), 0x7F, 0x85, 0x2028, 0x2029)
}


class SafeFormatter(logging.Formatter):
    """Writes each record on one line: control characters in its message and fields (not in
    the traceback that follows) become escapes such as ``\\x0a``."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return super().formatMessage(record).translate(_ESCAPES)


class RequestIdsFilter(logging.Filter):
    """Sets ``record.request_ids``: the bound ids, or an empty string outside a request, then
    ``suffix``."""

    def __init__(self, suffix: str = "") -> None:
        super().__init__()
        self.suffix = suffix

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_ids = _IDS.get() + self.suffix
        return True


class Throttled:
    """A warning that may repeat fast (a flood from one client): written at most once per
    ``interval_s``; the next line written says how many were held back meanwhile."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.held = 0
        self._next = 0.0

    def warning(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now < self._next:
            self.held += 1
            return
        self._next = now + self.interval_s
        if self.held:
            message += " (%d more like it held back since the last one)"
            args = (*args, self.held)
            self.held = 0
        self.logger.warning(message, *args)
