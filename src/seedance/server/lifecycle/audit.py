"""The audit gate: what the server writes to its audit log, and what it refuses while the log
cannot be written (``--audit-required``, the default)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future

from seedance.observability.audit import AuditLog
from seedance.observability.audit import kinds as audit
from seedance.protocol.errors import Overloaded

logger = logging.getLogger(__name__)

#: Builds a record, called only when there is a log to write it to.
RecordOf = Callable[[], audit.AuditRecord]


class AuditGate:
    """The server's audit log (None: none configured, and nothing is written)."""

    def __init__(self, log: AuditLog | None, *, required: bool) -> None:
        self.log = log
        self.required = log is not None and required

    def start(self) -> None:
        if self.log is not None:
            self.log.start()
            if self.log.error is not None and self.required:
                logger.error("requests are refused until the audit log can be written")

    async def close(self) -> None:
        if self.log is not None:
            await asyncio.to_thread(self.log.close)  # every record accepted, then the seal

    def health(self) -> tuple[bool, str]:
        return self.log.health() if self.log is not None else (True, "")

    def check(self) -> None:
        """Refuse a new request while the audit log cannot be written (when required)."""
        if self.required and self.log is not None and self.log.error is not None:
            raise Overloaded(
                f"the audit log cannot be written ({self.log.error}); requests are refused "
                "until it can"
            )

    def submit(self, record: RecordOf) -> Future[int] | None:
        """Queue the record ``record()`` builds; a future that completes once it is on disk
        (``--audit-fsync record``) with its seq, else None."""
        if self.log is None:
            return None
        return self.log.submit(record())

    async def wait(self, future: Future[int] | None, what: str) -> int | None:
        """Wait until a submitted record is on disk: its seq (None: not waited for, or not
        written); ``overloaded`` when it could not be written and the log is required
        (``what`` names what was not audited)."""
        if future is None:
            return None
        try:
            return await asyncio.wrap_future(future)
        except OSError as exc:
            if self.required:
                raise Overloaded(f"{what} could not be audited: {exc}") from exc
            return None

    async def write(self, record: RecordOf, what: str) -> None:
        """Write a record and wait until it is on disk (see :meth:`wait`)."""
        await self.wait(self.submit(record), what)
