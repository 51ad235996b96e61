"""Reading the configuration: flags, ``SEEDANCE_*`` variables and the TOML file, into one
:class:`~seedance.config.ServerConfig` and the served engine's options.

The one module that knows every part the settings are for: the server's sections
(:mod:`seedance.config`), the engines' declarations (:mod:`seedance.engines.registry`) and the
tenant tables (:mod:`seedance.tenants.config`). Precedence: flag > environment > file > default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from seedance.config import BY_NAME, OPTIONS, SECTIONS, ServerConfig
from seedance.settings import (
    ENV_PREFIX,
    ConfigError,
    Option,
    boolean,
    labels,
    origins,
    paths,
    urls,
)

if TYPE_CHECKING:
    from seedance.tenants.config import AccessConfig

#: Top-level TOML tables of the tenants (read by :mod:`seedance.tenants.config`).
ACCESS_TABLES = ("tenants", "auth")
#: The TOML table of engines' own options: ``[engines.llamacpp]``.
ENGINES_TABLE = "engines"
#: Keys of ``load_config``'s flags that are not settings.
NOT_SETTINGS = ("config", "command")

_BY_KEY = {opt.key: opt for opt in OPTIONS}
_FIELDS = {opt.field for opt in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, one flag per server option, then a group of flags per installed
    engine; unset flags stay ``None``. A flag several engines declare is shown once, in the
    first engine's group (the default engine comes first)."""
    from seedance.engines.registry import engine_specs

    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help=f"TOML file of settings (env {ENV_PREFIX}CONFIG)",
    )
    defaults = ServerConfig()
    for opt in OPTIONS:
        _add_flag(parser, opt, opt.field, _help(opt, defaults.value(opt)))

    specs = {name: spec for name, spec in engine_specs().items() if not isinstance(spec, Exception)}
    declarers: dict[str, list[str]] = {}
    for name, spec in specs.items():
        for opt in spec.declared:
            declarers.setdefault(opt.key, []).append(name)
    for name, spec in specs.items():
        first = [opt for opt in spec.declared if declarers[opt.key][0] == name]
        shared = [opt.flag for opt in spec.declared if declarers[opt.key][0] != name]
        about = spec.summary + (f" Also takes {', '.join(shared)} (above)." if shared else "")
        group = parser.add_argument_group(f"--engine {name}", about or None)
        for opt in first:
            _add_flag(group, opt, opt.key, _engine_help(opt.key, declarers[opt.key], specs))


def _add_flag(parser: argparse._ActionsContainer, opt: Option, dest: str, help: str) -> None:
    extra: dict[str, Any] = {"metavar": opt.key.upper()}
    if opt.parse is boolean:  # ``--log-prompts`` alone means true
        extra = {"nargs": "?", "const": "true", "metavar": "BOOL"}
    parser.add_argument(opt.flag, dest=dest, default=None, help=help, **extra)


def _help(opt: Option, default: Any) -> str:
    shown = "" if default in (None, ()) else f"; default {default}"
    return f"{opt.help} (env {opt.env}{shown})"


def _engine_help(key: str, names: list[str], specs: Mapping[str, Any]) -> str:
    """One flag's help for every engine that declares it: ``engine, engine: text`` per text."""
    texts: dict[tuple[str, Any], list[str]] = {}
    for name in names:
        spec = specs[name]
        opt = spec.by_key()[key]
        texts.setdefault((opt.help, getattr(spec.options(), opt.field)), []).append(name)
    if len(texts) == 1:
        return _help(opt, getattr(spec.options(), opt.field))
    parts = [
        f"{', '.join(engines)}: {text}" + ("" if default in (None, ()) else f", default {default}")
        for (text, default), engines in texts.items()
    ]
    return "; ".join(parts) + f" (env {opt.env})"


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Merge defaults, the TOML file, the environment and flags into a :class:`ServerConfig`.

    ``flags`` maps server options' field names and engine options' keys to raw flag strings
    (``None``: not given), as :func:`add_arguments` leaves them; ``flags["config"]`` names the
    TOML file. The engine's options are checked against the engine's declaration.
    """
    flags = dict(flags or {})
    env = env if env is not None else {}
    values: dict[str, Any] = {}
    engine_tables: Mapping[str, Any] = {}

    path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if path:
        data = _read_toml(Path(path))
        values["config_file"] = str(path)
        values["access"] = read_access(data, Path(path))
        engine_tables = _table(data, ENGINES_TABLE, path)
        settings: list[tuple[str, Option | None, Any]] = []
        for key, raw in data.items():
            if key in ACCESS_TABLES or key == ENGINES_TABLE:
                continue
            if key in SECTIONS:  # [audit] path = ..., [cluster] redis = ...: a section's table
                table = _table(data, key, path)
                keys = {opt.in_table: opt for opt in OPTIONS if opt.section == key}
                for name, value in table.items():
                    opt = keys.get(name)
                    if opt is None:
                        known = ", ".join(keys)
                        raise ConfigError(
                            f"{path}: [{key}]: unknown setting {name!r} (its settings: {known})"
                        )
                    settings.append((f"{key}.{name}", opt, value))
                continue
            settings.append((key, _BY_KEY.get(key), raw))
        for key, opt, raw in settings:
            if opt is None:
                takers = _takers(key)
                if not takers:
                    raise ConfigError(f"{path}: unknown setting {key!r}")
                raise ConfigError(
                    f"{path}: {key!r} is an option of the {_engines_named(takers)}: set it in "
                    f"the [{ENGINES_TABLE}.{takers[0][0]}] table"
                )
            values[opt.field] = _convert(opt, raw, f"{path}: {key}")
    for opt in OPTIONS:
        if opt.env in env:
            values[opt.field] = _convert(opt, env[opt.env], opt.env)
    for opt in OPTIONS:
        raw = flags.get(opt.field)
        if raw is not None:
            values[opt.field] = _convert(opt, raw, opt.flag)
    config = ServerConfig.of(**values)
    _check_together(config)
    engine_flags = {
        key: raw
        for key, raw in flags.items()
        if raw is not None and key not in _FIELDS and key not in NOT_SETTINGS
    }
    options = _engine_options(config.engine, engine_tables, str(path), env, engine_flags)
    return config.replace(engine_options=options)


def _check_together(config: ServerConfig) -> None:
    """Settings that only make sense with another one."""
    needs = (
        ("tls_cert", "tls_key"),
        ("tls_key", "tls_cert"),
        ("tls_client_ca", "tls_cert"),
        ("e2e_required", "e2e_key"),
        ("encrypt_at_rest", "e2e_key"),
        ("relay_trust", "node_id"),
    )
    for name, needed in needs:
        if config.value(BY_NAME[name]) and not config.value(BY_NAME[needed]):
            flag, other = (f"--{n.replace('_', '-')}" for n in (name, needed))
            raise ConfigError(f"{flag} needs {other}")


def _engine_options(
    engine: str,
    tables: Mapping[str, Any],
    path: str,
    env: Mapping[str, str],
    flags: Mapping[str, Any],
) -> Any:
    """The options of ``engine``: its defaults < its ``[engines.NAME]`` table < its environment
    variables < its flags. Every engine's table is checked, not only the served one's."""
    from seedance.engines.registry import engine_spec

    values: dict[str, Any] = {}
    for name, table in tables.items():
        try:
            spec = engine_spec(name)
        except ConfigError as exc:
            raise ConfigError(f"{path}: [{ENGINES_TABLE}.{name}]: {exc.message}") from None
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {ENGINES_TABLE}.{name}: expected a table")
        declared = spec.by_key()
        parsed = {}
        for key, raw in table.items():
            opt = declared.get(key)
            if opt is None:
                known = ", ".join(declared) or "none"
                raise ConfigError(
                    f"{path}: [{ENGINES_TABLE}.{name}]: unknown setting {key!r} "
                    f"(the {name} engine's: {known})"
                )
            parsed[opt.field] = _convert(opt, raw, f"{path}: {ENGINES_TABLE}.{name}.{key}")
        if name == engine:
            values = parsed

    spec = engine_spec(engine)
    declared = spec.by_key()
    for opt in spec.declared:
        if opt.env in env:
            values[opt.field] = _convert(opt, env[opt.env], opt.env)
    for key, raw in flags.items():
        opt = declared.get(key)
        if opt is None:
            takers = _takers(key)
            if not takers:
                raise ConfigError(f"unknown setting {key!r}")
            raise ConfigError(
                f"{takers[0][1].flag} is an option of the {_engines_named(takers)}, "
                f"not of --engine {engine}"
            )
        values[opt.field] = _convert(opt, raw, opt.flag)
    return spec.options(**values)


def _takers(key: str) -> list[tuple[str, Option]]:
    """The installed engines that declare ``key``, with their option."""
    from seedance.engines.registry import engine_specs

    return [
        (name, spec.by_key()[key])
        for name, spec in engine_specs().items()
        if not isinstance(spec, Exception) and key in spec.by_key()
    ]


def _engines_named(takers: list[tuple[str, Option]]) -> str:
    return ", ".join(name for name, _ in takers) + (" engines" if len(takers) > 1 else " engine")


def _table(data: Mapping[str, Any], name: str, path: str) -> Mapping[str, Any]:
    table = data.get(name, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {name}: expected a table")
    return table


def read_access(data: Mapping[str, Any], path: Path) -> AccessConfig | None:
    """The ``[tenants]`` and ``[auth]`` tables of a config file (None when it has none of its
    tables)."""
    if not any(table in data for table in (*ACCESS_TABLES, "audit", "cluster")):
        return None
    from seedance.tenants.config import parse_access

    return parse_access(data, str(path), path.parent)


def load_access(path: Path) -> AccessConfig | None:
    """Read the access tables again (a running server reloads them when the file changes)."""
    return read_access(_read_toml(path), path)


def _convert(opt: Option, raw: Any, source: str) -> Any:
    """Parse a string (flag, env, TOML string) or check a typed TOML value."""
    try:
        if isinstance(raw, str):
            value = opt.parse(raw)
        elif opt.parse is boolean and isinstance(raw, bool):
            value = raw
        elif opt.parse is labels and isinstance(raw, dict):
            if not all(isinstance(v, str) for v in raw.values()):
                raise TypeError(raw)
            value = tuple((str(k), v) for k, v in raw.items())
        elif opt.parse in (urls, origins, paths) and isinstance(raw, list):
            if not all(isinstance(u, str) for u in raw):
                raise TypeError(raw)
            value = opt.parse(",".join(raw))
        elif opt.parse is int and isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif opt.parse is float and isinstance(raw, int | float) and not isinstance(raw, bool):
            value = float(raw)
        else:
            raise TypeError(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: invalid value {raw!r}") from None
    if not opt.check(value):
        raise ConfigError(f"{source}: must be {opt.rule}, got {raw!r}")
    return value


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
            return data
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
