"""The ``seedance`` command: ``serve``, ``chat``, ``bench``, ``cluster``, ``engines``, ``keys``
and ``audit``."""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from seedance import __version__
from seedance.config import ConfigError
from seedance.config_loader import add_arguments, load_config
from seedance.protocol.errors import SeedanceError

if TYPE_CHECKING:
    from seedance.client import ClientSession


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("serve", "relay"):
        return _serve(args)
    if args.command == "chat":
        return _chat(args)
    if args.command == "bench":
        from seedance.bench.cli import run

        return run(args)
    if args.command == "engines":
        return _engines()
    if args.command == "models":
        from seedance.models.cli import run as run_models

        return run_models(args)
    if args.command == "policy":
        from seedance.tenants.cli import run as run_policy

        return run_policy(args)
    if args.command == "keys":
        return _keys(args)
    if args.command == "audit":
        return _audit(args)
    if args.command == "cluster":
        return _cluster(args)
    parser.print_help()
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seedance", description="WebSocket-native LLM inference server and gateway."
    )
    parser.add_argument("--version", action="version", version=f"seedance {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the server", description="Serve /v2/infer, /healthz and /v1/models."
    )
    add_arguments(serve)

    relay = commands.add_parser(
        "relay",
        help="run an edge gateway whose replies come from a gateway in another region",
        description="seedance serve --engine relay: this region's sessions, the replies of a "
        "far gateway over QUIC with relay tokens (--relay-peer, --relay-key, --node-id; "
        "docs/transports.md).",
    )
    add_arguments(relay)
    relay.set_defaults(engine="relay")

    chat = commands.add_parser(
        "chat",
        help="chat with a server from the terminal",
        description="Stream replies to the terminal; Ctrl-C cancels a "
        "reply, Ctrl-D (end of input) exits.",
    )
    chat.add_argument(
        "--url",
        default=os.environ.get("SEEDANCE_URL", "ws://127.0.0.1:8000"),
        help="server URL (env SEEDANCE_URL; default ws://127.0.0.1:8000)",
    )
    chat.add_argument("--session", default=None, help="session id to create or re-attach")
    chat.add_argument("--model", default=None, help="served model name")
    chat.add_argument(
        "--api-key",
        default=os.environ.get("SEEDANCE_API_KEY"),
        help="credential (env SEEDANCE_API_KEY)",
    )
    chat.add_argument(
        "--ca-file",
        metavar="PEM",
        default=os.environ.get("SEEDANCE_CA_FILE"),
        help="wss:// URLs: trust these CAs instead of the system's (env SEEDANCE_CA_FILE)",
    )
    chat.add_argument(
        "--e2e",
        metavar="IDENTITY",
        default=os.environ.get("SEEDANCE_E2E"),
        help="encrypt the stream end to end with the server whose identity is this Ed25519 "
        "public key (a PEM file, or its base64url form; env SEEDANCE_E2E)",
    )
    chat.add_argument(
        "--once", metavar="PROMPT", default=None, help="send one prompt, print the reply, exit"
    )
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=None)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument(
        "--verbose", "-v", action="store_true", help="print session, usage and timing to stderr"
    )

    bench = commands.add_parser(
        "bench",
        help="measure a Seedance or OpenAI-compatible server under load",
        description="Load a server and report TTFT, ITL, TPOT, E2EL and throughput "
        "(vLLM's definitions). Needs the 'bench' extra.",
    )
    from seedance.bench.cli import add_arguments as add_bench_arguments

    add_bench_arguments(bench)

    cluster = commands.add_parser(
        "cluster",
        help="run a cluster on this machine: redis-server, nodes and HAProxy",
        description="Start redis-server, N nodes in cluster mode and HAProxy in front "
        "(deploy/haproxy/haproxy.cfg); print the one URL to connect to; Ctrl-C stops them all. "
        "Flags after -- go to every node's seedance serve.",
    )
    cluster.add_argument("--nodes", type=int, default=3, help="nodes, 1 to 3 (default 3)")
    cluster.add_argument(
        "--port", type=int, default=8000, help="HAProxy's port on 127.0.0.1 (default 8000)"
    )
    cluster.add_argument(
        "--sentinels",
        action="store_true",
        help="a Redis primary, a replica and three redis-sentinel processes instead of one "
        "redis-server: the nodes ride through the primary's loss (Debian package redis-sentinel)",
    )
    cluster.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE FLAGS")

    commands.add_parser("engines", help="list installed engines")

    audit = commands.add_parser("audit", help="check an audit log")
    audit_commands = audit.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = audit_commands.add_parser(
        "verify",
        help="report the first broken, missing or reordered record, or ok with the count",
        description="Checks FILE and its rotated siblings (FILE.<time>) as one chain.",
    )
    verify.add_argument("file", metavar="FILE", help="a log, or a proof (prove, consistency)")
    verify.add_argument(
        "--allow-unsealed",
        action="store_true",
        help="accept a log without a seal at its end (a running or killed server's)",
    )
    prove = audit_commands.add_parser(
        "prove",
        help="an inclusion proof of record SEQ under a signed checkpoint (JSON)",
        description="Prints the RFC 9162 inclusion proof of record SEQ (its seq) in the tree "
        "of a signed checkpoint, with the record and the checkpoint: `seedance audit verify "
        "PROOF --public-key` checks it with nothing else (docs/audit.md).",
    )
    prove.add_argument("file", metavar="FILE")
    prove.add_argument("seq", type=int, metavar="SEQ")
    prove.add_argument(
        "--size", type=int, default=None, help="the checkpoint's tree size (default: the latest)"
    )
    consistent = audit_commands.add_parser(
        "consistency",
        help="a consistency proof between two signed checkpoints (JSON)",
        description="Prints the RFC 9162 proof that the tree of NEW records (default: the "
        "latest signed checkpoint) extends the tree of OLD records, with both checkpoints.",
    )
    consistent.add_argument("file", metavar="FILE")
    consistent.add_argument("old", type=int, metavar="OLD")
    consistent.add_argument("new", type=int, metavar="NEW", nargs="?", default=None)
    witness = audit_commands.add_parser(
        "witness",
        help="cosign a server's audit checkpoints that extend what this witness cosigned",
        description="A witness of the audit log at URL (a Seedance server): fetches its latest "
        "signed checkpoint and the consistency proof from the last one this witness cosigned, "
        "cosigns it only when the proof holds, and gives the cosignature back; a fork is "
        "refused, logged and reported in STATE (docs/audit.md).",
    )
    witness.add_argument("url", metavar="URL", help="the server: http://host:port")
    witness.add_argument(
        "--log-key", required=True, metavar="PEM", help="the log's public key (its checkpoints')"
    )
    witness.add_argument(
        "--key", required=True, metavar="PEM", help="this witness's Ed25519 private key"
    )
    witness.add_argument(
        "--name", required=True, help="this witness's name in its cosignatures: witness.example/1"
    )
    witness.add_argument(
        "--state", required=True, metavar="DIR", help="what it cosigned last, and fork reports"
    )
    witness.add_argument(
        "--interval", type=float, default=10.0, help="seconds between rounds (default 10)"
    )
    witness.add_argument("--once", action="store_true", help="one round, then exit (1: a fork)")
    lineage = audit_commands.add_parser(
        "verify-lineage",
        help="check a request's lineage (GET /v1/lineage/ID) offline",
        description="Checks a lineage document: its inclusion proof against the log's public "
        "key, the witnesses' cosignatures of its checkpoint, and that it describes the record "
        "it proves.",
    )
    lineage.add_argument("file", metavar="FILE")
    lineage.add_argument(
        "--witness-key",
        action="append",
        default=[],
        metavar="PEM",
        help="a witness whose cosignature the checkpoint must carry (repeat)",
    )
    for command in (verify, prove, consistent, lineage):
        command.add_argument(
            "--public-key",
            metavar="PEM",
            default=None,
            help="Ed25519 key (public, or the signing key itself) to check checkpoint "
            "signatures (a proof's: needed)",
        )

    from seedance.models.cli import add_parser as add_models_parser

    add_models_parser(commands)
    from seedance.tenants.cli import add_parser as add_policy_parser

    add_policy_parser(commands)

    keys = commands.add_parser(
        "keys",
        help="add, revoke and list tenants' API keys in a config file",
        description="API keys live in the TOML config file as hashes; a running server "
        "picks up changes within a second.",
    )
    key_commands = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    config_help = "the server's TOML config file (env SEEDANCE_CONFIG)"
    add = key_commands.add_parser(
        "add", help="make a key for TENANT (created if needed); prints the key once"
    )
    add.add_argument("tenant", metavar="TENANT")
    add.add_argument("--role", choices=("user", "admin"), default="user")
    revoke = key_commands.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id", metavar="KEY_ID")
    listing = key_commands.add_parser("list", help="list the keys (ids, never the keys)")
    for command in (add, revoke, listing):
        command.add_argument(
            "--config",
            metavar="FILE.toml",
            default=os.environ.get("SEEDANCE_CONFIG"),
            help=config_help,
        )
    return parser


# --------------------------------------------------------------------------- serve


def _serve(args: argparse.Namespace) -> int:
    # A fatal signal or an abort in native code (an engine's C library) leaves every thread's
    # Python stack on stderr instead of a silent exit.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        config = load_config(vars(args), os.environ)
        from seedance.observability.logs import configure_logging

        configure_logging(config.log_level)
        from seedance.server.workers import Supervisor, worker_count

        supervisor = Supervisor(config) if worker_count(config) > 1 else None
        if supervisor is None:
            from seedance.server.runner import build_server, raise_descriptors

            raise_descriptors()
            server = build_server(config)
    except ConfigError as exc:
        print(f"seedance {args.command}: error: {exc.message}", file=sys.stderr)
        return 2
    if supervisor is not None:
        return supervisor.run()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down
        return 130
    return 0 if server.started else 1


def _cluster(args: argparse.Namespace) -> int:
    from seedance.cluster.local import ClusterError, run

    serve_args = [a for a in args.serve_args if a != "--"]
    try:
        return run(args.nodes, args.port, serve_args, sentinels=args.sentinels)
    except ClusterError as exc:
        print(f"seedance cluster: error: {exc}", file=sys.stderr)
        return 2


def _keys(args: argparse.Namespace) -> int:
    from pathlib import Path

    from seedance.tenants.keys import add_key, list_keys, revoke_key

    if not args.config:
        print("seedance keys: error: --config FILE is required", file=sys.stderr)
        return 2
    path = Path(args.config)
    try:
        if args.keys_command == "add":
            new = add_key(path, args.tenant, args.role)
            print(
                f"added key {new.id} (role {new.role}) for tenant {new.tenant} to {path}; "
                "it is shown once, here:"
            )
            print(new.key)
        elif args.keys_command == "revoke":
            tenant = revoke_key(path, args.key_id)
            print(f"revoked key {args.key_id} of tenant {tenant} in {path}")
        else:
            for key in list_keys(path):
                state = "revoked" if key["revoked"] else "active"
                print(f"{key['tenant']}\t{key['id']}\t{key['role']}\t{key['created']}\t{state}")
    except ConfigError as exc:
        print(f"seedance keys: error: {exc.message}", file=sys.stderr)
        return 1
    return 0


def _audit(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from seedance.keyfiles import load_public
    from seedance.observability.audit import proofs
    from seedance.observability.audit.verify import verify

    if args.audit_command == "witness":
        return _witness(args)
    key = None
    if args.public_key:
        try:
            key = load_public(Path(args.public_key))
        except (OSError, ValueError) as exc:
            print(f"seedance audit: error: --public-key: {exc}", file=sys.stderr)
            return 2
    path = Path(args.file)
    try:
        if args.audit_command == "prove":
            print(json.dumps(proofs.prove(path, args.seq, args.size), indent=2))
            return 0
        if args.audit_command == "consistency":
            print(json.dumps(proofs.consistency(path, args.old, args.new), indent=2))
            return 0
        lineage = args.audit_command == "verify-lineage"
        proof = None if lineage else proofs.read_proof(path)
        if lineage or proof is not None:
            if key is None:
                what = "lineage" if lineage else "proof"
                print(
                    f"seedance audit: error: a {what} is checked with --public-key", file=sys.stderr
                )
                return 2
            if proof is not None:
                print(proofs.check(proof, key))
            else:
                witnesses = [load_public(Path(w)) for w in args.witness_key]
                print(proofs.check_lineage(json.loads(path.read_text()), key, witnesses))
            return 0
    except ValueError as exc:  # a proof that does not hold, JSON that is not one, a bad key
        if args.audit_command in ("verify", "verify-lineage"):
            print(f"broken: {exc}")
        else:
            print(f"seedance audit: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"seedance audit: error: {path}: {exc.strerror}", file=sys.stderr)
        return 2
    verdict = verify(path, key, allow_unsealed=args.allow_unsealed)
    print(verdict.message if verdict.ok else f"broken: {verdict.message}")
    return 0 if verdict.ok else 1


def _witness(args: argparse.Namespace) -> int:
    import logging
    import time
    from pathlib import Path

    import httpx

    from seedance.keyfiles import load_private, load_public
    from seedance.observability.audit.witness import Fork, Witness

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        witness = Witness(
            args.url,
            load_public(Path(args.log_key)),
            load_private(Path(args.key)),
            args.name,
            Path(args.state),
        )
    except (OSError, ValueError) as exc:
        print(f"seedance audit witness: error: {exc}", file=sys.stderr)
        return 2
    while True:
        try:
            print(witness.round(), flush=True)
        except Fork as exc:
            print(f"seedance audit witness: FORK: {exc}", file=sys.stderr, flush=True)
            if args.once:
                return 1
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            print(f"seedance audit witness: {args.url}: {exc}", file=sys.stderr, flush=True)
            if args.once:
                return 2
        if args.once:
            return 0
        time.sleep(args.interval)


def _engines() -> int:
    """Each installed engine: name, entry point, what it is, its options (or why it cannot
    be loaded)."""
    from seedance.engines.registry import available_engines, engine_specs

    entries = available_engines()
    for name, spec in engine_specs().items():
        print(f"{name}\t{entries[name].value}")
        if isinstance(spec, ConfigError):
            print(f"    cannot be loaded: {spec.message}")
            continue
        if spec.summary:
            print(f"    {spec.summary}")
        if spec.declared:
            print(f"    options: {' '.join(opt.flag for opt in spec.declared)}")
    return 0


# --------------------------------------------------------------------------- chat


def _chat(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_chat_main(args))
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except SeedanceError as exc:
        print(f"seedance chat: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"seedance chat: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1


#: How many times ``seedance chat`` tries to reconnect: a person at a terminal waits through a
#: server's restart (up to about 26 s of jittered, doubling waits; the SDK's default, 6 tries,
#: gives up after 3 s on average, less than a restart takes on a busy machine).
CHAT_RECONNECT_ATTEMPTS = 10


async def _chat_main(args: argparse.Namespace) -> int:
    from seedance.client import Reconnect, connect

    async with connect(
        args.url,
        session_id=args.session,
        model=args.model,
        api_key=args.api_key,
        ca_file=args.ca_file,
        e2e=args.e2e,
        reconnect=Reconnect(attempts=CHAT_RECONNECT_ATTEMPTS),
    ) as session:
        if args.verbose or args.once is None:
            state = (
                "created"
                if session.created
                else (f"re-attached, {session.info.context_turns} turns of context")
            )
            print(f"session {session.session_id} ({state}), model {session.model}", file=sys.stderr)
            if session.info.e2e is not None:
                print(
                    f"end-to-end encrypted, server measurement {session.info.e2e.measurement}",
                    file=sys.stderr,
                )
        if args.once is not None:
            await _reply(session, args.once, args)
            return 0
        print(
            "Type a message and press Enter. Ctrl-C cancels a reply; Ctrl-D exits.", file=sys.stderr
        )
        while True:
            line = await _read_line("> " if sys.stdin.isatty() else "")
            if line is None:
                return 0
            if line.strip():
                await _reply(session, line, args)


async def _reply(session: ClientSession, prompt: str, args: argparse.Namespace) -> None:
    # Resumable: a reply survives a dropped connection or a server restart that keeps the log.
    stream = session.generate(
        prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        resumable=True,
    )
    reconnects = session.reconnects
    loop = asyncio.get_running_loop()
    cancel_tasks: list[asyncio.Task[None]] = []

    def on_interrupt() -> None:  # Ctrl-C: cancel this reply, not the program
        cancel_tasks.append(loop.create_task(stream.cancel()))

    handled = _add_sigint_handler(loop, on_interrupt)
    try:
        async for chunk in stream:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    except SeedanceError as exc:
        reason = f" {exc.reason}" if exc.reason else ""
        print(f"\n[{exc.code}{reason}] {exc.message}", file=sys.stderr)
        if exc.code == "connection_closed":
            raise
        return
    finally:
        if handled:
            loop.remove_signal_handler(signal.SIGINT)
        await asyncio.gather(*cancel_tasks, return_exceptions=True)
    done = stream.done
    if done is not None and done.finish_reason == "cancelled":
        sys.stdout.write(" [cancelled]")
    sys.stdout.write("\n")
    sys.stdout.flush()
    if session.reconnects != reconnects:
        print("[the connection dropped; the reply was resumed]", file=sys.stderr)
    if args.verbose and done is not None:
        usage, timing = done.usage, done.timing
        ttft = "-" if timing.ttft_ms is None else f"{timing.ttft_ms:.1f} ms"
        print(
            f"[{done.finish_reason}] prompt_tokens={usage.prompt_tokens} "
            f"completion_tokens={usage.completion_tokens} queue={timing.queue_ms:.1f} ms "
            f"ttft={ttft} total={timing.total_ms:.1f} ms request_id={done.request_id}",
            file=sys.stderr,
        )


def _add_sigint_handler(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> bool:
    try:
        loop.add_signal_handler(signal.SIGINT, callback)
    except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
        return False
    return True


async def _read_line(prompt: str) -> str | None:
    """Read a line from stdin without blocking the loop (heartbeats keep flowing)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[str | None] = loop.create_future()

    def read() -> None:
        try:
            line: str | None = input(prompt)
        except EOFError:
            line = None
        loop.call_soon_threadsafe(_resolve, future, line)

    threading.Thread(target=read, name="stdin", daemon=True).start()
    return await future


def _resolve(future: asyncio.Future[str | None], value: str | None) -> None:
    if not future.done():
        future.set_result(value)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
