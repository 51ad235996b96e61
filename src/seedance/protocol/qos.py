"""The quality of service a client asks for: its service class, its SLA tag and its health.

Sent as the ``X-QoS-Priority`` handshake header (and HTTP request header), or as the ``qos``
field of a ``generate`` frame (browsers cannot set handshake headers), in one syntax::

    X-QoS-Priority: high; slatag=api_payment_v2; health_score=0.92

- the **class** comes first: ``critical``, ``high``, ``normal``, ``low`` or ``background``; it
  sets the request's priority (10, 5, 0, -5, -10), lowered to the tenant's ``max_priority``:
  a tenant cannot raise itself above its policy by naming a higher class;
- ``slatag``: the service level the request is measured against (letters, digits and
  ``_.:-``, at most 64 characters); the server's TTFT and outcome metrics are kept per tag;
- ``health_score``: the client's own view of the service, 0 to 1 (the SDKs compute it from
  their last calls), recorded per tag.

Anything else (an unknown class or parameter, a parameter twice, a malformed value) is refused
with ``invalid_request`` saying what was wrong: a QoS header that is silently misread would be
worse than none.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from seedance.protocol.errors import InvalidRequest

HEADER: Final = "x-qos-priority"
#: Each class's priority (-10 .. 10, higher first in the admission queue).
CLASSES: Final = {"critical": 10, "high": 5, "normal": 0, "low": -5, "background": -10}
SLATAG = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_LENGTH: Final = 256


@dataclass(frozen=True, slots=True)
class QoS:
    """A parsed ``X-QoS-Priority`` value."""

    service_class: str = "normal"
    slatag: str | None = None
    health_score: float | None = None

    def __post_init__(self) -> None:
        if self.service_class not in CLASSES:
            raise InvalidRequest(
                f"unknown QoS class {self.service_class!r}; one of {', '.join(CLASSES)}"
            )
        if self.slatag is not None and not SLATAG.fullmatch(self.slatag):
            raise InvalidRequest(
                f"QoS slatag {self.slatag!r} must be 1 to 64 letters, digits or _.:-"
            )
        score = self.health_score
        if score is not None and not (math.isfinite(score) and 0.0 <= score <= 1.0):
            raise InvalidRequest(f"QoS health_score must be between 0 and 1, got {score}")

    @property
    def priority(self) -> int:
        return CLASSES[self.service_class]

    def priority_within(self, highest: int) -> int:
        """The class's priority, lowered to a tenant's highest."""
        return min(self.priority, highest)

    def header(self) -> str:
        """The value to send (``X-QoS-Priority``, or a ``generate`` frame's ``qos``)."""
        parts = [self.service_class]
        if self.slatag is not None:
            parts.append(f"slatag={self.slatag}")
        if self.health_score is not None:
            parts.append(f"health_score={self.health_score:.2f}")
        return "; ".join(parts)


def parse_qos(value: str) -> QoS:
    """Parse an ``X-QoS-Priority`` value strictly; ``invalid_request`` saying what is wrong."""
    if len(value) > MAX_LENGTH:
        raise InvalidRequest(f"the QoS value is over {MAX_LENGTH} characters")
    service_class, *params = (part.strip() for part in value.split(";"))
    if not service_class:
        raise InvalidRequest(
            f"the QoS value {value!r} must start with a class ({', '.join(CLASSES)})"
        )
    fields: dict[str, str] = {}
    for param in params:
        name, equals, raw = (p.strip() for p in param.partition("="))
        if not equals or not name or not raw:
            raise InvalidRequest(f"QoS parameter {param!r} is not name=value")
        if name not in ("slatag", "health_score"):
            raise InvalidRequest(
                f"unknown QoS parameter {name!r}; the parameters are slatag and health_score"
            )
        if name in fields:
            raise InvalidRequest(f"QoS parameter {name!r} is given twice")
        fields[name] = raw
    score = fields.get("health_score")
    if score is not None:
        try:
            health: float | None = float(score)
        except ValueError:
            raise InvalidRequest(f"QoS health_score {score!r} is not a number") from None
    else:
        health = None
    return QoS(service_class.lower(), fields.get("slatag"), health)


def qos_from_headers(headers: Iterable[tuple[bytes, bytes]]) -> QoS | None:
    """The ``X-QoS-Priority`` of ASGI headers (None: none sent); refused when malformed or
    sent twice."""
    values = [v for k, v in headers if k.lower() == b"x-qos-priority"]
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest("the X-QoS-Priority header is sent more than once")
    return parse_qos(values[0].decode("latin-1"))
