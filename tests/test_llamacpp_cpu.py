"""The ``llamacpp`` engine on whatever CPU it lands on: ``--repack`` forced each way, the probe's
decision (and what it does when a layout kills its child), and a crash inside llama.cpp that
leaves its cause in the log instead of a silent exit."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from seedance.client import connect
from seedance.config import ConfigError
from seedance.engines.llamacpp.cpu import (
    ProbeRun,
    choose,
    probe_child,
    resolve_repack,
    run_probe,
)
from seedance.engines.llamacpp.engine import LlamaCppEngine
from seedance.engines.local import default_model_path
from seedance.protocol.errors import SeedanceError
from tests.support.servers import RunningServer, ServerProcess, one_process_only, server_config

pytestmark = pytest.mark.model

MODEL = default_model_path()
REPO = Path(__file__).resolve().parent.parent


def dies_of(sig: signal.Signals) -> list[str]:
    return [sys.executable, "-c", f"import os; os.kill(os.getpid(), {int(sig)})"]


def repacking_runs_here() -> bool:
    """Whether llama.cpp's repacked layout survives on this CPU (the probe's cached answer)."""
    probed = resolve_repack("auto", MODEL, 2)
    return probed.on is not None and probed.on.ok


@pytest.mark.parametrize("mode", ["on", "off"])
@one_process_only(
    "the model runs in the engine process there (the tests of --engine-process cover it)"
)
async def test_each_forced_layout_serves_the_model(mode: str) -> None:
    config = server_config(engine="llamacpp", parallel=2, n_ctx=2048, repack=mode)
    if mode == "on" and not repacking_runs_here():  # AMX on a VM that does not enable it
        with pytest.raises(ConfigError, match=r"--repack on: llama\.cpp's repacked weights fail"):
            RunningServer(config, None)
        return
    server = RunningServer(config, None).start()
    try:
        engine = server.engine
        assert isinstance(engine, LlamaCppEngine)
        assert engine.model.repack is (mode == "on")
        assert engine.repack.how == "flag"
        async with connect(server.url) as session:
            stream = session.generate("What is 2+2?", temperature=0, max_tokens=24)
            done = await stream.collect()
        assert done.usage.completion_tokens > 0 and stream.text.strip()
    finally:
        server.stop()


def test_the_probe_measures_both_layouts_once_and_caches_the_choice(tmp_path: Path) -> None:
    first = resolve_repack("auto", MODEL, 2, cache=tmp_path)
    assert first.how == "probed"
    assert first.on is not None and first.off is not None and first.off.ok
    if not first.on.ok:  # this CPU cannot run the repacked layout: never chosen
        assert first.on.failure and first.repack is False
    assert first.repack is choose(first.on, first.off)
    assert first.describe().startswith(f"weight repacking {'on' if first.repack else 'off'}")
    assert "on: " in first.describe() and " ms" in first.describe()

    def no_probe(model: Path, threads: int, repack: bool) -> ProbeRun:
        raise AssertionError("a cached decision runs no probe")

    again = resolve_repack("auto", MODEL, 2, cache=tmp_path, prober=no_probe)
    assert again.how == "cached"
    assert (again.repack, again.on, again.off) == (first.repack, first.on, first.off)


def test_a_layout_whose_child_dies_is_never_chosen(tmp_path: Path) -> None:
    def sigill_when_repacked(model: Path, threads: int, repack: bool) -> ProbeRun:
        if repack:  # what AMX does on a VM that reports it without enabling its state
            return run_probe(dies_of(signal.SIGILL), repack)
        return probe_child(model, threads, repack)

    decision = resolve_repack("auto", MODEL, 2, cache=tmp_path, prober=sigill_when_repacked)
    assert decision.repack is False and decision.how == "probed"
    assert decision.on is not None and "SIGILL" in decision.on.failure
    assert "SIGILL" in decision.describe()
    cached = json.loads((tmp_path / "llamacpp-repack.json").read_text())
    assert [entry["repack"] for entry in cached.values()] == [False]
    # --repack on, forced, reads that finding and refuses by name rather than die later
    with pytest.raises(ConfigError, match=r"--repack on: .* \(killed by SIGILL"):
        resolve_repack("on", MODEL, 2, cache=tmp_path, prober=sigill_when_repacked)


def test_the_choice_wants_a_clear_gain_and_a_runnable_plain_layout() -> None:
    assert choose(ProbeRun(True, 0.90), ProbeRun(False, 1.0)) is True
    assert choose(ProbeRun(True, 0.97), ProbeRun(False, 1.0)) is False  # within the noise
    assert choose(ProbeRun(True, failure="killed by SIGILL"), ProbeRun(False, 1.0)) is False
    with pytest.raises(ConfigError, match="cannot run this model on this CPU"):
        choose(ProbeRun(True, 1.0), ProbeRun(False, failure="killed by SIGILL"))


def test_a_probe_that_cannot_run_at_all_refuses_to_start(tmp_path: Path) -> None:
    def always_sigill(model: Path, threads: int, repack: bool) -> ProbeRun:
        return run_probe(dies_of(signal.SIGILL), repack)

    with pytest.raises(ConfigError, match=r"cannot run this model on this CPU \(killed by SIGILL"):
        resolve_repack("auto", MODEL, 2, cache=tmp_path, prober=always_sigill)
    assert not (tmp_path / "llamacpp-repack.json").exists()  # nothing cached: try next time


_SLOW_PROBE = """
import sys, time
from pathlib import Path
from seedance.engines.llamacpp.cpu import ProbeRun, resolve_repack
from seedance.engines.local import default_model_path

def slow(model, threads, repack):
    time.sleep(0.5)  # long enough for every server to arrive while it runs
    return ProbeRun(repack, 1.0)

print(resolve_repack("auto", default_model_path(), 1, cache=Path(sys.argv[1]), prober=slow).how)
"""


def test_servers_started_together_probe_once(tmp_path: Path) -> None:
    # A cluster's nodes start at once: one probes, the others wait for its decision instead
    # of timing each other's work.
    starts = [
        subprocess.Popen(
            [sys.executable, "-c", _SLOW_PROBE, str(tmp_path)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    hows = sorted(proc.communicate(timeout=60)[0].strip() for proc in starts)
    assert hows == ["cached", "cached", "probed"]
    assert [proc.returncode for proc in starts] == [0, 0, 0]


# --------------------------------------------------------------------------- crashes


def crashing_server(tmp_path: Path, how: str, *args: str) -> ServerProcess:
    """``seedance serve`` with the crash plugin (``tests/support/crash_plugin.py``) installed."""
    info = tmp_path / "crash_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: crash-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[seedance.engines]\ncrashing = tests.support.crash_plugin:ENGINE\n"
    )
    env = {
        "SEEDANCE_ENGINE": "crashing",
        "SEEDANCE_TEST_CRASH": how,
        "PYTHONPATH": f"{tmp_path}:{REPO}",
    }
    return ServerProcess("--repack", "off", "--parallel", "2", *args, env=env)


def healthz(port: int) -> tuple[int, dict[str, str]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@one_process_only(
    "the model runs in the engine process there (the tests of --engine-process cover it)"
)
async def test_an_abort_inside_llama_cpp_is_reported_before_the_process_goes(
    tmp_path: Path,
) -> None:
    server = crashing_server(tmp_path, "abort")
    async with connect(server.url) as session:
        with pytest.raises(SeedanceError) as failed:
            await session.generate("hello", max_tokens=8).collect()
        assert failed.value.code == "engine_error"
        assert "llama.cpp aborted" in str(failed.value)
        status, body = healthz(server.port)  # within the second the process lingers
    assert status == 503 and "llama.cpp aborted" in body["detail"], body
    assert server.wait() == -signal.SIGABRT
    log = server.output
    assert "llama.cpp aborted: crash_plugin.py:1: a deliberate abort (test)" in log
    assert "the llamacpp engine was at step 1: a batch of" in log
    assert "Fatal Python error: Aborted" in log
    assert "in _step" in log  # the decode thread's stack


@one_process_only(
    "the model runs in the engine process there (the tests of --engine-process cover it)"
)
async def test_a_fatal_signal_in_the_engine_leaves_the_threads_stacks_in_the_log(
    tmp_path: Path,
) -> None:
    server = crashing_server(tmp_path, "segv")
    thread = next(line for line in server.lines if "decode thread" in line)
    ident = thread.split("Thread ")[1].split()[0]
    with contextlib.suppress(Exception):  # the connection drops with the process
        async with connect(server.url) as session:
            await session.generate("hello", max_tokens=8).collect()
    assert server.wait() == -signal.SIGSEGV
    log = server.output
    assert "Fatal Python error: Segmentation fault" in log
    # The stack of the thread that the startup log named: the decode step, in native code.
    stack = log.split(f"hread {ident} (most recent call first):")[1].split("\n\n")[0]
    assert "in crash" in stack and "in _step" in stack, log


async def test_an_abort_in_the_engine_process_ends_one_request_not_the_server(
    tmp_path: Path,
) -> None:
    """With ``--engine-process`` the same abort kills the engine process alone: the request
    goes on in a new one, meets the abort again and ends retryable; the server serves on."""
    server = crashing_server(tmp_path, "abort", "--engine-process")
    try:
        async with connect(server.url) as session:
            with pytest.raises(SeedanceError) as failed:
                await session.generate("hello", max_tokens=8).collect()
            assert failed.value.code == "engine_error" and failed.value.retryable
            assert "was killed by SIGABRT" in str(failed.value)
            assert session.reconnects == 0  # the connection stayed open
        assert server.proc.poll() is None
    finally:
        server.stop()
    log = server.output
    assert log.count("llama.cpp aborted: crash_plugin.py:1: a deliberate abort (test)") == 2
    assert "was killed by SIGABRT" in log and "the engine process is back" in log
