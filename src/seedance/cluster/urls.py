"""The Redis that ``--redis`` names: one server (``redis://``, ``rediss://``, ``unix://``), or
the primary of a service that Redis Sentinels watch (``sentinel://``), which the node finds
through them and follows through a failover.

``sentinel://[[USER]:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB][?sentinel_password=P]``:
the sentinels to ask (any that answers will do), the service's name as the sentinels'
``sentinel monitor`` gives it, the database number (default 0), the password of the primary
and its replicas, and the sentinels' own when it differs. Only the standard library here: the
settings check a URL before the cluster mode loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlencode, urlsplit

SENTINEL_SCHEME = "sentinel://"


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None

    @classmethod
    def parse(cls, url: str) -> SentinelUrl:
        """The parts of a ``sentinel://`` URL (:class:`ValueError` saying what is wrong)."""
        if not url.startswith(SENTINEL_SCHEME):
            raise ValueError("a sentinel URL starts with sentinel://")
        parts = urlsplit(url)
        netloc = parts.netloc
        username = password = None
        if "@" in netloc:
            credentials, netloc = netloc.rsplit("@", 1)
            user, _, secret = credentials.partition(":")
            username, password = unquote(user) or None, unquote(secret) or None
        sentinels = tuple(_host_port(each) for each in netloc.split(","))
        path = [p for p in parts.path.split("/") if p]
        if not path or len(path) > 2:
            raise ValueError("name the service after the sentinels: sentinel://HOST:PORT/SERVICE")
        db = 0
        if len(path) == 2:
            if not path[1].isdigit():
                raise ValueError(f"the database number {path[1]!r} is not a number")
            db = int(path[1])
        query = parse_qs(parts.query)
        unknown = set(query) - {"sentinel_password"}
        if unknown:
            raise ValueError(f"unknown parameter(s) {', '.join(sorted(unknown))}")
        sentinel_password = query.get("sentinel_password", [None])[-1]
        return cls(sentinels, unquote(path[0]), db, username, password, sentinel_password)


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT (a sentinel)")
    return host.strip("[]"), int(port)


def redacted(url: str) -> str:
    """The URL without its passwords, for logs and errors: the one before ``@`` (a
    ``sentinel://`` URL's list of sentinels too) and a ``password`` or ``sentinel_password``
    parameter."""
    head, mark, query = url.partition("?")
    netloc = urlsplit(head).netloc
    credentials, at, hosts = netloc.rpartition("@")
    if at and ":" in credentials:
        head = head.replace(netloc, f"{credentials.partition(':')[0]}:***@{hosts}", 1)
    params = parse_qs(query, keep_blank_values=True)
    hidden = {key: ["***"] for key in ("password", "sentinel_password") if key in params}
    if hidden:
        query = urlencode(params | hidden, doseq=True, safe="*")
    return head + mark + query


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME)


def valid(url: str) -> bool:
    """Whether ``--redis`` may be ``url``."""
    if is_sentinel(url):
        try:
            SentinelUrl.parse(url)
        except ValueError:
            return False
        return True
    return url.startswith(("redis://", "rediss://", "unix://"))
