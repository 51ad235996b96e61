"""``seedance bench`` as a user runs it: a subprocess against real servers, over real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks import compare
from benchmarks.peers.openai_sse import create_app as openai_app

from seedance.bench.metrics import Distribution, Sample, percentile, summarize
from seedance.engines.synthetic import SyntheticEngine
from tests.support.netns import need_namespaces
from tests.support.servers import SEEDANCE, RunningServer, asgi_server, slow_engine
from tests.support.tools import tool

pytestmark = pytest.mark.bench


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SEEDANCE, "bench", *args], capture_output=True, text=True, timeout=timeout
    )


def bench_json(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    out = tmp_path / "result.json"
    result = bench(*args, "--json", str(out))
    assert out.exists(), result.stdout + result.stderr
    return result, json.loads(out.read_text())


def test_closed_loop_against_seedance(make_server, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(tokens_per_s=2000)])
    result, data = bench_json(
        tmp_path, server.infer_url, "-c", "4", "-n", "20", "--max-tokens", "8", "-q"
    )
    assert result.returncode == 0, result.stderr
    for name in ("TTFT", "ITL", "TPOT", "E2EL", "req/s", "output tokens/s"):
        assert name in result.stdout
    summary = data["summary"]
    assert summary["requests"] == summary["completed"] == 20 and summary["errors"] == {}
    assert summary["output_tokens"] == 20 * 8
    assert data["client"]["connections_opened"] == 4  # one per user, reused
    samples = data["samples"]
    assert len(samples) == 24 and sum(s["warmup"] for s in samples) == 4
    for sample in samples:
        # Every token's arrival time is there, in order, and the first is the TTFT.
        assert len(sample["token_ms"]) == sample["tokens"] == 8
        assert sample["token_ms"] == sorted(sample["token_ms"])
        assert sample["token_ms"][0] == pytest.approx(sample["ttft_ms"], abs=0.01)
        assert sample["finish_reason"] == "length"
    # The server saw exactly the requests the tool reports.
    assert server.engine.stats.requests_finished == 24


def test_new_connection_and_open_loop(server: RunningServer, tmp_path: Path) -> None:
    result, data = bench_json(
        tmp_path, server.infer_url, "-c", "3", "-n", "9", "--new-connection", "--max-tokens", "4"
    )
    assert result.returncode == 0, result.stderr
    assert data["client"]["connections_opened"] == 12  # warm-up included
    assert data["summary"]["completed"] == 9

    result, data = bench_json(
        tmp_path,
        server.infer_url,
        "--rate",
        "200",
        "--burstiness",
        "0.5",
        "-n",
        "30",
        "--warmup",
        "0",
        "--max-tokens",
        "4",
    )
    assert result.returncode == 0, result.stderr
    assert "open loop, 200 req/s (burstiness 0.5)" in result.stdout
    assert data["summary"]["completed"] == 30
    sent = sorted(s["sent"] for s in data["samples"])
    assert 0.03 < sent[-1] - sent[0] < 2.0  # arrivals spread at about 200/s, not all at once


def test_duration_and_progress(server: RunningServer) -> None:
    result = bench(server.infer_url, "-c", "2", "-d", "1", "--max-tokens", "4")
    assert result.returncode == 0, result.stderr
    assert "requests " in result.stderr and "req/s" in result.stderr  # progress line
    assert "ok of" in result.stdout


def test_errors_are_counted_by_code(server: RunningServer, tmp_path: Path) -> None:
    result, data = bench_json(
        tmp_path, server.infer_url, "-c", "2", "-n", "4", "--max-tokens", "999999"
    )
    assert result.returncode == 1
    assert data["summary"]["errors"] == {"invalid_request": 4}
    assert "errors: invalid_request 4" in result.stdout


def test_unreachable_and_bad_arguments() -> None:
    result = bench("ws://127.0.0.1:1/v2/infer", "-c", "1", "-n", "1")
    assert result.returncode == 2 and "cannot connect" in result.stderr
    result = bench("ws://127.0.0.1:1/v2/infer", "-n", "1")
    assert result.returncode == 2 and "--concurrency" in result.stderr
    result = bench("http://127.0.0.1:1/v1", "-c", "1", "-n", "1")
    assert result.returncode == 2 and "--openai" in result.stderr
    result = bench("-c", "1", "-n", "1")
    assert result.returncode == 2 and "give a WebSocket URL or --openai" in result.stderr


def test_idle_connections_with_heartbeats(server: RunningServer, tmp_path: Path) -> None:
    out = tmp_path / "idle.json"
    result = bench(
        server.infer_url,
        "--idle-connections",
        "50",
        "-d",
        "1",
        "--ping-interval",
        "0.2",
        "--json",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert "held 50 connections" in result.stdout
    data = json.loads(out.read_text())
    assert data["failures"] == 0 and data["heartbeat"]["count"] >= 100
    assert all(r < 1000 for r in data["rtt_ms"])


@pytest.mark.parametrize("peer", ["raw_websockets", "raw_picows"])
def test_raw_peers(peer: str, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", f"benchmarks.peers.{peer}", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = json.loads(proc.stdout.readline())["listening"]
        result, data = bench_json(tmp_path, url, "-c", "2", "-n", "6", "--max-tokens", "5")
        assert result.returncode == 0, result.stderr
        assert data["summary"]["output_tokens"] == 30
        assert data["summary"]["chunks"] == 30  # one frame per token
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def openai_server() -> Iterator[str]:
    engine = SyntheticEngine(name="synth-openai", tokens_per_s=5000)
    with asgi_server(openai_app(engine)) as url:
        yield f"{url}/v1"


def test_openai_target(openai_server: str, tmp_path: Path) -> None:
    result, data = bench_json(
        tmp_path, "--openai", openai_server, "-c", "3", "-n", "12", "--max-tokens", "6"
    )
    assert result.returncode == 0, result.stderr
    assert data["target"] == openai_server
    summary = data["summary"]
    assert summary["completed"] == 12 and summary["output_tokens"] == 12 * 6
    assert summary["ttft"]["p50_ms"] > 0 and summary["tpot"]["count"] == 12
    for sample in data["samples"]:
        assert sample["finish_reason"] == "length" and sample["prompt_tokens"] == 32

    # An unknown model is an error by the server's code, not a crash.
    result, data = bench_json(
        tmp_path, "--openai", openai_server, "--model", "nope", "-c", "1", "-n", "2"
    )
    assert result.returncode == 1 and data["summary"]["errors"] == {"model_not_found": 2}


# --------------------------------------------------------------------------- metrics


def test_percentiles_interpolate_like_numpy() -> None:
    values = [float(v) for v in range(1, 11)]
    assert percentile(values, 50) == 5.5
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert math.isnan(percentile([], 50))
    dist = Distribution.of_seconds([0.001, 0.002, 0.003])
    assert (dist.count, dist.mean, dist.p50, dist.max) == (3, pytest.approx(2.0), 2.0, 3.0)


def test_sample_definitions_follow_vllm() -> None:
    sample = Sample(index=0, user=0, warmup=False, sent=1.0)
    sample.add_chunk(1.010, 1)  # first token after 10 ms
    sample.add_chunk(1.020, 3)  # a merged frame of three tokens
    sample.add_chunk(1.040, 1)
    sample.end = 1.041
    sample.finish_reason = "length"
    assert sample.ttft == pytest.approx(0.010)
    assert sample.e2el == pytest.approx(0.041)
    assert sample.tpot == pytest.approx((0.041 - 0.010) / 4)  # (E2EL - TTFT) / (tokens - 1)
    assert sample.itls() == pytest.approx([0.010, 0.020])  # gaps between chunks
    assert sample.token_arrivals() == [1.010, 1.020, 1.020, 1.020, 1.040]
    warm = Sample(index=1, user=0, warmup=True, sent=0.0, end=0.5)
    failed = Sample(index=2, user=0, warmup=False, sent=1.0, error="overloaded")
    summary = summarize([sample, warm, failed])
    assert (summary.requests, summary.completed, summary.errors) == (2, 1, {"overloaded": 1})
    assert summary.output_tokens == 5 and summary.chunks == 3


def quick_suite(tmp_path: Path, suite: int, timeout_s: float) -> tuple[str, str]:
    """``make bench``'s suite ``suite`` in its quickest form (``--quick --rounds 1``): its
    report, and what it printed on the way."""
    out = tmp_path / "benchmarks.md"
    # Its own process group (not session: a new session is a scheduling autogroup of its own
    # on Linux, where llama.cpp's threads crawl beside a busy neighbour): on a timeout the
    # servers and peers it started go with it.
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "benchmarks.suites", "--quick", "--rounds", "1"),
            *("--suites", str(suite), "--out", str(out)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=os.setpgrp,
    )
    try:
        _, progress = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, progress = proc.communicate()
        pytest.fail(f"suite {suite} took over {timeout_s} s; it printed:\n{progress}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # anything it left running
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, progress
    return out.read_text(), progress


@pytest.mark.timeout(210)  # past quick_suite's own bound, which reports what ran
def test_make_bench_suite_writes_its_report(tmp_path: Path) -> None:
    # The shortest real run of one suite: servers started, contenders in turn, report written.
    report, progress = quick_suite(tmp_path, 4, timeout_s=180)
    assert "## 4. The design document's table" in report and "| 500 clients |" in report
    assert "## Machine and versions" in report and "websockets " in report
    assert "[4 design table] 4/4" in progress  # progress counter


def test_compare_serves_another_revision_side_by_side(tmp_path: Path) -> None:
    # This tree against its own HEAD, exported by git and served from there: one tiny load.
    out = tmp_path / "baseline.md"
    table = compare.Table(
        "Tiny",
        "Two streams.",
        [("2 streams", ["-c", "2", "-d", "1", "--max-tokens", "8", "--prompt-tokens", "8"])],
        (),
        compare.FAN_OUT.columns,
        compare.FAN_OUT.throughput,
    )
    compare.compare("HEAD", 1, [table], out, False, "python -m benchmarks.compare HEAD --rounds 1")
    report = out.read_text()
    assert report.startswith("# Side by side: ") and "against " in report
    assert "Generated by `python -m benchmarks.compare HEAD --rounds 1`" in report
    assert "machine: " in report
    row = next(line for line in report.splitlines() if line.startswith("| 2 streams |"))
    cells = row.strip("|").split("|")
    assert len(cells) == 1 + len(compare.FAN_OUT.columns) + 1  # load, figures, verdict
    assert all(" / " in cell and "x)" in cell for cell in cells[1:-1])  # both ran
    with pytest.raises(subprocess.CalledProcessError):
        compare.export_source("no-such-revision", tmp_path)


def test_compare_counts_a_servers_instructions_under_cachegrind() -> None:
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed (Debian package valgrind; .ci/run installs it)")
    src = compare.THIS_SRC
    events, tokens = compare._cachegrind_run(src, concurrency=2, requests=3)
    assert tokens == 3 * 128
    assert events["Ir"] > 100_000_000  # Python's start alone runs more than that
    assert {"D1mr", "D1mw", "DLmr", "DLmw"} <= set(events)


def test_bar_chart_is_valid_svg() -> None:
    import xml.etree.ElementTree as ET

    from benchmarks.svg import bar_chart

    svg = bar_chart("t <&>", ["a", "b"], [("x", [1.0, 2000.0]), ("y", [30.0, 0.0])], unit="tok/s")
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    assert len([e for e in root.iter() if e.tag.endswith("rect")]) == 1 + 4 + 2  # bg, bars, legend


class _RecordingEngine(SyntheticEngine):
    """Remembers the sampling parameters of every request."""

    def __init__(self) -> None:
        super().__init__(name="recording")
        self.temperatures: list[float] = []

    def generate(self, request):  # type: ignore[no-untyped-def]
        self.temperatures.append(request.params.temperature)
        return super().generate(request)


def test_temperature_reaches_the_server(make_server) -> None:  # type: ignore[no-untyped-def]
    engine = _RecordingEngine()
    server = make_server(engines=[engine])
    args = ("-c", "1", "-n", "2", "--warmup", "0", "--max-tokens", "2", "-q")
    assert bench(server.infer_url, *args, "--temperature", "0").returncode == 0
    assert bench(server.infer_url, *args).returncode == 0
    assert engine.temperatures == [0.0, 0.0, 0.7, 0.7]  # then the protocol's default


def test_bare_llama_loop_reports_its_rates() -> None:
    def run(*args: str) -> dict[str, float]:
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.peers.llama_bare", *args, "--threads", "2"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
        return result

    single = run("generate", "--tokens", "8")
    assert single["decode_tokens_per_s"] > 0 and single["prompt_tokens"] > 10
    batched = run("batch", "--sequences", "2", "--steps", "3")
    assert batched["sequences"] == 2 and batched["tokens_per_s"] > 0


# --------------------------------------------------------------------------- unkind targets


class ClosingSSEServer:
    """An OpenAI-compatible streaming endpoint that closes each connection after its reply,
    without saying so (no ``Connection: close``), as llama.cpp's ``llama-server`` does: a
    client that reuses the connection finds it gone."""

    def __init__(self) -> None:
        self.requests = 0
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        self.requests += 1
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
        last = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
        body = b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in (chunk, chunk, last))
        body += b"data: [DONE]\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        await asyncio.sleep(0.05)  # the client has the reply and pools the connection
        writer.close()


def test_a_server_that_closes_kept_alive_connections_loses_no_request(tmp_path: Path) -> None:
    closing = ClosingSSEServer()
    ready: queue.Queue[int] = queue.Queue()

    async def serve() -> None:
        server = await asyncio.start_server(closing.handle, "127.0.0.1", 0)
        ready.put(server.sockets[0].getsockname()[1])
        async with server:
            await asyncio.sleep(60)

    threading.Thread(target=asyncio.run, args=(serve(),), daemon=True).start()
    base = f"http://127.0.0.1:{ready.get(timeout=10)}/v1"
    result, data = bench_json(
        tmp_path, "--openai", base, "--model", "m", "-c", "2", "-n", "20", "--warmup", "0"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert data["summary"]["completed"] == 20 and data["summary"]["errors"] == {}
    assert closing.requests == 20 and closing.connections == 20  # each on a live connection


def test_http_failures_carry_their_cause(tmp_path: Path) -> None:
    result, data = bench_json(
        tmp_path,
        *("--openai", "http://127.0.0.1:1/v1", "--model", "m", "-c", "1", "-d", "2"),
        *("--give-up-after", "0.5", "--warmup", "0"),
    )
    assert result.returncode == 1
    assert set(data["summary"]["errors"]) == {"http_failed: ClientConnectorError"}


@pytest.mark.parametrize("reuse", [True, False])
def test_a_target_that_goes_away_ends_the_run_with_a_clear_message(
    server_process: Any, tmp_path: Path, reuse: bool
) -> None:
    target = server_process("--synthetic-tokens-per-s", "200")
    out = tmp_path / "gone.json"
    args = [f"{target.url}/v2/infer", "-c", "4", "-d", "60", "--max-tokens", "16"]
    args += ["--give-up-after", "2", "--json", str(out), "-q"]
    bench_proc = subprocess.Popen(
        [SEEDANCE, "bench", *args, *([] if reuse else ["--new-connection"])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.5)
    target.stop()  # killed: every connection drops, nothing listens any more
    started = time.monotonic()
    stdout, stderr = bench_proc.communicate(timeout=30)
    assert bench_proc.returncode == 1, stdout + stderr
    assert time.monotonic() - started < 10  # 2 s of failures, then the end, not 60 s
    assert "stopped answering" in stderr and "the run ends early" in stderr
    data = json.loads(out.read_text())
    assert data["client"]["stopped"] == stderr.strip().removeprefix("seedance bench: ")
    # Backing off: a few dozen failures in 2 s, not millions.
    assert sum(data["summary"]["errors"].values()) < 200, data["summary"]["errors"]


def test_soak_drives_mixed_traffic_and_judges_it(tmp_path: Path) -> None:
    from benchmarks import soak

    out = tmp_path / "soak.md"
    code = soak.main(
        ["--duration", "11", "--engines", "synthetic", "--streams", "6", "--out", str(out)]
    )
    report = out.read_text()
    assert code == 0, report
    assert "## synthetic: **pass**" in report and "| no secret in the log | pass |" in report
    for action in ("stream", "cancel", "reconnect", "bad frames", "http stream", "vanish"):
        assert f"{action} " in report
    assert (tmp_path / "bench" / "soak-synthetic-memory.svg").read_text().startswith("<svg")


def test_the_resume_suite_clients_drop_and_resume_whole(make_server: Any) -> None:
    server: RunningServer = make_server(tokens_per_s=1000.0)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.resume_suite", f"{server.url}/v2/infer", "6", "3"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    results = json.loads(out.stdout)
    assert len(results) == 6 and all(r["whole"] for r in results)
    assert all(r["resume_ms"] > 0 and r["ttft_ms"] > 0 for r in results)


@pytest.mark.timeout(150)  # past quick_suite's own bound, which reports what ran
def test_the_qos_suite_puts_the_design_table_beside_its_own(tmp_path: Path) -> None:
    # Suite 11 in its quickest form: one 24 s period, A and B at once against faulty twins.
    report, _ = quick_suite(tmp_path, 11, timeout_s=120)
    assert "## 11. Client-side QoS: the design document's A/B table" in report
    assert "| 11. Client QoS: retries add at most 10% to B's calls | **met** |" in report
    cells = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in report.splitlines()
        if line.startswith(("| A: ", "| B: "))
    ]
    rows = {row[0]: row for row in cells}
    assert rows["A: baseline (no breaker), design"][2:3] == ["312"]
    a, b = rows["A: baseline (no breaker), measured"], rows["B: SLA + breaker, measured"]
    assert a[1] == b[1] == "720"  # the same schedule: 30 requests/s for 24 s
    assert float(a[6]) > 1 and float(a[7]) == 0  # A: the faults are its errors, no fallback
    assert float(b[6]) < float(a[6]) and float(b[7]) > 0  # B: fewer errors, some fallbacks
    assert float(b[9]) <= 1.1
    assert "| secondary |" in report and "| degraded |" in report


@pytest.mark.timeout(210)  # past quick_suite's own bound, which reports what ran
def test_the_browser_suite_times_each_appended_window(tmp_path: Path) -> None:
    # Suite 12 in its quick form: headless Chromium, 4 replies of 1,024 tokens per window size.
    tool("chromium", "chromium")
    report, _ = quick_suite(tmp_path, 12, timeout_s=180)
    assert "## 12. Rendering in the browser" in report and "Headless Chromium 1" in report
    for window, rtt, target in ((128, 80, 16), (64, 160, 22), (32, 200, 12)):
        row = next(line for line in report.splitlines() if line.startswith(f"| {window} tokens"))
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] == f"{window} tokens ({rtt} ms)" and int(cells[1]) >= 4
        assert cells[3] == f"< {target} ms"
        assert f"main thread per appended window of {window} tokens" in report


@pytest.mark.parametrize("way", ["v2", "realtime", "responses", "responses-new"])
def test_the_openai_suite_times_each_way_to_ask(server: RunningServer, way: str) -> None:
    # Suite 13's client, one way at a time, against a synthetic server.
    out = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.openai_suite", server.http_url),
            *("synthetic", way, "5", "--max-tokens", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    times = json.loads(out.stdout)
    assert len(times) == 5 and all(0 < t < 5000 for t in times)


@pytest.mark.model
@pytest.mark.timeout(330)  # past quick_suite's own bound, which reports what ran
def test_the_reload_suite_reloads_five_times_under_load(tmp_path: Path) -> None:
    # Suite 14 in its quick form: the embedded model reloaded five times while 4 sessions ask.
    report, _ = quick_suite(tmp_path, 14, timeout_s=300)
    assert "## 14. Reloading the model under load" in report
    assert (
        "| 14. Reload under load: 5 reloads, 0 errors, the last version serving | **met** |"
        in report
    )
    during = next(line for line in report.splitlines() if line.startswith("| 5 reloads |"))
    assert "1.5.0:" in during and "| 0 |" in during


@pytest.mark.model
@pytest.mark.timeout(390)  # past quick_suite's own bound, which reports what ran
def test_the_confidential_suite_sets_encryption_and_tls_beside_plain(tmp_path: Path) -> None:
    # Suite 15 in its quick form: ws://, ws:// + e2e, wss:// and wss:// + e2e side by side, on
    # the synthetic engine and SmolLM2; every way answered (e2e and TLS agreed), no errors.
    report, progress = quick_suite(tmp_path, 15, timeout_s=360)
    assert "## 15. Confidential streams: end-to-end encryption and TLS" in report
    assert "| 15. End-to-end encryption adds at most 1 ms to TTFT" in report
    assert "| 15. End-to-end encryption keeps at least 0.9x the tokens/s" in report
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in report.splitlines()
        if line.startswith(("| synthetic |", "| SmolLM2-135M |", "| 100 streams, "))
    ]
    assert len(rows) == 2 * 4 + 2 * 4  # TTFT: two engines; tokens/s: merging on and off
    assert all(row[-1] == "0" for row in rows)  # errors
    ways = {row[1] for row in rows}
    assert ways == {"`ws://`", "`ws://` + e2e", "`wss://` (TLS)", "`wss://` + e2e"}
    assert "| 32 tokens | " in report  # each frame's cost
    assert "[15 confidential] 12/12" in progress  # 3 loads x 4 ways, 1 round


@pytest.mark.timeout(210)  # past quick_suite's own bound, which reports what ran
def test_the_embeddings_suite_sets_seedance_beside_llama_server_and_the_floor(
    tmp_path: Path,
) -> None:
    report, _ = quick_suite(tmp_path, 16, timeout_s=180)
    section = report.partition("## 16. Embeddings")[2]
    rows = [line for line in section.splitlines() if line.startswith("| 1 |") or
            line.startswith("| 32 |")]  # fmt: skip
    assert len(rows) == 2, section
    assert all(row.endswith("| 0 / 0 |") for row in rows), rows  # no errors, either server
    assert "llama-server" in section  # beside it, or left out of a quick run


@pytest.mark.model
def test_schema_logprobs_and_tools_loads(smollm: RunningServer, tmp_path: Path) -> None:
    """``--schema``, ``--logprobs`` and ``--tools`` in each API's own fields: /v2/infer's
    ``schema`` and ``logprobs``, the OpenAI API's ``response_format``, ``logprobs`` and
    ``top_logprobs``, ``tools`` and ``tool_choice`` (a reply of calls counts as output)."""
    folder = Path(__file__).parents[1] / "benchmarks"
    schema, tools = str(folder / "risk_schema.json"), str(folder / "weather_tools.json")
    openai = ["--openai", f"{smollm.http_url}/v1"]
    for args, extra in [
        ([smollm.infer_url], ["--schema", schema]),
        ([smollm.infer_url], ["--logprobs", "5"]),
        (openai, ["--schema", schema]),
        (openai, ["--logprobs", "5"]),
        (openai, ["--tools", tools]),
    ]:
        result, data = bench_json(
            tmp_path, *args, "-c", "2", "-n", "3", "--max-tokens", "300", "-q", *extra
        )
        assert result.returncode == 0, result.stderr
        summary = data["summary"]
        assert summary["completed"] == summary["requests"] and summary["errors"] == {}
        assert summary["output_tokens"] > 0
    refused = bench(smollm.infer_url, "-n", "1", "--tools", tools)
    assert refused.returncode != 0 and "--tools is for --openai" in refused.stderr


@pytest.mark.timeout(330)  # past quick_suite's own bound, which reports what ran
def test_the_relay_suite_measures_both_relays_and_both_browser_transports(tmp_path: Path) -> None:
    pytest.importorskip("aioquic", reason="the relay needs aioquic, which needs Python 3.11")
    need_namespaces()
    report, progress = quick_suite(tmp_path, 20, timeout_s=300)
    assert "## 20. The cross-region relay over a lossy link" in report
    for row in (
        "| 1% | QUIC (Seedance) |",
        "| 1% | QUIC, `--relay-copies 2` |",
        "| 1% | WebSocket over TLS, one TCP connection |",
        "| 1% | WebTransport |",
    ):
        assert row in report
    assert "| QUIC (Seedance) | " in report and "A new session's time to first" in report
    assert "[20. relay] Chromium, 1% loss, websocket" in progress


@pytest.mark.timeout(330)  # past quick_suite's own bound, which reports what ran
@pytest.mark.model
def test_the_processes_suite_sets_an_engine_process_and_workers_beside_one_process(
    tmp_path: Path,
) -> None:
    report, progress = quick_suite(tmp_path, 21, timeout_s=300)
    assert "## 21. A node's processes" in report
    assert "| 8 streams | " in report and "The IPC's cost per token: **" in report
    assert "[21b engine process, IPC cost] 2/2: engine process, 64 streams" in progress
    for row in ("| 1,000 streams of 128 tokens |", "| 500 clients,", "| gateway mode, 32 users |"):
        assert row in report
    assert "[21e gateway mode] 2/2: gateway, two workers" in progress


def test_the_sentinel_suite_kills_the_primary_under_load(tmp_path: Path) -> None:
    tool("redis-sentinel", "redis-sentinel")
    report, progress = quick_suite(tmp_path, 23, timeout_s=240)
    assert "## 23. Redis failover (Sentinel)" in report, progress
    assert "| `--redis-wait-replicas 0` |" in report and "| `1` (the default) |" in report
    assert "| tokens lost / repeated | 0 / 0 |" in report, report
    assert "| new requests failed | 0 of " in report, report
    assert "[23 sentinel] failover under load" in progress


@pytest.mark.model
@pytest.mark.timeout(330)
def test_the_prefix_suite_routes_one_trace_three_ways(tmp_path: Path) -> None:
    report, progress = quick_suite(tmp_path, 24, timeout_s=300)
    assert "## 24. Gateway mode: routing by prefix" in report, progress
    for routing in ("prefix", "load", "round-robin"):
        assert f"| {routing} | " in report
        assert f"[24 prefix routing] {routing}, round 1" in progress
    assert "First error" not in report, report


@pytest.mark.timeout(150)
def test_the_lineage_suite_measures_the_log_and_the_decisions(tmp_path: Path) -> None:
    # Suite 25 in its quick form: the audit writer both ways, the decisions every way.
    report, progress = quick_suite(tmp_path, 25, timeout_s=120)
    assert "## 25. Lineage and access policies: what they cost" in report, progress
    for fsync in ("interval", "record"):
        assert f"| `{fsync}` | " in report
    modes = ["the tenants table (Python)"]
    modes += [
        f"cedar-{p}, {way}" for p in ("default", "enterprise") for way in ("each by Cedar", "kept")
    ]
    for mode in modes:
        assert f"| {mode} | " in report
    assert "| 25. An access decision by Cedar (the default policy) under 50 µs at p99 |" in report
