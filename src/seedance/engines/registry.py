"""Find engines by name through the ``seedance.engines`` entry point group.

Built-in engines register the same way as third-party plugins, in ``pyproject.toml``::

    [project.entry-points."seedance.engines"]
    synthetic = "seedance.engines.synthetic:ENGINE"

An entry point names an :class:`EngineSpec`: the engine's own options and how to build it. A
plain factory ``(ServerConfig) -> Engine`` works too, for an engine without options of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from seedance.config import OPTIONS, ConfigError
from seedance.engines.base import Engine, ModelInfo
from seedance.settings import Option

if TYPE_CHECKING:
    from seedance.config import ServerConfig

ENTRY_POINT_GROUP = "seedance.engines"

#: An engine's options: a frozen dataclass whose fields have defaults.
OptionsT = TypeVar("OptionsT")


@dataclass(frozen=True)
class EngineSpec(Generic[OptionsT]):
    """What an engine's entry point names.

    ``options`` is a frozen dataclass of the engine's settings with their defaults, and
    ``declared`` says how each field is set: one :class:`~seedance.config.Option` per field, whose
    flag (``--n-ctx``) and environment variable (``SEEDANCE_N_CTX``) apply when this engine is
    the one served, and whose key (``n_ctx``) goes in the config file's ``[engines.NAME]``
    table. Several engines may declare the same flag. ``create(config, options)`` builds the
    engine.
    """

    create: Callable[[ServerConfig, OptionsT], Engine]
    options: type[OptionsT]
    declared: tuple[Option, ...] = ()
    #: One line for ``seedance engines`` and ``seedance serve --help``.
    summary: str = ""
    #: ``front(config, options, info)``: the engine as the server needs it when the engine
    #: runs in a process of its own (``--engine-process``): it counts and renders prompts,
    #: checks schemas and answers ``/tokenize`` (its tokenizer and chat template, not its
    #: model), and never generates; ``info`` is what the engine process serves. None: the
    #: engine cannot run in a process of its own.
    front: Callable[[ServerConfig, OptionsT, ModelInfo], Engine] | None = None
    #: Whether the engine loads a model into this machine's memory: the worker processes of
    #: ``--workers N`` then share one engine process (others run an engine in each worker).
    local_model: bool = False

    def __post_init__(self) -> None:
        fields = {f.name for f in dataclasses.fields(self.options)}  # type: ignore[arg-type]
        declared = [opt.field for opt in self.declared]
        if sorted(declared) != sorted(fields):
            raise TypeError(
                f"{self.options.__name__}: declared options {sorted(declared)} "
                f"do not match its fields {sorted(fields)}"
            )
        server = {opt.key for opt in OPTIONS} | {opt.field for opt in OPTIONS} | {"config"}
        clashes = [opt.flag for opt in self.declared if opt.key in server]
        if clashes:
            raise TypeError(f"{self.options.__name__}: {clashes} are server options")

    def by_key(self) -> dict[str, Option]:
        return {opt.key: opt for opt in self.declared}


@dataclass(frozen=True)
class NoOptions:
    """The options of an engine that declares none."""


def available_engines() -> dict[str, EntryPoint]:
    """Installed engines by name."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def engine_spec(name: str) -> EngineSpec[Any]:
    """The spec of the engine installed as ``name``."""
    engines = available_engines()
    entry = engines.get(name)
    if entry is None:
        names = ", ".join(sorted(engines)) or "none"
        raise ConfigError(f"unknown engine {name!r}; installed engines: {names}")
    return _load(name, entry)


def engine_specs() -> dict[str, EngineSpec[Any] | ConfigError]:
    """Every installed engine's spec, or why it cannot be loaded; the default engine first."""
    from seedance.config import ServerConfig

    default = ServerConfig.engine
    specs: dict[str, EngineSpec[Any] | ConfigError] = {}
    for name, entry in sorted(available_engines().items(), key=lambda i: (i[0] != default, i[0])):
        try:
            specs[name] = _load(name, entry)
        except ConfigError as exc:
            specs[name] = exc
    return specs


def create_engine(config: ServerConfig) -> Engine:
    """Build the engine that ``config.engine`` names, with ``config.engine_options`` (None: the
    engine's defaults)."""
    spec = engine_spec(config.engine)
    options = config.engine_options
    if options is None:
        options = spec.options()
    elif not isinstance(options, spec.options):
        raise ConfigError(
            f"engine {config.engine!r} takes {spec.options.__name__}, not {type(options).__name__}"
        )
    if config.engine_process:
        from seedance.engines.core.remote import RemoteEngine

        front = spec.front
        if front is None:
            raise ConfigError(
                f"--engine-process: the {config.engine} engine cannot run in a process of its "
                "own (llamacpp and synthetic can)"
            )
        return RemoteEngine(config, lambda info: front(config, options, info))
    engine = spec.create(config, options)
    if not isinstance(engine, Engine):
        raise ConfigError(f"engine {config.engine!r} did not return an Engine")
    return engine


def _load(name: str, entry: EntryPoint) -> EngineSpec[Any]:
    try:
        target = entry.load()
    except Exception as exc:  # a broken plugin: its import error, in one line
        raise ConfigError(f"engine {name!r} ({entry.value}) cannot be loaded: {exc!r}") from exc
    if isinstance(target, EngineSpec):
        return target
    if callable(target):  # a plain factory: no options of its own
        factory: Callable[[ServerConfig], Engine] = target
        return EngineSpec(lambda config, _: factory(config), NoOptions)
    raise ConfigError(f"engine {name!r} ({entry.value}) is neither an EngineSpec nor a factory")
