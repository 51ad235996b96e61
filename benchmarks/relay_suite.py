"""Suite 20 of ``make bench``: the cross-region relay over a real lossy link.

An edge and a far region are network namespaces joined by :mod:`seedance.testing.wire` (IP
packets delayed 40 ms each way: 80 ms of round trip, and lost at the rate asked), the far
gateway a ``seedance serve --http3`` process in its namespace (the synthetic engine at
:data:`PACE` tokens/s per stream). Every figure comes from that link.

1. **Head-of-line blocking**: :data:`STREAMS` requests relayed at once, :data:`TOKENS`-token
   replies, at 0% and 1% loss, through the relay's QUIC link (one connection, a stream per
   request: Seedance's own :class:`~seedance.relay.client.Peer`) against the same requests
   through a WebSocket relay over one TCP connection with TLS (each request's lines tagged
   with its id; the baseline's ends are :mod:`benchmarks.relay_driver`). Per token, the gap
   after the one before (p50, p99), and each request's time to first token (p50, p99).
   Goal at 1% loss: the inter-token gap's p99 at most 0.5x the TCP relay's.
2. **Bytes on the wire** per 1,000 relayed tokens (what the link carried from the far region,
   IP headers included), QUIC against WebSocket over TLS with and without
   permessage-deflate, at 0% loss; the design document's figure (QUIC saves 37%) beside them.
3. **A new session's time to first token through the relay**: a client of the edge
   (``seedance serve --engine relay`` in the edge's namespace) opens a session and asks for one
   token, against the far gateway asked directly: the relay's link is kept, so the goal is at
   most one round trip (80 ms) more.
4. **WebTransport against WebSocket in Chromium** on the same link: a headless Chromium in the
   edge's namespace opens a page of a far gateway (``--http3`` with a certificate of its own,
   pinned by its hash) and runs :data:`BROWSER_STREAMS` sessions at once through the browser
   SDK, once over WebTransport and once over WebSocket, at 0% and 1% loss: each session's
   time to first token and every token's gap, as the page saw them.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import fmt, ratio, terminate, verdict

if TYPE_CHECKING:
    from benchmarks.harness import Report
    from seedance.testing.regions import Regions

STREAMS = 50
TOKENS = 256
PACE = 20  # tokens/s per stream
DELAY_MS = 40  # each way
FAR_PORT = 18443
MUX_PORT, MUX_DEFLATE_PORT = 18444, 18445
EDGE_PORT = 18080
SESSIONS = 20  # new sessions timed for part 3
BROWSER_PORT = 18500
BROWSER_STREAMS = 20
BROWSER_TOKENS = 128


def _exe() -> str:
    return str(Path(sys.executable).with_name("seedance"))


class _Process:
    """A program in a namespace, its output read as it comes."""

    def __init__(self, argv: list[str]) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"did not start ({text!r}):\n{''.join(self.lines)[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        terminate(self.proc)


def _keys(workdir: Path) -> dict[str, str]:
    """The far gateway's certificate (of a CA made here) and the edge's relay key."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from seedance.testing.regions import FAR_ADDRESS, FAR_ON_LINK

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "bench CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=10))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    for address in (FAR_ON_LINK, FAR_ADDRESS, "127.0.0.1"):
        names.append(x509.IPAddress(ipaddress.ip_address(address)))
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "far")]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=10))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    plain = serialization.NoEncryption()
    pkcs8 = serialization.PrivateFormat.PKCS8
    edge = Ed25519PrivateKey.generate()
    files = {
        "ca": ca.public_bytes(pem),
        "cert": cert.public_bytes(pem),
        "key": key.private_bytes(pem, pkcs8, plain),
        "edge": edge.private_bytes(pem, pkcs8, plain),
        "edge_pub": edge.public_key().public_bytes(
            pem, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    paths = {}
    for name, data in files.items():
        path = workdir / f"{name}.pem"
        path.write_bytes(data)
        paths[name] = str(path)
    return paths


def _driver(regions: Regions, *args: str) -> dict[str, Any]:
    argv = regions.exec(regions.edge, [sys.executable, "-m", "benchmarks.relay_driver", *args])
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"relay driver {args[0]} failed: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


_LABELS = {
    "quic": "QUIC (Seedance)",
    "quic2": "QUIC, `--relay-copies 2`",
    "tcp": "WebSocket over TLS, one TCP connection",
    "tcp+deflate": "WebSocket over TLS, permessage-deflate",
}


def _late(gaps: list[float]) -> float:
    """The share of gaps a round trip or more longer than the engine's pace: tokens held back
    by a loss (theirs, or, on one TCP connection, another stream's)."""
    late = 1000 / PACE + 2 * DELAY_MS
    return sum(1 for gap in gaps if gap >= late) / len(gaps) if gaps else float("nan")


def _transports(
    report: Report, regions: Regions, keys: dict[str, str], tokens: int
) -> tuple[dict[tuple[float, str], dict[str, Any]], dict[str, float]]:
    """Part 1 (every loss and transport, alternating rounds) and part 2 (bytes per 1,000)."""
    from seedance.testing.regions import FAR_ON_LINK

    quic = ["quic", f"https://{FAR_ON_LINK}:{FAR_PORT}", keys["ca"], keys["edge"]]

    def ws(port: int, deflate: str) -> list[str]:
        return ["ws", f"wss://{FAR_ON_LINK}:{port}", keys["ca"], keys["edge"], str(STREAMS),
                str(tokens), deflate]  # fmt: skip

    runs = {
        "quic": [*quic, str(STREAMS), str(tokens), "1"],
        "quic2": [*quic, str(STREAMS), str(tokens), "2"],
        "tcp": ws(MUX_PORT, "0"),
        "tcp+deflate": ws(MUX_DEFLATE_PORT, "1"),
    }
    cells: dict[tuple[float, str], dict[str, Any]] = {}
    carried: dict[str, float] = {}
    for loss in (0.0, 1.0):
        regions.netem(DELAY_MS, loss)
        names = ["quic", "quic2", "tcp"] + (["tcp+deflate"] if loss == 0 else [])
        for round_ in range(report.rounds):
            order = names if round_ % 2 == 0 else list(reversed(names))
            for name in order:
                report.log(f"[20. relay] {loss:g}% loss, {name}, round {round_ + 1}")
                before = regions.carried()[1]
                result = _driver(regions, *runs[name])
                delivered = regions.carried()[1] - before
                cell = cells.setdefault((loss, name), {"gaps": [], "ttft": [], "errors": 0})
                cell["gaps"] += result["gaps_ms"]
                cell["ttft"] += result["ttft_ms"]
                cell["errors"] += result["errors"]
                if loss == 0 and result["tokens"]:
                    carried.setdefault(name, delivered / result["tokens"] * 1000)
    return cells, carried


_ECHO = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 9999))
while True:
    data, peer = s.recvfrom(64)
    s.sendto(data, peer)
"""
_PING = """
import socket, statistics, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(2)
rtts = []
for _ in range(20):
    sent = time.perf_counter()
    s.sendto(b"x", (sys.argv[1], 9999))
    try:
        s.recvfrom(64)
        rtts.append((time.perf_counter() - sent) * 1000)
    except TimeoutError:
        pass
    time.sleep(0.02)
print(statistics.median(rtts))
"""


def _link_rtt(regions: Regions) -> float:
    """The edge-far link's round trip as a UDP echo sees it, ms (the link's delay and the
    wire's own cost)."""
    from seedance.testing.regions import FAR_ON_LINK

    echo = _Process(regions.exec(regions.far, [sys.executable, "-c", _ECHO]))
    try:
        time.sleep(0.3)
        argv = regions.exec(regions.edge, [sys.executable, "-c", _PING, FAR_ON_LINK])
        return float(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    finally:
        echo.stop()


async def _ttft(url: str, ca: str | None, sessions: int) -> list[float]:
    """Each new session's time to first token, ms (the session opened first, not counted)."""
    from seedance.client import connect

    times = []
    for i in range(sessions):
        async with connect(url, ca_file=ca) as session:
            sent = time.perf_counter()
            async for _ in session.generate(f"new session {i}", max_tokens=1):
                times.append((time.perf_counter() - sent) * 1000)
                break
    return times


_PAGE_RUN = """async ([transport, streams, tokens]) => {
    const sd = await import('/sdk/index.js');
    const ttft = [], gaps = [];
    const one = async (i) => {
        const session = await sd.connect("", {transport});
        const used = session.transport;
        const sent = performance.now();
        let last = null;
        for await (const chunk of session.generate(`browser ${i}`, {max_tokens: tokens})) {
            const now = performance.now();
            if (last === null) ttft.push(now - sent); else gaps.push(now - last);
            for (let k = 1; k < chunk.n; k++) gaps.push(0);
            last = now;
        }
        session.close();
        return used;
    };
    const used = await Promise.all(Array.from({length: streams}, (_, i) => one(i)));
    return {ttft, gaps, used: [...new Set(used)]};
}"""


async def _browser_runs(
    regions: Regions, report: Report, port: int
) -> dict[tuple[float, str], Any]:
    """Part 4: the page's figures per (loss, transport), alternating rounds."""
    import shutil

    from playwright.async_api import async_playwright

    from seedance.testing.regions import FAR_ON_LINK

    chromium = shutil.which("chromium")
    if chromium is None:
        raise RuntimeError("chromium is not installed (Debian package chromium)")
    wrapper = Path(tempfile.mkdtemp(prefix="seedance-chromium-")) / "chromium-in-edge"
    wrapper.write_text(f'#!/bin/sh\nexec ip netns exec {regions.edge} {chromium} "$@"\n')
    wrapper.chmod(0o755)
    origin = f"http://{FAR_ON_LINK}:{port}"
    cells: dict[tuple[float, str], Any] = {}
    async with async_playwright() as driver:
        browser = await driver.chromium.launch(
            executable_path=str(wrapper),
            # The far gateway's page is plain HTTP on an address that is not this machine's:
            # a secure context only by this flag (WebTransport needs one).
            args=["--no-sandbox", f"--unsafely-treat-insecure-origin-as-secure={origin}"],
        )
        page = await browser.new_page()
        await page.goto(f"{origin}/sdk/package.json")
        for loss in (0.0, 1.0):
            regions.netem(DELAY_MS, loss)
            for round_ in range(report.rounds):
                order = ["webtransport", "websocket"]
                for transport in order if round_ % 2 == 0 else order[::-1]:
                    report.log(f"[20. relay] Chromium, {loss:g}% loss, {transport}")
                    run = await page.evaluate(
                        _PAGE_RUN, [transport, BROWSER_STREAMS, BROWSER_TOKENS]
                    )
                    if run["used"] != [transport]:
                        raise RuntimeError(f"the page used {run['used']}, not {transport}")
                    cell = cells.setdefault((loss, transport), {"gaps": [], "ttft": []})
                    cell["gaps"] += run["gaps"]
                    cell["ttft"] += run["ttft"]
        await browser.close()
    return cells


def relay_suite(report: Report) -> None:
    from seedance.testing.regions import EDGE_ADDRESS, FAR_ADDRESS, FAR_ON_LINK, Regions, available

    why = available()
    if why is not None:
        report.sections.append(f"## 20. The cross-region relay\n\nNot run: {why}.\n")
        return
    tokens = TOKENS // 2 if report.quick else TOKENS
    workdir = Path(tempfile.mkdtemp(prefix="seedance-relay-bench-"))
    keys = _keys(workdir)
    regions = Regions()
    processes: list[_Process] = []
    try:
        far = _Process(regions.exec(regions.far, [
            _exe(), "serve", "--host", "0.0.0.0", "--port", str(FAR_PORT), "--engine",
            "synthetic", "--synthetic-tokens-per-s", str(PACE), "--tls-cert", keys["cert"],
            "--tls-key", keys["key"], "--http3", "--node-id", "far-1", "--relay-trust",
            f"edge-1={keys['edge_pub']}", "--max-connections", "10000", "--log-level", "info",
        ]))  # fmt: skip
        processes.append(far)
        far.wait_for("HTTP/3 and WebTransport on UDP port")
        far_http = f"https://127.0.0.1:{FAR_PORT}/v2/relay"
        for port, deflate in ((MUX_PORT, "0"), (MUX_DEFLATE_PORT, "1")):
            mux = _Process(regions.exec(regions.far, [
                sys.executable, "-m", "benchmarks.relay_driver", "ws-far", str(port),
                keys["cert"], keys["key"], keys["ca"], far_http, deflate,
            ]))  # fmt: skip
            processes.append(mux)
            mux.wait_for('"ready"')
        edge = _Process(regions.exec(regions.edge, [
            _exe(), "serve", "--host", "0.0.0.0", "--port", str(EDGE_PORT), "--engine", "relay",
            "--node-id", "edge-1", "--relay-peer", f"far-1=https://{FAR_ON_LINK}:{FAR_PORT}",
            "--relay-key", keys["edge"], "--relay-ca", keys["ca"], "--relay-model", "synthetic",
            "--log-level", "info",
        ]))  # fmt: skip
        processes.append(edge)
        edge.wait_for("connect to")
        cells, carried = _transports(report, regions, keys, tokens)
        regions.netem(DELAY_MS, 0)
        rtt = _link_rtt(regions)
        report.log("[20. relay] a new session's time to first token")
        asyncio.run(_ttft(f"ws://{EDGE_ADDRESS}:{EDGE_PORT}", None, 2))  # the relay link up
        relayed = asyncio.run(_ttft(f"ws://{EDGE_ADDRESS}:{EDGE_PORT}", None, SESSIONS))
        direct = asyncio.run(_ttft(f"wss://{FAR_ADDRESS}:{FAR_PORT}", keys["ca"], SESSIONS))
        browser_far = _Process(regions.exec(regions.far, [
            _exe(), "serve", "--host", "0.0.0.0", "--port", str(BROWSER_PORT), "--engine",
            "synthetic", "--synthetic-tokens-per-s", str(PACE), "--http3", "--log-level", "info",
        ]))  # fmt: skip
        processes.append(browser_far)
        browser_far.wait_for("HTTP/3 and WebTransport on UDP port")
        browser = asyncio.run(_browser_runs(regions, report, BROWSER_PORT))
    finally:
        for process in processes:
            process.stop()
        regions.close()
    _write(report, cells, carried, relayed, direct, rtt, tokens)
    _write_browser(report, browser)


def _write(
    report: Report,
    cells: dict[tuple[float, str], dict[str, Any]],
    carried: dict[str, float],
    relayed: list[float],
    direct: list[float],
    rtt: float,
    tokens: int,
) -> None:
    rows = []
    for (loss, name), cell in sorted(cells.items()):
        rows.append(
            f"| {loss:g}% | {_LABELS[name]} | {fmt(_p(cell['gaps'], 0.5), 1)} | "
            f"{fmt(_p(cell['gaps'], 0.99), 1)} | {fmt(_p(cell['gaps'], 0.999), 1)} | "
            f"{_late(cell['gaps']):.2%} | {fmt(_p(cell['ttft'], 0.5), 0)} | "
            f"{fmt(_p(cell['ttft'], 0.99), 0)} | {cell['errors']} |"
        )
    quic_p99 = _p(cells[(1.0, "quic")]["gaps"], 0.99)
    twice_p99 = _p(cells[(1.0, "quic2")]["gaps"], 0.99)
    tcp_p99 = _p(cells[(1.0, "tcp")]["gaps"], 0.99)
    hol_ok = twice_p99 <= 0.5 * tcp_p99
    relayed_p50, direct_p50 = statistics.median(relayed), statistics.median(direct)
    ttft_ok = relayed_p50 <= direct_p50 + rtt
    report.goals += [
        (f"20. Relay at 1% loss, {STREAMS} streams: inter-token gap p99 at most 0.5x a WebSocket "
         "relay over one TCP connection (with --relay-copies 2)", "", hol_ok),
        ("20. A new session's TTFT through the relay: at most one RTT above the far gateway's",
         "", ttft_ok),
    ]  # fmt: skip
    wire_rows = [
        f"| {label} | {fmt(carried[name], 0)} | {ratio(carried[name], carried['tcp'])} |"
        for name, label in _LABELS.items()
        if name in carried
    ]
    report.sections.append(
        "\n".join(
            [
                "## 20. The cross-region relay over a lossy link",
                "",
                "Two network namespaces joined by a user-space link (`seedance.testing.wire`: IP "
                f"packets delayed {DELAY_MS} ms each way, {2 * DELAY_MS} ms of round trip, and "
                "lost at the rate shown; the kernel here has no `sch_netem`). The far gateway: "
                f"`seedance serve --http3` with the synthetic engine at {PACE} tokens/s per "
                f"stream. **{STREAMS} requests relayed at once**, {tokens}-token replies, over "
                "Seedance's QUIC link (one connection, a stream per request, each with its relay "
                "token) against a WebSocket relay over one TCP connection with TLS (each "
                "request's lines tagged with its id; `benchmarks/relay_driver.py`). Per token, "
                "its gap after the one before; per request, its time to first token. The relay "
                "as it is by default, and with `--relay-copies 2` (each packet sent twice, both "
                "ways: a token waits a round trip only when both copies are lost). Goal at 1% "
                "loss: the gap's p99 at most 0.5x the TCP relay's: with two copies "
                f"{verdict(hol_ok)} ({ratio(twice_p99, tcp_p99)}); by default "
                f"{ratio(quic_p99, tcp_p99)}.",
                "",
                "| loss | relay | gap p50 ms | p99 | p99.9 | gaps over one RTT more than the "
                "pace | TTFT p50 ms | TTFT p99 ms | errors |",
                "|---|---|---|---|---|---|---|---|---|",
                *rows,
                "",
                "**Bytes on the wire** per 1,000 relayed tokens, from the far region to the edge "
                "(IP packets as the link carried them, at 0% loss). The design document puts "
                "QUIC's saving at 37%:",
                "",
                "| relay | bytes per 1,000 tokens | / WebSocket over TLS |",
                "|---|---|---|",
                *wire_rows,
                "",
                f"**A new session's time to first token** ({SESSIONS} sessions, one token each; "
                "the relay's link already open, as it stays): through the edge "
                f"**{fmt(relayed_p50, 1)} ms** p50, the far gateway asked directly "
                f"**{fmt(direct_p50, 1)} ms**: {fmt(relayed_p50 - direct_p50, 1)} ms more, for a "
                f"link whose round trip is {fmt(rtt, 1)} ms (a UDP echo across it: "
                f"{2 * DELAY_MS} ms of delay and the user-space link's own cost). Goal: at most "
                f"one round trip more: {verdict(ttft_ok)}.",
                "",
                "Commands (in the namespaces `ip netns exec` runs them in):",
                "",
                "```",
                f"seedance serve --engine synthetic --synthetic-tokens-per-s {PACE} --tls-cert "
                "far.pem --tls-key far.key --http3 --node-id far-1 --relay-trust "
                f"edge-1=edge.pub.pem --port {FAR_PORT}",
                "seedance serve --engine relay --node-id edge-1 --relay-peer "
                f"far-1=https://10.70.3.2:{FAR_PORT} --relay-key edge.pem --relay-ca ca.pem "
                f"--relay-model synthetic --port {EDGE_PORT}",
                f"python -m benchmarks.relay_driver quic https://10.70.3.2:{FAR_PORT} ca.pem "
                f"edge.pem {STREAMS} {tokens}",
                f"python -m benchmarks.relay_driver ws wss://10.70.3.2:{MUX_PORT} ca.pem edge.pem "
                f"{STREAMS} {tokens} 0",
                "```",
                "",
            ]
        )
    )


def _write_browser(report: Report, cells: dict[tuple[float, str], Any]) -> None:
    rows = [
        f"| {loss:g}% | {'WebTransport' if transport == 'webtransport' else 'WebSocket'} | "
        f"{fmt(_p(cell['gaps'], 0.5), 1)} | {fmt(_p(cell['gaps'], 0.99), 1)} | "
        f"{fmt(_p(cell['gaps'], 0.999), 1)} | {_late(cell['gaps']):.2%} | "
        f"{fmt(_p(cell['ttft'], 0.5), 0)} | {fmt(_p(cell['ttft'], 0.99), 0)} |"
        for (loss, transport), cell in sorted(cells.items())
    ]
    report.sections[-1] += "\n".join(
        [
            "",
            f"**WebTransport against WebSocket in Chromium** on the same link: a headless "
            "Chromium in the edge's namespace, the page of a far gateway (`seedance serve "
            "--http3`, its own certificate pinned by hash), "
            f"{BROWSER_STREAMS} sessions at once through the browser SDK, {BROWSER_TOKENS}-token "
            f"replies at {PACE} tokens/s, the transport chosen by `connect(..., {{transport}})`; "
            "what the page saw:",
            "",
            "| loss | transport | gap p50 ms | p99 | p99.9 | gaps over one RTT more than the "
            "pace | TTFT p50 ms | TTFT p99 ms |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
