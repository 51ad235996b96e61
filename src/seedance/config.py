"""Server configuration, read in one place.

Every setting has one name used three ways: a flag (``--idle-timeout``), an environment
variable (``SEEDANCE_IDLE_TIMEOUT``) and a key of the TOML file given by ``--config``
(``idle_timeout = 30``). Precedence: flag > environment > file > default. The result is one
frozen :class:`ServerConfig`, with units in the field names.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

if TYPE_CHECKING:
    from seedance.tenants.config import AccessConfig

ENV_PREFIX = "SEEDANCE_"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")


class ConfigError(Exception):
    """A setting is missing, unknown or out of range, or a file it names cannot be used. Raised
    before serving starts (``seedance serve`` prints it in one line and exits 2), and by the
    commands that edit configuration. Not a protocol error: no client ever receives one."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine: str = "llamacpp"
    model: str | None = None
    model_path: str | None = None
    log_level: str = "info"
    log_prompts: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: str | None = None
    trace_tokens: bool = False
    max_frame_bytes: int = 1024 * 1024
    session_ttl_s: float = 1800.0
    max_sessions: int = 100_000
    max_session_bytes: int = 1 << 30
    heartbeat_interval_s: float = 25.0
    idle_timeout_s: float = 30.0
    max_waiting: int = 1024
    max_running: int = 0
    max_connections: int = 100_000
    handshake_timeout_s: float = 10.0
    max_handshakes: int = 4096
    max_handshakes_per_address: int = 1024
    trusted_proxies: tuple[str, ...] = ("127.0.0.1", "::1")
    max_header_bytes: int = 16 * 1024
    max_pending_bytes: int = 1024 * 1024
    write_timeout_s: float = 30.0
    merge_window_ms: float = 5.0
    drain_timeout_s: float = 30.0
    resume_grace_s: float = 60.0
    resume_window_s: float = 600.0
    resume_max_bytes: int = 64 * 1024 * 1024
    allowed_origins: tuple[str, ...] = ()
    no_playground: bool = False
    model_registry: str | None = None
    model_trust: tuple[str, ...] = ()
    model_watch_s: float = 5.0
    labels: tuple[tuple[str, str], ...] = ()
    audit_file: str | None = None
    audit_fsync: str = "record"
    audit_fsync_interval_s: float = 1.0
    audit_signing_key: str | None = None
    audit_checkpoint_interval_s: float = 60.0
    audit_rotate_bytes: int = 0
    audit_rotate_interval_s: float = 0.0
    audit_required: bool = True
    redis_url: str | None = None
    node_id: str | None = None
    lease_s: float = 5.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    tls_watch_s: float = 5.0
    e2e_key: str | None = None
    e2e_required: bool = False
    e2e_rotate_s: float = 1800.0
    e2e_rotate_bytes: int = 50 * 1024 * 1024
    encrypt_at_rest: bool = False
    # Not settings of their own: the file the settings came from, and its [tenants] and
    # [auth] tables (None: no tenant, the server is open).
    config_file: str | None = None
    access: AccessConfig | None = None
    #: The options ``engine`` declares (its EngineSpec's dataclass), from its flags, its
    #: environment variables and the file's ``[engines.NAME]`` table; None: its defaults.
    engine_options: Any = None


#: ServerConfig fields that are not options (read from the TOML file's tables).
TABLE_FIELDS = ("config_file", "access", "engine_options")
#: Top-level TOML tables that hold more than one setting.
TABLES = ("tenants", "auth", "audit", "cluster")
#: The TOML table of engines' own options: ``[engines.llamacpp]``.
ENGINES_TABLE = "engines"
#: Keys of ``load_config``'s flags that are not settings.
NOT_SETTINGS = ("config", "command")
AUDIT_FSYNC = ("record", "interval")


@dataclass(frozen=True)
class Option:
    """One setting: its field, flag, parser and help text."""

    field: str
    flag: str
    parse: Callable[[str], Any]
    help: str
    check: Callable[[Any], bool] = lambda _: True
    rule: str = ""

    @property
    def key(self) -> str:
        """The TOML key."""
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _paths(text: str) -> tuple[str, ...]:
    """One path or several, separated by commas."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def urls(text: str) -> tuple[str, ...]:
    """One URL or several, separated by commas."""
    return tuple(_url(u).rstrip("/") for u in text.split(",") if u.strip())


def _url(text: str) -> str:
    url = text.strip()
    if not url.startswith(("http://", "https://")):
        raise ValueError(url)
    return url


def _origins(text: str) -> tuple[str, ...]:
    """Origins as browsers send them (``https://app.example.com``), comma-separated."""
    origins = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
            raise ValueError(origin)
    return origins


def _networks(text: str) -> tuple[str, ...]:
    """Addresses or networks (CIDR), comma-separated; ``*`` alone: any address."""
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    if items == ("*",):
        return items
    networks = [ipaddress.ip_network(item, strict=False) for item in items]
    # One address stays an address: "10.0.0.1", not "10.0.0.1/32".
    return tuple(
        str(n.network_address) if n.prefixlen == n.max_prefixlen else str(n) for n in networks
    )


def _labels(text: str) -> tuple[tuple[str, str], ...]:
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


OPTIONS: tuple[Option, ...] = (
    Option("host", "--host", str, "address to listen on"),
    Option(
        "port",
        "--port",
        int,
        "TCP port (0: any free port)",
        lambda v: 0 <= v <= 65535,
        "between 0 and 65535",
    ),
    Option("engine", "--engine", str, "inference engine (installed: see `seedance engines`)"),
    Option("model", "--model", str, "name the model is served under (default: the engine's)"),
    Option(
        "model_path",
        "--model-path",
        str,
        "model (llamacpp: a GGUF file; transformers: a model folder or a GGUF file; "
        "vllm: a model folder or a GGUF file; default: the embedded SmolLM2-135M-Instruct)",
    ),
    Option(
        "log_level",
        "--log-level",
        str.lower,
        "log level",
        lambda v: v in LOG_LEVELS,
        "one of " + ", ".join(LOG_LEVELS),
    ),
    Option(
        "log_prompts",
        "--log-prompts",
        boolean,
        "log prompts and completions at DEBUG (off by default)",
    ),
    Option(
        "otlp_endpoint",
        "--otlp-endpoint",
        _url,
        "export traces over OTLP to this collector (http://host:4318 for http/protobuf, "
        "http://host:4317 for grpc); unset, OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT decides, and "
        "without either nothing is exported",
    ),
    Option(
        "otlp_protocol",
        "--otlp-protocol",
        str.lower,
        "OTLP transport: http/protobuf or grpc (default: OTEL_EXPORTER_OTLP_PROTOCOL, else "
        "http/protobuf)",
        lambda v: v in OTLP_PROTOCOLS,
        "one of " + ", ".join(OTLP_PROTOCOLS),
    ),
    Option(
        "trace_tokens",
        "--trace-tokens",
        boolean,
        "record each token's emit time, by seq, in its request's span (off by default)",
    ),
    Option(
        "max_frame_bytes",
        "--max-frame-bytes",
        int,
        "largest inbound frame, bytes",
        positive,
        "positive",
    ),
    Option(
        "session_ttl_s",
        "--session-ttl",
        float,
        "session lifetime after last use, seconds",
        positive,
        "positive",
    ),
    Option(
        "max_sessions", "--max-sessions", int, "sessions kept by this server", positive, "positive"
    ),
    Option(
        "max_session_bytes",
        "--max-session-bytes",
        int,
        "bytes of history all sessions may hold (their turns' text and about 160 bytes a turn); "
        "past it idle sessions are evicted, least recently used first, and when none can be, "
        "a request is refused with overloaded",
        positive,
        "positive",
    ),
    Option(
        "heartbeat_interval_s",
        "--heartbeat-interval",
        float,
        "send a heartbeat ping after this many seconds without inbound traffic",
        positive,
        "positive",
    ),
    Option(
        "idle_timeout_s",
        "--idle-timeout",
        float,
        "close (4408) after this many seconds without any inbound frame",
        positive,
        "positive",
    ),
    Option(
        "max_waiting",
        "--max-waiting",
        int,
        "admission queue length (waiting requests)",
        non_negative,
        "0 or more",
    ),
    Option(
        "max_running",
        "--max-running",
        int,
        "generations run at once per engine (0: the engine's own limit; vllm: also its "
        "max_num_seqs)",
        non_negative,
        "0 or more",
    ),
    Option(
        "max_connections",
        "--max-connections",
        int,
        "open WebSocket connections",
        positive,
        "positive",
    ),
    Option(
        "handshake_timeout_s",
        "--handshake-timeout",
        float,
        "seconds a connection has to send a request's headers (a WebSocket upgrade included) "
        "before it gets 408 and is closed",
        positive,
        "positive",
    ),
    Option(
        "max_handshakes",
        "--max-handshakes",
        int,
        "connections still sending their request headers, in all; more are refused (503)",
        positive,
        "positive",
    ),
    Option(
        "max_handshakes_per_address",
        "--max-handshakes-per-address",
        int,
        "connections still sending their request headers, per client address; more are "
        "refused (503)",
        positive,
        "positive",
    ),
    Option(
        "trusted_proxies",
        "--trusted-proxies",
        _networks,
        "addresses or networks (CIDR) of the load balancers in front, comma-separated ('*': "
        "any; empty: none): a connection from one of them is named by the client address its "
        "X-Forwarded-For header gives (logs, audit records, the failed-credentials throttle) "
        "and is not held to --max-handshakes-per-address (default 127.0.0.1,::1)",
    ),
    Option(
        "max_header_bytes",
        "--max-header-bytes",
        int,
        "a request's line and headers, bytes; more gets 431",
        lambda v: v >= 1024,
        "1024 or more",
    ),
    Option(
        "max_pending_bytes",
        "--max-pending-bytes",
        int,
        "bytes held for a client that does not read before it is cut off",
        positive,
        "positive",
    ),
    Option(
        "write_timeout_s",
        "--write-timeout",
        float,
        "cut off a client whose socket accepts nothing for this many seconds",
        positive,
        "positive",
    ),
    Option(
        "merge_window_ms",
        "--merge-window-ms",
        float,
        "token frames of a stream faster than one per window merge into one frame (0: off)",
        non_negative,
        "0 or more",
    ),
    Option(
        "drain_timeout_s",
        "--drain-timeout",
        float,
        "on shutdown, wait this long for running generations",
        non_negative,
        "0 or more",
    ),
    Option(
        "resume_grace_s",
        "--resume-grace",
        float,
        "seconds a resumable generation runs on after its last reader left; then it ends cancelled",
        non_negative,
        "0 or more",
    ),
    Option(
        "resume_window_s",
        "--resume-window",
        float,
        "seconds a resumable generation's frames can still be read (resume) after it ended",
        non_negative,
        "0 or more",
    ),
    Option(
        "resume_max_bytes",
        "--resume-max-bytes",
        int,
        "bytes of ended resumable streams kept per tenant; past it the oldest are dropped "
        "(a resume then gets history_lost trimmed)",
        non_negative,
        "0 or more",
    ),
    Option(
        "allowed_origins",
        "--allowed-origin",
        _origins,
        "browser origins allowed on /v2/infer, comma-separated (https://app.example.com); a "
        "handshake from another origin is refused with forbidden (none set: any origin)",
    ),
    Option(
        "model_registry",
        "--model-registry",
        str,
        "serve models from this registry of signed models (NAME/VERSION/, docs/models.md): "
        "--model's (comma-separated; absent: every one), each its promoted version, verified "
        "before it loads and at every reload",
    ),
    Option(
        "model_trust",
        "--model-trust",
        _paths,
        "public keys (PEM, comma-separated) whose signatures a registry's models must carry; "
        "several for a rotation",
    ),
    Option(
        "model_watch_s",
        "--model-watch-s",
        float,
        "how often the registry is checked for a newly promoted version, seconds (0: only "
        "POST /admin/models/reload)",
        non_negative,
        "0 or more",
    ),
    Option(
        "no_playground",
        "--no-playground",
        boolean,
        "do not serve the playground at / nor the browser SDK at /sdk/ (served by default)",
    ),
    Option(
        "labels",
        "--labels",
        _labels,
        "where this server runs, for tenants' policies: name=value pairs, comma-separated "
        "(region=eu-west,environment=prod; in TOML a table)",
    ),
    Option(
        "audit_file",
        "--audit-file",
        str,
        "write the audit log (hash-chained JSON Lines) to this file; [audit] path in TOML",
    ),
    Option(
        "audit_fsync",
        "--audit-fsync",
        str.lower,
        "record: each request's record is on disk before its reply ends; interval: fsync "
        "every --audit-fsync-interval seconds",
        lambda v: v in AUDIT_FSYNC,
        "one of " + ", ".join(AUDIT_FSYNC),
    ),
    Option(
        "audit_fsync_interval_s",
        "--audit-fsync-interval",
        float,
        "seconds between fsyncs with --audit-fsync interval",
        positive,
        "positive",
    ),
    Option(
        "audit_signing_key",
        "--audit-signing-key",
        str,
        "Ed25519 private key (PEM) that signs the audit log's checkpoints and seal",
    ),
    Option(
        "audit_checkpoint_interval_s",
        "--audit-checkpoint-interval",
        float,
        "seconds between signed checkpoints (also every 1000 records)",
        positive,
        "positive",
    ),
    Option(
        "audit_rotate_bytes",
        "--audit-rotate-bytes",
        int,
        "start a new audit file past this size (0: never); the chain runs on across files",
        non_negative,
        "0 or more",
    ),
    Option(
        "audit_rotate_interval_s",
        "--audit-rotate-interval",
        float,
        "start a new audit file after this many seconds (0: never)",
        non_negative,
        "0 or more",
    ),
    Option(
        "audit_required",
        "--audit-required",
        boolean,
        "refuse new requests while the audit log cannot be written (default on)",
    ),
    Option(
        "redis_url",
        "--redis",
        str.strip,
        "cluster mode: keep sessions, quotas, session locks and key revocations in this Redis "
        "(redis://[:password@]host:port/db, rediss:// for TLS, unix:///path.sock) so that "
        "several nodes serve one cluster; [cluster] redis in TOML (default: none, memory)",
        lambda v: v.startswith(("redis://", "rediss://", "unix://")),
        "a redis://, rediss:// or unix:// URL",
    ),
    Option(
        "node_id",
        "--node-id",
        str,
        "this node's name in the cluster (logs, leases); default: host name, port and a "
        "random suffix",
        lambda v: 0 < len(v) <= 64 and v.isprintable() and " " not in v,
        "1 to 64 printable characters without spaces",
    ),
    Option(
        "lease_s",
        "--lease",
        float,
        "cluster mode: seconds a node's claim on a running generation (its session's lock, "
        "its concurrency slot) outlives the node; renewed every third of it",
        lambda v: v >= 0.5,
        "0.5 or more",
    ),
    Option(
        "tls_cert",
        "--tls-cert",
        str,
        "serve wss:// and https:// on --port with this certificate chain (PEM; needs "
        "--tls-key); TLS 1.2 or later, forward-secret AEAD ciphers only",
    ),
    Option("tls_key", "--tls-key", str, "the private key (PEM) of --tls-cert"),
    Option(
        "tls_client_ca",
        "--tls-client-ca",
        str,
        "ask clients for a certificate issued by these CAs (PEM); a certificate presented and "
        "verified authenticates its tenant (the tenant's tls_subjects), one without a match "
        "still needs a key",
    ),
    Option(
        "tls_watch_s",
        "--tls-watch-s",
        float,
        "how often the certificate, key and client CA files are checked for a change, seconds; "
        "a change is loaded for new connections without a restart (0: never)",
        non_negative,
        "0 or more",
    ),
    Option(
        "e2e_key",
        "--e2e-key",
        str,
        "offer end-to-end encryption of /v2/infer streams (docs/protocol.md, section 9): the "
        "server's Ed25519 identity key (PEM), which signs each connection's key agreement and "
        "which clients pin; unset: not offered",
    ),
    Option(
        "e2e_required",
        "--e2e-required",
        boolean,
        "refuse /v2/infer connections that do not ask for end-to-end encryption (needs --e2e-key)",
    ),
    Option(
        "e2e_rotate_s",
        "--e2e-rotate-s",
        float,
        "end-to-end encryption: move a direction's key to the next after it was used this many "
        "seconds",
        positive,
        "positive",
    ),
    Option(
        "e2e_rotate_bytes",
        "--e2e-rotate-bytes",
        int,
        "end-to-end encryption: move a direction's key to the next after it sealed this many bytes",
        positive,
        "positive",
    ),
    Option(
        "encrypt_at_rest",
        "--encrypt-at-rest",
        boolean,
        "cluster mode: encrypt the conversations and stream logs kept in Redis (AES-256-GCM, "
        "a key derived from --e2e-key, which every node then needs)",
    ),
)

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
        _add_flag(parser, opt, opt.field, _help(opt, getattr(defaults, opt.field)))

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
        audit = _table(data, "audit", path)
        cluster = _table(data, "cluster", path)
        engine_tables = _table(data, ENGINES_TABLE, path)
        # [audit] path = ... is audit_file; its other keys are audit_<key>.
        table = [("audit_file" if k == "path" else f"audit_{k}", v) for k, v in audit.items()]
        table += cluster.items()  # [cluster] redis = ..., node_id, lease: the options' keys
        for key, raw in [*data.items(), *table]:
            if key in TABLES or key == ENGINES_TABLE:
                continue
            opt = _BY_KEY.get(key)
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
    config = dataclasses.replace(ServerConfig(), **values)
    _check_together(config)
    engine_flags = {
        key: raw
        for key, raw in flags.items()
        if raw is not None and key not in _FIELDS and key not in NOT_SETTINGS
    }
    options = _engine_options(config.engine, engine_tables, str(path), env, engine_flags)
    return dataclasses.replace(config, engine_options=options)


def _check_together(config: ServerConfig) -> None:
    """Settings that only make sense with another one."""
    needs = (
        ("tls_cert", "tls_key"),
        ("tls_key", "tls_cert"),
        ("tls_client_ca", "tls_cert"),
        ("e2e_required", "e2e_key"),
        ("encrypt_at_rest", "e2e_key"),
    )
    for name, needed in needs:
        if getattr(config, name) and not getattr(config, needed):
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
    """The ``[tenants]`` and ``[auth]`` tables of a config file (None when it has neither)."""
    if not any(table in data for table in TABLES):
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
        elif opt.parse is _labels and isinstance(raw, dict):
            if not all(isinstance(v, str) for v in raw.values()):
                raise TypeError(raw)
            value = tuple((str(k), v) for k, v in raw.items())
        elif opt.parse in (urls, _origins, _paths) and isinstance(raw, list):
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
