"""``seedance bench``: arguments, run, output."""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from seedance.bench.metrics import Distribution

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "url",
        nargs="?",
        default=None,
        help="Seedance WebSocket URL, e.g. ws://127.0.0.1:8000/v2/infer",
    )
    parser.add_argument(
        "--openai",
        metavar="BASE_URL",
        default=None,
        help="an OpenAI-compatible server instead, e.g. http://127.0.0.1:8000/v1",
    )
    parser.add_argument(
        "--model", default=None, help="model name (OpenAI: default the first listed)"
    )
    parser.add_argument("--api-key", default=None, help="bearer credential for the target")
    parser.add_argument(
        "--e2e",
        metavar="IDENTITY",
        default=None,
        help="encrypt every connection end to end, pinning the server's identity (its public "
        "key: a PEM file, or base64url); times are taken after each frame is decrypted",
    )
    parser.add_argument(
        "--ca-file",
        metavar="PEM",
        default=None,
        help="wss:// URLs: verify the server's certificate against these CAs (default: the "
        "system's)",
    )
    load = parser.add_argument_group("load")
    load.add_argument("--concurrency", "-c", type=int, default=None, help="closed loop: N users")
    load.add_argument("--rate", "-r", type=float, default=None, help="open loop: requests/s")
    load.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="shape of the gamma-distributed gaps for --rate (1 = Poisson; default 1)",
    )
    load.add_argument("--requests", "-n", type=int, default=None, help="measured requests")
    load.add_argument("--duration", "-d", type=float, default=None, help="seconds of load")
    load.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests run first and excluded (default: the concurrency, or 1 s of --rate)",
    )
    load.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    load.add_argument("--max-tokens", type=int, default=64, help="reply length cap (default 64)")
    load.add_argument(
        "--new-connection",
        action="store_true",
        help="open a new connection for every request (default: one per user, reused)",
    )
    load.add_argument(
        "--ramp-up",
        type=float,
        default=0.0,
        help="closed loop: start the users spread over this many seconds (default 0)",
    )
    load.add_argument(
        "--give-up-after",
        type=float,
        default=10.0,
        metavar="S",
        help="end the run when the target has answered nothing but lost connections for S "
        "seconds (default 10); users reconnect with a growing back-off meanwhile",
    )
    load.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival gaps")
    load.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sampling temperature of every request (default: the server's)",
    )
    load.add_argument(
        "--schema",
        default=None,
        metavar="FILE",
        help="a JSON Schema file every reply is bound to (/v2/infer: schema; OpenAI: "
        "response_format json_schema)",
    )
    load.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="OpenAI: a JSON file of tools every request offers (Chat Completions' tools)",
    )
    load.add_argument(
        "--tool-choice",
        default="required",
        help="with --tools: auto, required (default) or none",
    )
    load.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="every token's log probability with N alternatives (/v2/infer: logprobs; "
        "OpenAI: logprobs and top_logprobs)",
    )
    idle = parser.add_argument_group("idle connections (instead of requests)")
    idle.add_argument(
        "--idle-connections",
        type=int,
        default=None,
        metavar="N",
        help="hold N connections open for --duration, each sending heartbeats",
    )
    idle.add_argument(
        "--ping-interval",
        type=float,
        default=5.0,
        help="seconds between one connection's heartbeats (default 5)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", type=Path, default=None, metavar="FILE", help="write every sample")
    out.add_argument("--quiet", "-q", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    from seedance.eventloop import install_uvloop

    if (args.url is None) == (args.openai is None):
        print("seedance bench: give a WebSocket URL or --openai BASE_URL", file=sys.stderr)
        return 2
    try:
        from seedance.bench import targets
    except ImportError as exc:
        print(f"seedance bench: {exc}", file=sys.stderr)
        return 2
    install_uvloop()
    try:
        return asyncio.run(_main(args))
    except KeyboardInterrupt:
        return 130
    except (ValueError, targets.BenchError) as exc:
        print(f"seedance bench: {exc}", file=sys.stderr)
        return 2


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def _schema_fields(path: Path, openai: bool) -> dict[str, Any]:
    """The fields that bind every reply to the JSON Schema in ``path``, in the target API's
    own way (OpenAI: ``response_format``; ``/v2/infer``: ``schema``)."""
    schema = _read_json(path)
    if openai:
        spec = {"name": path.stem, "schema": schema}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    return {"schema": schema}


async def _main(args: argparse.Namespace) -> int:
    from seedance.bench.load import LoadSpec, hold_idle, run_load
    from seedance.bench.metrics import summarize
    from seedance.bench.report import result_json, summary_table, write_json
    from seedance.bench.targets import OpenAITarget, Target, WebSocketTarget

    target: Target
    if args.openai is not None:
        if args.e2e is not None or args.ca_file is not None:
            raise ValueError("--e2e and --ca-file are for WebSocket URLs")
        target = OpenAITarget(
            args.openai, model=args.model, api_key=args.api_key, new_connection=args.new_connection
        )
    else:
        target = WebSocketTarget(
            _ws_url(args.url, args.model, args.api_key),
            pinned=None if args.e2e is None else _pinned(args.e2e),
            tls=_tls(args.url, args.ca_file),
        )
    fields: dict[str, Any] = {}
    if args.temperature is not None:
        fields["temperature"] = args.temperature
    if args.schema is not None:
        fields.update(_schema_fields(Path(args.schema), isinstance(target, OpenAITarget)))
    if args.tools is not None:
        if not isinstance(target, OpenAITarget):
            raise ValueError("--tools is for --openai (/v2/infer does not call tools yet)")
        fields["tools"] = _read_json(Path(args.tools))
        fields["tool_choice"] = args.tool_choice
    if args.logprobs is not None:
        if isinstance(target, OpenAITarget):
            fields.update(logprobs=True, top_logprobs=args.logprobs)
        else:
            fields["logprobs"] = args.logprobs
    target.fields = fields
    progress = None if args.quiet else sys.stderr

    if args.idle_connections is not None:
        if args.duration is None:
            raise ValueError("--idle-connections needs --duration S")
        rtts, failures = await hold_idle(
            target, args.idle_connections, args.duration, args.ping_interval, progress_out=progress
        )
        dist = Distribution.of_seconds(rtts)
        print(
            f"held {args.idle_connections} connections for {args.duration:g} s: "
            f"{dist.count} heartbeats, {failures} failures; round trip ms: "
            f"mean {dist.mean:.3f} p50 {dist.p50:.3f} p90 {dist.p90:.3f} "
            f"p99 {dist.p99:.3f} max {dist.max:.3f}"
        )
        if args.json is not None:
            data = {
                "target": target.name,
                "idle_connections": args.idle_connections,
                "failures": failures,
                "heartbeat": dist.to_json(),
                "rtt_ms": [round(r * 1000.0, 4) for r in rtts],
            }
            args.json.write_text(json.dumps(data) + "\n")
        return 0 if failures == 0 else 1

    warmup = args.warmup
    if warmup is None:
        warmup = args.concurrency if args.rate is None else max(1, int(args.rate))
    spec = LoadSpec(
        concurrency=args.concurrency,
        rate=args.rate,
        burstiness=args.burstiness,
        requests=args.requests,
        duration_s=args.duration,
        warmup=warmup or 0,
        prompt_tokens=args.prompt_tokens,
        max_tokens=args.max_tokens,
        new_connection=args.new_connection,
        ramp_up_s=args.ramp_up,
        give_up_s=args.give_up_after,
        seed=args.seed,
    )
    result = await run_load(target, spec, progress_out=progress)
    summary = summarize(result.samples)
    print(summary_table(target.name, spec, result, summary))
    if args.json is not None:
        write_json(args.json, result_json(target.name, spec, result, summary))
    if result.stopped is not None:
        print(f"seedance bench: {result.stopped}", file=sys.stderr)
        return 1
    return 0 if summary.completed == summary.requests else 1


def _ws_url(url: str, model: str | None, api_key: str | None) -> str:
    """Add ``model`` and ``api_key`` query parameters to a WebSocket URL."""
    from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ValueError(f"not a WebSocket URL: {url!r} (use --openai for HTTP servers)")
    query = parse_qsl(parts.query)
    if model:
        query.append(("model", model))
    if api_key:
        query.append(("api_key", api_key))
    return urlunsplit(parts._replace(query=urlencode(query), path=parts.path or "/"))


def _pinned(identity: str) -> Ed25519PublicKey:
    from seedance.protocol.e2e import load_pinned

    try:
        return load_pinned(identity)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--e2e {identity}: not a server identity ({exc})") from None


def _tls(url: str, ca_file: str | None) -> ssl.SSLContext | None:
    """The TLS context of a ``wss://`` URL (None for ``ws://``), as the client makes it."""
    from seedance.client.session import tls_context
    from seedance.protocol.errors import InvalidRequest

    try:
        return tls_context(url, ca_file, None)
    except InvalidRequest as exc:  # a CA file for a ws:// URL
        raise ValueError(f"--ca-file: {exc.message}") from None
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ca-file {ca_file}: {exc}") from None
