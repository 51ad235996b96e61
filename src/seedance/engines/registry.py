"""Find engines by name through the ``seedance.engines`` entry point group.

Built-in engines register the same way as third-party plugins, in ``pyproject.toml``::

    [project.entry-points."seedance.engines"]
    synthetic = "seedance.engines.synthetic:create_engine"

An entry point names a factory ``(ServerConfig) -> Engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING

from seedance.config import ConfigError
from seedance.engines.base import Engine

if TYPE_CHECKING:
    from seedance.config import ServerConfig

ENTRY_POINT_GROUP = "seedance.engines"

EngineFactory = Callable[["ServerConfig"], Engine]


def available_engines() -> dict[str, EntryPoint]:
    """Installed engines by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def create_engine(config: ServerConfig) -> Engine:
    """Build the engine that ``config.engine`` names."""
    engines = available_engines()
    entry = engines.get(config.engine)
    if entry is None:
        names = ", ".join(sorted(engines)) or "none"
        raise ConfigError(f"unknown engine {config.engine!r}; installed engines: {names}")
    factory: EngineFactory = entry.load()
    engine = factory(config)
    if not isinstance(engine, Engine):
        raise ConfigError(f"engine {config.engine!r} ({entry.value}) did not return an Engine")
    return engine
