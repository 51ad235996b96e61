"""Suite 15 of ``make bench``: what confidential streams cost. End-to-end encryption
(docs/protocol.md, section 9) against none, and TLS against plain WebSocket, side by side.

Four ways to the same kind of server, each a ``seedance bench`` run of its own:

- ``ws://``, in the clear;
- ``ws://`` with end-to-end encryption (``seedance bench --e2e KEY.pub``): every frame sealed
  by the server and opened by the client, its time taken once it is opened (what an
  application sees), so the client's cost is in the figures too;
- ``wss://`` (``seedance serve --tls-cert --tls-key``; ``seedance bench --ca-file``);
- ``wss://`` with end-to-end encryption.

Every server has the identity (``--e2e-key``), so a way with encryption and the same way
without talk to the same process. The synthetic engine takes no model time, so what the
encryption costs is not hidden behind a model: time to first token one request at a time
(p50, p99), and delivered tokens/s of 100 concurrent streams with merging on (5 ms, the
default) and off. Goals (issue 23): encryption adds at most 1 ms to TTFT, and keeps at least
0.9x the tokens/s with merging. Then the embedded SmolLM2, TTFT only (what a user sees), and
each frame's cost measured in this process (sealing, opening, and their parts).

Servers on the server core, ``seedance bench`` on the client core; the ways take turns, the
order reversed every other round; figures are medians over rounds.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import shlex
import statistics
import sys
import tempfile
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness import (
    Cell,
    Contender,
    cores,
    fmt,
    machine_lines,
    ratio,
    run_bench,
    servers,
    verdict,
)

if TYPE_CHECKING:
    from benchmarks.harness import Report, Server


@dataclass(frozen=True, slots=True)
class Way:
    key: str
    label: str
    tls: bool
    e2e: bool

    def without_e2e(self) -> str:
        """The key of the same transport in the clear (what this way is compared with)."""
        return "wss" if self.tls else "ws"


WAYS = (
    Way("ws", "`ws://`", tls=False, e2e=False),
    Way("ws-e2e", "`ws://` + e2e", tls=False, e2e=True),
    Way("wss", "`wss://` (TLS)", tls=True, e2e=False),
    Way("wss-e2e", "`wss://` + e2e", tls=True, e2e=True),
)
STREAMS = 100
TTFT_GOAL_MS = 1.0
TOKENS_GOAL = 0.9


@dataclass(frozen=True, slots=True)
class Files:
    """What the servers and clients are given: the identity and a TLS certificate."""

    identity: Path  # Ed25519 private key (--e2e-key)
    pinned: Path  # its public key (--e2e)
    cert: Path  # self-signed, for 127.0.0.1 (--tls-cert, and the client's --ca-file)
    key: Path  # --tls-key

    def shown(self, text: str) -> str:
        """``text`` with the scratch paths as a reader would write them."""
        for path, name in (
            (self.pinned, "KEY.pub"),
            (self.identity, "KEY"),
            (self.cert, "CERT.pem"),
            (self.key, "CERT.key"),
        ):
            text = text.replace(str(path), name)
        return text


def make_files(root: Path) -> Files:
    """A fresh identity and a self-signed certificate for 127.0.0.1 and localhost."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from seedance.models.signing import keygen

    identity = root / "identity.key"
    pinned, _ = keygen(identity)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "seedance-bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )
    files = Files(identity, pinned, root / "cert.pem", root / "cert.key")
    files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files


def _server(files: Files, key: str, label: str, tls: bool, *extra: str, model: bool) -> Contender:
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--port", "{port}", "--log-level", "warning"]
    if model:
        argv += ["--threads", str(cores())]
    else:
        argv += ["--engine", "synthetic", "--max-connections", "20000", "--max-waiting", "20000"]
    argv += ["--e2e-key", str(files.identity)]
    if tls:
        argv += ["--tls-cert", str(files.cert), "--tls-key", str(files.key)]
    return Contender(key, label, [*argv, *extra], "/v2/infer", pinned=not model)


def _client_args(files: Files, way: Way) -> list[str]:
    args = ["--ca-file", str(files.cert)] if way.tls else []
    return args + (["--e2e", str(files.pinned)] if way.e2e else [])


def _url(server: Server, way: Way) -> str:
    return server.url.replace("ws://", "wss://", 1) if way.tls else server.url


Cells = dict[tuple[str, str], Cell]  # (load, way) -> its rounds


def _rounds(
    report: Report,
    files: Files,
    running: dict[str, Server],
    loads: Sequence[tuple[str, str, list[str]]],  # name, server key prefix, arguments
    title: str,
) -> Cells:
    """Every (load, way) ``rounds`` times, the ways in turn, the order reversed every other
    round; each (load, round) has prompts of its own (``--seed``), the same for every way."""
    cells: Cells = {}
    total = report.rounds * len(loads) * len(WAYS)
    done = 0
    for number, (load, prefix, args) in enumerate(loads):
        for round_ in range(report.rounds):
            seeded = [*args, "--seed", str(1000 * (number + 1) + round_)]
            order = list(WAYS) if round_ % 2 == 0 else list(reversed(WAYS))
            for way in order:
                done += 1
                report.log(f"[15 {title}] {done}/{total}: {way.label}, {load}")
                server = running[prefix + ("tls" if way.tls else "plain")]
                pinned = server.contender.pinned
                result = run_bench(
                    _url(server, way), [*seeded, *_client_args(files, way)], pinned=pinned
                )
                cells.setdefault((load, way.key), Cell()).runs.append(result)
                summary, client = result["summary"], result["client"]
                share = client["cpu_s"] / max(client["wall_s"], 1e-9)
                report.client_costs.append((summary["chunks"], client["cpu_s"], share))
    return cells


# --------------------------------------------------------------------------- each frame's cost


def _best_us(fn: Callable[[], object], n: int = 10_000, repeat: int = 5) -> float:
    """The best of ``repeat`` timings of ``n`` calls, in µs per call."""
    return min(timeit.repeat(fn, number=n, repeat=repeat)) / n * 1e6


def frame_costs() -> list[tuple[str, int, dict[str, float]]]:
    """Per frame, in µs: the server's seal, the client's open, and AES-GCM and the JSON meta
    decode alone; for a one-token frame and a merged one of 32 tokens."""
    return [_frame_cost(1), _frame_cost(32)]


def _frame_cost(tokens: int) -> tuple[str, int, dict[str, float]]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from seedance.protocol import e2e

    frame: dict[str, object] = {"type": "token", "request_id": "b1", "seq": 100}
    frame["text"] = " word" * tokens
    if tokens > 1:
        frame["n"] = tokens
    text = json.dumps(frame, separators=(",", ":"))
    data = text.encode()
    identity = Ed25519PrivateKey.generate()
    handshake = e2e.ClientHandshake(identity.public_key())
    server, offer = e2e.accept(identity, e2e.parse_client_key(handshake.param), "s", "0" * 64)
    client = handshake.finish(offer, "s")
    opened = iter([server.seal(text, "b1", 100) for _ in range(5 * 10_000)])
    aead, nonce = AESGCM(b"k" * 32), b"n" * 12
    costs = {
        "seal": _best_us(lambda: server.seal_frame(text)),
        "open": _best_us(lambda: client.open(next(opened))),
        "aes": _best_us(lambda: aead.encrypt(nonce, data, b"a" * 40)),
        "meta": _best_us(lambda: e2e.frame_meta(data)),
    }
    return f"{tokens} token{'s' if tokens > 1 else ''}", len(data), costs


# --------------------------------------------------------------------------- the suite


def confidential_suite(report: Report) -> None:
    quick = report.quick
    ttft_s, load_s = ("2", "3") if quick else ("4", "6")
    model_n = 8 if quick else 20
    loads_synthetic: list[tuple[str, str, list[str]]] = [
        (
            "1 request at a time",
            "",
            [*("-c", "1", "-d", ttft_s, "--warmup", "20", "--max-tokens", "16")],
        ),
        (
            f"{STREAMS} streams, merging on (5 ms)",
            "",
            [*("-c", str(STREAMS), "-d", load_s, "--warmup", "0", "--max-tokens", "128")],
        ),
        (
            f"{STREAMS} streams, merging off",
            "nomerge-",
            [*("-c", str(STREAMS), "-d", load_s, "--warmup", "0", "--max-tokens", "128")],
        ),
    ]
    for _, _, args in loads_synthetic:
        args += ["--prompt-tokens", "32"]
    model_load = [
        *("-c", "1", "-n", str(model_n), "--warmup", "2", "--max-tokens", "8"),
        *("--temperature", "0", "--prompt-tokens", "16"),
    ]
    with tempfile.TemporaryDirectory(prefix="seedance-confidential-") as scratch:
        files = make_files(Path(scratch))
        synthetic = [
            _server(files, "plain", "synthetic, ws://", False, model=False),
            _server(files, "tls", "synthetic, wss://", True, model=False),
            _server(files, "nomerge-plain", "synthetic, ws://, merging off", False,
                    "--merge-window-ms", "0", model=False),
            _server(files, "nomerge-tls", "synthetic, wss://, merging off", True,
                    "--merge-window-ms", "0", model=False),
        ]  # fmt: skip
        with servers(synthetic) as running:
            cells = _rounds(report, files, running, loads_synthetic, "confidential")
        models = [
            _server(files, "model-plain", "SmolLM2, ws://", False, model=True),
            _server(files, "model-tls", "SmolLM2, wss://", True, model=True),
        ]
        with servers(models) as running:
            model_cells = _rounds(
                report,
                files,
                running,
                [("SmolLM2", "model-", model_load)],
                "confidential, SmolLM2",
            )
        commands = [files.shown(c.display()) for c in [*synthetic, *models]]
        commands += [
            files.shown(shlex.join(["seedance", "bench", "URL", *args, *_client_args(files, w)]))
            for _, _, args in [*loads_synthetic, ("", "", model_load)]
            for w in WAYS
            if w.key in ("ws", "wss-e2e")
        ]
    figures = Figures({**cells, **model_cells})
    _write(report, loads_synthetic, figures, frame_costs(), commands)


class Figures:
    """The medians of every (load, way), both engines'."""

    def __init__(self, cells: Cells) -> None:
        self.cells = cells

    def cell(self, load: str, way: str) -> Cell:
        return self.cells[(load, way)]

    def ttft(self, load: str, way: str, which: str) -> float:
        return self.cell(load, way).median("summary", "ttft", which)

    def tps(self, load: str, way: str) -> float:
        return self.cell(load, way).median("summary", "delivered_tokens_per_s")

    def per_frame(self, load: str, way: str) -> float:
        cell = self.cell(load, way)
        return cell.median("summary", "output_tokens") / max(cell.median("summary", "chunks"), 1)

    def versus(self, load: str, way: str, base: str) -> str:
        return ratio(self.tps(load, way), self.tps(load, base))


def _ttft_rows(figures: Figures, loads: Sequence[str]) -> tuple[list[str], bool]:
    """The TTFT table's rows, and whether encryption kept within the goal (on the first
    load: the synthetic engine's)."""
    rows: list[str] = []
    ok = True
    for load in loads:
        base50, base99 = figures.ttft(load, "ws", "p50_ms"), figures.ttft(load, "ws", "p99_ms")
        for way in WAYS:
            cell = figures.cell(load, way.key)
            p50, p99 = figures.ttft(load, way.key, "p50_ms"), figures.ttft(load, way.key, "p99_ms")
            added = "-"
            if way.e2e:
                more50 = p50 - figures.ttft(load, way.without_e2e(), "p50_ms")
                more99 = p99 - figures.ttft(load, way.without_e2e(), "p99_ms")
                added = f"{more50:+.3f} / {more99:+.3f}"
                if load == loads[0]:
                    ok &= more50 <= TTFT_GOAL_MS and more99 <= TTFT_GOAL_MS
            requests = sum(r["summary"]["completed"] for r in cell.runs)
            engine = "SmolLM2-135M" if load == "SmolLM2" else "synthetic"
            rows.append(
                f"| {engine} | {way.label} | {fmt(p50, 3)} ({ratio(p50, base50)}) "
                f"| {fmt(p99, 3)} ({ratio(p99, base99)}) | {added} | {requests:,} "
                f"| {cell.errors()} |"
            )
    return rows, ok


def _tps_rows(figures: Figures, loads: Sequence[str]) -> tuple[list[str], bool]:
    """The tokens/s table's rows, and whether encryption kept within the goal (on the first
    load: merging on)."""
    rows: list[str] = []
    ok = True
    for load in loads:
        for way in WAYS:
            cell = figures.cell(load, way.key)
            tps = figures.tps(load, way.key)
            against = "-"
            if way.e2e:
                against = figures.versus(load, way.key, way.without_e2e())
                if load == loads[0]:
                    ok &= tps >= TOKENS_GOAL * figures.tps(load, way.without_e2e())
            client = statistics.median(
                r["client"]["cpu_s"] / max(r["client"]["wall_s"], 1e-9) for r in cell.runs
            )
            rows.append(
                f"| {load} | {way.label} | {fmt(tps)} | {figures.versus(load, way.key, 'ws')} "
                f"| {against} | {fmt(figures.per_frame(load, way.key), 1)} "
                f"| {fmt(cell.median('summary', 'ttft', 'p50_ms'))} | {client:.0%} "
                f"| {cell.errors()} |"
            )
    return rows, ok


def _where_it_goes(
    figures: Figures, ttft: str, merge: str, nomerge: str, cost: dict[str, float]
) -> str:
    """The figures explained: where each cost comes from."""
    added = figures.ttft(ttft, "ws-e2e", "p50_ms") - figures.ttft(ttft, "ws", "p50_ms")
    return (
        "Where it goes. End-to-end encryption costs per frame, not per token: the server "
        f"seals each frame ({fmt(cost['seal'])} µs above: the JSON read again for its request "
        f"id and seq, {fmt(cost['aes'])} µs of AES-GCM, the header), the client opens it "
        f"({fmt(cost['open'])} µs), and the frame grows by its 23-byte header, the request id "
        f"and a 16-byte tag. With merging on a frame carries "
        f"{fmt(figures.per_frame(merge, 'ws-e2e'), 0)} tokens, so the cost is spread thin "
        f"({figures.versus(merge, 'ws-e2e', 'ws')} of the tokens/s over `ws://`); with merging "
        f"off every token pays it ({figures.versus(nomerge, 'ws-e2e', 'ws')}). The first token "
        "pays it a few times (the request, the `start` frame, the token), "
        f"{added:+.3f} ms at the median. TLS costs per "
        "write instead: a record each (OpenSSL's AES-GCM, 22 bytes of header and tag in TLS "
        f"1.3) and uvloop's copies through a memory BIO, {figures.versus(merge, 'wss', 'ws')} "
        f"of `ws://`'s tokens/s with merging and {figures.versus(nomerge, 'wss', 'ws')} "
        "without; its handshake is paid once per connection, and connections are reused here. "
        "Where frames cost more, more tokens wait in a merge window, so frames carry more "
        "tokens (the *tokens per frame* column): merging absorbs much of either cost. With "
        "SmolLM2 the model's time dwarfs all of this; its rows differ by the model's own "
        "variation."
    )


def _write(
    report: Report,
    loads: Sequence[tuple[str, str, list[str]]],
    figures: Figures,
    costs: list[tuple[str, int, dict[str, float]]],
    commands: list[str],
) -> None:
    ttft_load, merge_load, nomerge_load = (name for name, _, _ in loads)
    ttft_rows, ttft_ok = _ttft_rows(figures, (ttft_load, "SmolLM2"))
    tps_rows, tps_ok = _tps_rows(figures, (merge_load, nomerge_load))
    report.goals.append(
        (
            f"15. End-to-end encryption adds at most {TTFT_GOAL_MS:g} ms to TTFT p50 and p99 "
            "(ws:// and wss://, one request at a time)",
            "",
            ttft_ok,
        )
    )
    report.goals.append(
        (
            f"15. End-to-end encryption keeps at least {TOKENS_GOAL}x the tokens/s, merging on "
            f"({STREAMS} streams, ws:// and wss://)",
            "",
            tps_ok,
        )
    )
    cost_rows = [
        f"| {name} | {size} | {fmt(c['seal'])} | {fmt(c['open'])} | {fmt(c['aes'])} "
        f"| {fmt(c['meta'])} |"
        for name, size, c in costs
    ]
    where = _where_it_goes(figures, ttft_load, merge_load, nomerge_load, costs[0][2])
    report.sections.append(
        "\n".join(
            [
                "## 15. Confidential streams: end-to-end encryption and TLS",
                "",
                "Four ways to the same server: `ws://` in the clear, `ws://` with end-to-end "
                "encryption (every frame sealed by the server, opened by the client, each "
                "frame's time taken once it is opened, as an application sees it), `wss://` "
                "(TLS, a P-256 certificate) and `wss://` with end-to-end encryption. Every "
                "server has `--e2e-key`, so a way with encryption and the same way without talk "
                "to the same process. The ways take turns, the order reversed every other round; "
                f"figures are medians of {report.rounds} rounds. "
                "The synthetic engine takes no model time, so nothing hides the cost; SmolLM2 "
                "shows what a user sees. Goals (issue 23), judged with encryption against the "
                f"same transport without: TTFT +{TTFT_GOAL_MS:g} ms at most, p50 and p99, one "
                f"request at a time ({verdict(ttft_ok)}); at least {TOKENS_GOAL}x the tokens/s "
                f"with merging on, {STREAMS} streams ({verdict(tps_ok)}).",
                "",
                *machine_lines(),
                "",
                "Time to first token, one request at a time, 16-token replies (SmolLM2: 8), "
                "ratios to `ws://`; *e2e adds*: ms over the same transport without, p50 / p99:",
                "",
                "| engine | way | TTFT p50 ms | TTFT p99 ms | e2e adds, ms | requests | errors |",
                "|---|---|---|---|---|---|---|",
                *ttft_rows,
                "",
                f"Delivered tokens/s, {STREAMS} streams, 128-token replies as fast as the server "
                "goes (the synthetic engine); *vs without e2e*: against the same transport in "
                "the clear; *client core*: the load generator's share of its core (below 100%: "
                "not what limited the figure):",
                "",
                "| load | way | delivered tokens/s | vs `ws://` | vs without e2e "
                "| tokens per frame | TTFT p50 ms | client core | errors |",
                "|---|---|---|---|---|---|---|---|---|",
                *tps_rows,
                "",
                "Each frame's cost in µs, one core of this machine (the runner's process, best of "
                "5): sealing a token frame as the server does (its request id and seq read from "
                "the JSON, then AES-256-GCM), opening it as the client does (AES-GCM, then the "
                "JSON's request id and seq checked against the header), and the two parts alone:",
                "",
                "| frame | JSON bytes | seal | open | AES-GCM alone | JSON meta alone |",
                "|---|---|---|---|---|---|",
                *cost_rows,
                "",
                where,
                "",
                "```",
                *commands,
                "```",
                "",
                "Every (load, round) adds `--seed N` of its own; the commands show `ws://` and "
                "`wss://` + e2e (the others drop `--e2e KEY.pub`, or `--ca-file CERT.pem`).",
                "",
            ]
        )
    )
