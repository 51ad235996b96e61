"""Server configuration, read in one place.

Every setting has one name used three ways: a flag (``--idle-timeout``), an environment
variable (``SEEDANCE_IDLE_TIMEOUT``) and a key of the TOML file given by ``--config``
(``idle_timeout = 30``). Precedence: flag > environment > file > default. The result is one
frozen :class:`ServerConfig`, with units in the field names.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    parallel: int = 8
    n_ctx: int = 0
    threads: int = 0
    kv_reuse: bool = True
    repack: str = "auto"
    flash_attn: str = "auto"
    device: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
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
    max_header_bytes: int = 16 * 1024
    max_pending_bytes: int = 1024 * 1024
    write_timeout_s: float = 30.0
    merge_window_ms: float = 5.0
    drain_timeout_s: float = 30.0
    upstream: tuple[str, ...] = ()
    upstream_api_key: str | None = None
    upstream_model: str | None = None
    upstream_timeout_s: float = 30.0
    upstream_cooldown_s: float = 10.0
    synthetic_ttft_ms: float = 0.0
    synthetic_tokens_per_s: float = 0.0
    allowed_origins: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    audit_file: str | None = None
    audit_fsync: str = "record"
    audit_fsync_interval_s: float = 1.0
    audit_signing_key: str | None = None
    audit_checkpoint_interval_s: float = 60.0
    audit_rotate_bytes: int = 0
    audit_rotate_interval_s: float = 0.0
    audit_required: bool = True
    # Not settings of their own: the file the settings came from, and its [tenants] and
    # [auth] tables (None: no tenant, the server is open).
    config_file: str | None = None
    access: AccessConfig | None = None


#: ServerConfig fields that are not options (read from the TOML file's tables).
TABLE_FIELDS = ("config_file", "access")
#: Top-level TOML tables that hold more than one setting.
TABLES = ("tenants", "auth", "audit")
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


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _urls(text: str) -> tuple[str, ...]:
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


def _positive(v: float) -> bool:
    return v > 0


def _non_negative(v: float) -> bool:
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
        "parallel",
        "--parallel",
        int,
        "llamacpp, transformers: sequences decoded together in one batch",
        lambda v: 1 <= v <= 256,
        "between 1 and 256",
    ),
    Option(
        "n_ctx",
        "--n-ctx",
        int,
        "llamacpp, transformers: context tokens in all, shared evenly by the parallel sequences "
        "(0: 4096 per sequence, at most the model's trained context)",
        _non_negative,
        "0 or more",
    ),
    Option(
        "threads",
        "--threads",
        int,
        "llamacpp, transformers: CPU threads (0: the cores this process may use)",
        _non_negative,
        "0 or more",
    ),
    Option(
        "kv_reuse",
        "--kv-reuse",
        _bool,
        "llamacpp: reuse the KV cache of earlier turns (off: every prompt is prefilled whole)",
    ),
    Option(
        "repack",
        "--repack",
        str.lower,
        "llamacpp: lay the weights out for this CPU's own kernels (llama.cpp's extra buffer "
        "types, AMX included); auto: measured once per CPU, build and model by a probe in a "
        "child process, off where it crashes or is not faster",
        lambda v: v in ("auto", "on", "off"),
        "auto, on or off",
    ),
    Option(
        "flash_attn",
        "--flash-attn",
        str.lower,
        "llamacpp: llama.cpp's flash attention (auto: on where the backend has it, the CPU "
        "included); off makes a short message after a long history faster and batches and "
        "long prompts slower",
        lambda v: v in ("auto", "on", "off"),
        "auto, on or off",
    ),
    Option(
        "device",
        "--device",
        str.lower,
        "transformers: where the model runs (auto: the first CUDA GPU if there is one)",
        lambda v: v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
        "auto, cpu, cuda or cuda:N",
    ),
    Option(
        "tensor_parallel_size",
        "--tensor-parallel-size",
        int,
        "vllm: GPUs the model is split across",
        lambda v: v >= 1,
        "1 or more",
    ),
    Option(
        "gpu_memory_utilization",
        "--gpu-memory-utilization",
        float,
        "vllm: share of each GPU's memory vLLM may take",
        lambda v: 0 < v <= 1,
        "above 0 and at most 1",
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
        _bool,
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
        _bool,
        "record each token's emit time, by seq, in its request's span (off by default)",
    ),
    Option(
        "max_frame_bytes",
        "--max-frame-bytes",
        int,
        "largest inbound frame, bytes",
        _positive,
        "positive",
    ),
    Option(
        "session_ttl_s",
        "--session-ttl",
        float,
        "session lifetime after last use, seconds",
        _positive,
        "positive",
    ),
    Option(
        "max_sessions", "--max-sessions", int, "sessions kept by this server", _positive, "positive"
    ),
    Option(
        "max_session_bytes",
        "--max-session-bytes",
        int,
        "bytes of history all sessions may hold (their turns' text and about 160 bytes a turn); "
        "past it idle sessions are evicted, least recently used first, and when none can be, "
        "a request is refused with overloaded",
        _positive,
        "positive",
    ),
    Option(
        "heartbeat_interval_s",
        "--heartbeat-interval",
        float,
        "send a heartbeat ping after this many seconds without inbound traffic",
        _positive,
        "positive",
    ),
    Option(
        "idle_timeout_s",
        "--idle-timeout",
        float,
        "close (4408) after this many seconds without any inbound frame",
        _positive,
        "positive",
    ),
    Option(
        "max_waiting",
        "--max-waiting",
        int,
        "admission queue length (waiting requests)",
        _non_negative,
        "0 or more",
    ),
    Option(
        "max_running",
        "--max-running",
        int,
        "generations run at once per engine (0: the engine's own limit; vllm: also its "
        "max_num_seqs)",
        _non_negative,
        "0 or more",
    ),
    Option(
        "max_connections",
        "--max-connections",
        int,
        "open WebSocket connections",
        _positive,
        "positive",
    ),
    Option(
        "handshake_timeout_s",
        "--handshake-timeout",
        float,
        "seconds a connection has to send a request's headers (a WebSocket upgrade included) "
        "before it gets 408 and is closed",
        _positive,
        "positive",
    ),
    Option(
        "max_handshakes",
        "--max-handshakes",
        int,
        "connections still sending their request headers, in all; more are refused (503)",
        _positive,
        "positive",
    ),
    Option(
        "max_handshakes_per_address",
        "--max-handshakes-per-address",
        int,
        "connections still sending their request headers, per client address; more are "
        "refused (503)",
        _positive,
        "positive",
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
        _positive,
        "positive",
    ),
    Option(
        "write_timeout_s",
        "--write-timeout",
        float,
        "cut off a client whose socket accepts nothing for this many seconds",
        _positive,
        "positive",
    ),
    Option(
        "merge_window_ms",
        "--merge-window-ms",
        float,
        "token frames of a stream faster than one per window merge into one frame (0: off)",
        _non_negative,
        "0 or more",
    ),
    Option(
        "drain_timeout_s",
        "--drain-timeout",
        float,
        "on shutdown, wait this long for running generations",
        _non_negative,
        "0 or more",
    ),
    Option(
        "upstream",
        "--upstream",
        _urls,
        "openai engine: base URL(s) of OpenAI-compatible servers, comma-separated "
        "(http://host:port/v1)",
    ),
    Option(
        "upstream_api_key",
        "--upstream-api-key",
        str,
        "openai engine: bearer key sent to the upstreams",
    ),
    Option(
        "upstream_model",
        "--upstream-model",
        str,
        "openai engine: model name asked of the upstreams (default: the first they list)",
    ),
    Option(
        "upstream_timeout_s",
        "--upstream-timeout",
        float,
        "openai engine: seconds an upstream may send nothing (connect, first byte, between "
        "chunks) before it counts as failed",
        _positive,
        "positive",
    ),
    Option(
        "upstream_cooldown_s",
        "--upstream-cooldown",
        float,
        "openai engine: seconds a failed upstream is left out before it is probed again",
        _positive,
        "positive",
    ),
    Option(
        "allowed_origins",
        "--allowed-origin",
        _origins,
        "browser origins allowed on /v2/infer, comma-separated (https://app.example.com); a "
        "handshake from another origin is refused with forbidden (none set: any origin)",
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
        _positive,
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
        _positive,
        "positive",
    ),
    Option(
        "audit_rotate_bytes",
        "--audit-rotate-bytes",
        int,
        "start a new audit file past this size (0: never); the chain runs on across files",
        _non_negative,
        "0 or more",
    ),
    Option(
        "audit_rotate_interval_s",
        "--audit-rotate-interval",
        float,
        "start a new audit file after this many seconds (0: never)",
        _non_negative,
        "0 or more",
    ),
    Option(
        "audit_required",
        "--audit-required",
        _bool,
        "refuse new requests while the audit log cannot be written (default on)",
    ),
    Option(
        "synthetic_ttft_ms",
        "--synthetic-ttft-ms",
        float,
        "synthetic engine: delay before the first token, ms",
        _non_negative,
        "0 or more",
    ),
    Option(
        "synthetic_tokens_per_s",
        "--synthetic-tokens-per-s",
        float,
        "synthetic engine: token rate (0: unlimited)",
        _non_negative,
        "0 or more",
    ),
)

_BY_KEY = {opt.key: opt for opt in OPTIONS}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config`` and one flag per option; unset flags stay ``None``."""
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        default=None,
        help=f"TOML file of settings (env {ENV_PREFIX}CONFIG)",
    )
    defaults = ServerConfig()
    for opt in OPTIONS:
        default = getattr(defaults, opt.field)
        shown = "" if default in (None, ()) else f"; default {default}"
        extra: dict[str, Any] = {"metavar": opt.key.upper()}
        if opt.parse is _bool:  # ``--log-prompts`` alone means true
            extra = {"nargs": "?", "const": "true", "metavar": "BOOL"}
        parser.add_argument(
            opt.flag,
            dest=opt.field,
            default=None,
            help=f"{opt.help} (env {opt.env}{shown})",
            **extra,
        )


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> ServerConfig:
    """Merge defaults, the TOML file, the environment and flags into a :class:`ServerConfig`.

    ``flags`` maps field names to raw flag strings (``None``: not given), as
    :func:`add_arguments` leaves them; ``flags["config"]`` names the TOML file.
    """
    flags = dict(flags or {})
    env = env if env is not None else {}
    values: dict[str, Any] = {}

    path = flags.get("config") or env.get(ENV_PREFIX + "CONFIG")
    if path:
        data = _read_toml(Path(path))
        values["config_file"] = str(path)
        values["access"] = read_access(data, Path(path))
        audit = data.get("audit", {})
        if not isinstance(audit, dict):
            raise ConfigError(f"{path}: audit: expected a table")
        # [audit] path = ... is audit_file; its other keys are audit_<key>.
        table = [("audit_file" if k == "path" else f"audit_{k}", v) for k, v in audit.items()]
        for key, raw in [*data.items(), *table]:
            if key in TABLES:
                continue
            opt = _BY_KEY.get(key)
            if opt is None:
                raise ConfigError(f"{path}: unknown setting {key!r}")
            values[opt.field] = _convert(opt, raw, f"{path}: {key}")
    for opt in OPTIONS:
        if opt.env in env:
            values[opt.field] = _convert(opt, env[opt.env], opt.env)
    for opt in OPTIONS:
        raw = flags.get(opt.field)
        if raw is not None:
            values[opt.field] = _convert(opt, raw, opt.flag)
    return dataclasses.replace(ServerConfig(), **values)


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
        elif opt.parse is _bool and isinstance(raw, bool):
            value = raw
        elif opt.parse is _labels and isinstance(raw, dict):
            if not all(isinstance(v, str) for v in raw.values()):
                raise TypeError(raw)
            value = tuple((str(k), v) for k, v in raw.items())
        elif opt.parse in (_urls, _origins) and isinstance(raw, list):
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
