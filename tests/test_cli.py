"""The ``seedance`` command line, run as a user runs it."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from seedance.client import connect_sync
from tests.support.servers import SEEDANCE, RunningServer, one_process_only, slow_engine


def run(
    *args: str, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SEEDANCE, *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.subprocess
def test_chat_once_streams_the_reply(server: RunningServer) -> None:
    result = run(
        "chat",
        "--url",
        server.url,
        "--once",
        "hello there",
        "--max-tokens",
        "12",
        "--session",
        "cli-once",
    )
    assert result.returncode == 0, result.stderr
    with connect_sync(server.url) as session:
        expected = session.complete("hello there", max_tokens=12).text
    assert result.stdout == expected + "\n"


@pytest.mark.subprocess
def test_chat_keeps_context_between_turns(server: RunningServer) -> None:
    result = run(
        "chat",
        "--url",
        server.url,
        "--session",
        "cli-conv",
        "--verbose",
        "--max-tokens",
        "5",
        stdin="first question\nsecond question\n",
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2
    usage = [line for line in result.stderr.splitlines() if "prompt_tokens=" in line]
    assert len(usage) == 2
    prompt_tokens = [int(line.split("prompt_tokens=")[1].split()[0]) for line in usage]
    assert prompt_tokens[1] > prompt_tokens[0]
    assert "ttft=" in usage[0] and "[length]" in usage[0]
    assert "session cli-conv (created)" in result.stderr
    again = run("chat", "--url", server.url, "--session", "cli-conv", stdin="")
    assert "re-attached, 4 turns of context" in again.stderr


class Interactive:
    """``seedance chat`` with a pipe for stdin and stdout read as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [SEEDANCE, "chat", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.out = ""
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while chunk := self.proc.stdout.read(1):
            self.out += chunk

    def say(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, predicate, timeout: float = 20) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not predicate(self.out):
            assert time.monotonic() < deadline, self.out
            time.sleep(0.02)


@pytest.mark.subprocess
@one_process_only("reads the server's requests in its process")
def test_ctrl_c_cancels_the_reply_not_the_program(make_server) -> None:  # type: ignore[no-untyped-def]
    server = make_server(engines=[slow_engine(40)])
    chat = Interactive("--url", server.url, "--max-tokens", "60")
    try:
        chat.say("tell me a long story")
        chat.wait_for(lambda out: len(out.split()) >= 3)
        chat.proc.send_signal(signal.SIGINT)
        chat.wait_for(lambda out: "[cancelled]" in out)
        assert chat.proc.poll() is None  # still running
        chat.say("and a short one")
        chat.wait_for(lambda out: out.count("\n") >= 2, timeout=40)
        assert chat.proc.stdin is not None
        chat.proc.stdin.close()
        assert chat.proc.wait(20) == 0
    finally:
        if chat.proc.poll() is None:
            chat.proc.kill()
    assert server.engine.stats.requests_aborted == 1
    assert server.engine.stats.requests_finished == 1


@pytest.mark.subprocess
def test_chat_reports_errors_clearly(server: RunningServer) -> None:
    result = run("chat", "--url", server.url, "--model", "nope", "--once", "hi")
    assert result.returncode == 1
    assert "model_not_found" in result.stderr and "Traceback" not in result.stderr
    result = run("chat", "--url", "ws://127.0.0.1:9", "--once", "hi")
    assert result.returncode == 1
    assert "cannot connect" in result.stderr and "Traceback" not in result.stderr
    result = run("chat", "--url", "http://127.0.0.1:9", "--once", "hi")
    assert result.returncode == 1 and "ws://" in result.stderr


@pytest.mark.subprocess
def test_serve_rejects_bad_settings_clearly(tmp_path: Path) -> None:
    result = run("serve", "--port", "99999")
    assert result.returncode == 2
    assert "--port: must be between 0 and 65535" in result.stderr
    result = run("serve", "--engine", "nope")
    assert result.returncode == 2 and "unknown engine 'nope'" in result.stderr
    config = tmp_path / "bad.toml"
    config.write_text("prot = 1\n")
    result = run("serve", "--config", str(config))
    assert result.returncode == 2 and "unknown setting 'prot'" in result.stderr
    result = subprocess.run(
        [SEEDANCE, "serve"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "SEEDANCE_IDLE_TIMEOUT": "soon"},
    )
    assert result.returncode == 2 and "SEEDANCE_IDLE_TIMEOUT: invalid value" in result.stderr
    assert all("Traceback" not in r for r in (result.stderr,))


@pytest.mark.subprocess
def test_engines_lists_the_builtin_engine() -> None:
    result = run("engines")
    assert result.returncode == 0
    assert "synthetic\tseedance.engines.synthetic:ENGINE" in result.stdout
