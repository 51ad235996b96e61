"""How a setting is declared, once: its field, and with it its flag, environment variable and
TOML key, its parser, its rule and its help (:func:`setting`). The server's sections
(:mod:`seedance.config`) and every engine's options (:mod:`seedance.engines.registry`) are
declared this way; :mod:`seedance.config_loader` reads them from flags, ``SEEDANCE_*`` and the
TOML file. Nothing here imports the rest of Seedance.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "SEEDANCE_"


class ConfigError(Exception):
    """A setting is missing, unknown or out of range, or a file it names cannot be used. Raised
    before serving starts (``seedance serve`` prints it in one line and exits 2), and by the
    commands that edit configuration. Not a protocol error: no client ever receives one."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _anything(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class Option:
    """One setting: its name, flag, parser and help text, and where it lives.

    ``field`` is its flat name (``audit_file``: what :meth:`ServerConfig.of
    <seedance.config.ServerConfig.of>` takes); ``section`` and ``attr`` where the value is
    kept (``config.audit.file``; no section: on the config itself); ``table_key`` its key in
    the section's TOML table (default: the flag's key without the section's name).
    """

    field: str
    flag: str
    parse: Callable[[str], Any]
    help: str
    check: Callable[[Any], bool] = _anything
    rule: str = ""
    section: str | None = None
    attr: str = ""
    table_key: str | None = None

    @property
    def key(self) -> str:
        """The TOML key (at the top level of the file)."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def in_table(self) -> str:
        """Its key in its section's table (``[audit] path``)."""
        if self.table_key is not None:
            return self.table_key
        return self.key.removeprefix(f"{self.section}_") if self.section else self.key


def setting(
    default: Any,
    flag: str,
    parse: Callable[[str], Any],
    help: str,
    check: Callable[[Any], bool] = _anything,
    rule: str = "",
    *,
    name: str | None = None,
    table_key: str | None = None,
) -> Any:
    """A dataclass field declared as a setting (see :class:`Option`; ``name``: its flat name
    when it differs from the field's)."""
    meta = {"setting": (flag, parse, help, check, rule, name, table_key)}
    return dataclasses.field(default=default, metadata=meta)


def declared(cls: type, section: str | None = None) -> tuple[Option, ...]:
    """The settings a dataclass declares with :func:`setting`."""
    options = []
    for f in dataclasses.fields(cls):
        meta = f.metadata.get("setting")
        if meta is None:
            continue
        flag, parse, help, check, rule, name, table_key = meta
        options.append(
            Option(name or f.name, flag, parse, help, check, rule, section, f.name, table_key)
        )
    return tuple(options)


# --------------------------------------------------------------------------- parsers and rules


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def count_or_auto(text: str) -> int:
    """A count, or ``auto`` (0: the caller's own choice, such as the cores it may use)."""
    return 0 if text.strip().lower() == "auto" else int(text)


def lower(text: str) -> str:
    return text.lower()


def strip(text: str) -> str:
    return text.strip()


def paths(text: str) -> tuple[str, ...]:
    """One path or several, separated by commas."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def urls(text: str) -> tuple[str, ...]:
    """One URL or several, separated by commas."""
    return tuple(url(u).rstrip("/") for u in text.split(",") if u.strip())


def url(text: str) -> str:
    value = text.strip()
    if not value.startswith(("http://", "https://")):
        raise ValueError(value)
    return value


def origins(text: str) -> tuple[str, ...]:
    """Origins as browsers send them (``https://app.example.com``), comma-separated."""
    found = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in found:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
            raise ValueError(origin)
    return found


def networks(text: str) -> tuple[str, ...]:
    """Addresses or networks (CIDR), comma-separated; ``*`` alone: any address."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if items == ("*",):
        return items
    parsed = [ipaddress.ip_network(item, strict=False) for item in items]
    # One address stays an address: "10.0.0.1", not "10.0.0.1/32".
    return tuple(
        str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n) for n in parsed
    )


def labels(text: str) -> tuple[tuple[str, str], ...]:
    """``name=value`` pairs, comma-separated: ``region=eu-west,environment=prod``."""
    pairs = []
    for item in text.split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(item)
        pairs.append((name.strip(), value.strip()))
    return tuple(pairs)


def positive(v: float) -> bool:
    return v > 0


def non_negative(v: float) -> bool:
    return v >= 0


def at_least(low: float) -> Callable[[float], bool]:
    return lambda v: v >= low


def between(low: float, high: float) -> Callable[[float], bool]:
    return lambda v: low <= v <= high


def one_of(values: Collection[str]) -> Callable[[str], bool]:
    return lambda v: v in values


def node_name(v: str) -> bool:
    return 0 < len(v) <= 64 and v.isprintable() and " " not in v
