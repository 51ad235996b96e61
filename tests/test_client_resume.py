"""The client SDK over a connection that drops: it reconnects on its own, resumes resumable
streams without a repeat or a gap, and says why when it cannot (``HistoryLost``)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from seedance.client import ConnectionClosed, HistoryLost, Reconnect, connect
from seedance.netutil import free_port
from tests.support.servers import SEEDANCE, RunningServer, ServerProcess

PROMPT = "a long story please"


def drop(session: Any) -> None:
    """The network goes away under the session: no close frame."""
    session._ws.transport.abort()


@pytest.mark.slow
async def test_a_resumable_stream_survives_drops(make_server: Any) -> None:
    server: RunningServer = make_server(tokens_per_s=1000.0)
    async with connect(server.url) as session:
        expected = (await session.complete(PROMPT, max_tokens=600, seed=5, reset=True)).text
        stream = session.generate(PROMPT, max_tokens=600, seed=5, reset=True, resumable=True)
        seqs: list[int] = []
        drops = [300, 50]
        async for chunk in stream:
            seqs.extend(range(chunk.seq, chunk.seq + chunk.n))
            if drops and len(seqs) >= drops[-1]:
                drops.pop()
                drop(session)
        assert stream.done is not None and stream.done.finish_reason == "length"
        assert seqs == list(range(600))  # every token once, in order
        assert stream.text == expected and stream.done.usage.completion_tokens == 600
        assert session.reconnects >= 1
        # the session goes on after the drops
        assert (await session.complete("and now?", max_tokens=3)).finish_reason == "length"


@pytest.mark.slow
async def test_a_stream_that_is_not_resumable_fails_and_the_session_goes_on(
    make_server: Any,
) -> None:
    server: RunningServer = make_server(tokens_per_s=500.0)
    async with connect(server.url, session_id="plain") as session:
        stream = session.generate(PROMPT, max_tokens=500)
        await stream.__anext__()
        drop(session)
        with pytest.raises(ConnectionClosed):
            await stream.collect()
        done = await session.complete("again", max_tokens=3)  # reconnected meanwhile
        assert done.finish_reason == "length" and session.session_id == "plain"


@pytest.mark.slow
async def test_no_reconnect_when_asked_not_to(make_server: Any) -> None:
    server: RunningServer = make_server(tokens_per_s=500.0)
    async with connect(server.url, reconnect=None) as session:
        stream = session.generate(PROMPT, max_tokens=500, resumable=True)
        await stream.__anext__()
        drop(session)
        with pytest.raises(ConnectionClosed):
            await stream.collect()
        assert session.closed and session.reconnects == 0


@pytest.mark.subprocess
async def test_a_server_restart_that_lost_the_log_raises_history_lost() -> None:
    port = str(free_port())
    server = ServerProcess("--port", port, "--synthetic-tokens-per-s", "100")
    try:
        policy = Reconnect(attempts=20, first_delay_s=0.05, max_delay_s=0.5)
        async with connect(f"ws://127.0.0.1:{port}", reconnect=policy) as session:
            stream = session.generate(PROMPT, max_tokens=2000, resumable=True)
            await stream.__anext__()
            server.stop()  # killed: its log in memory is gone
            server = ServerProcess("--port", port, "--synthetic-tokens-per-s", "100")
            with pytest.raises(HistoryLost) as lost:
                await stream.collect()
            assert lost.value.reason == "epoch_changed"
            assert session.reconnects == 1
    finally:
        server.stop()


@pytest.mark.subprocess
def test_chat_says_when_a_restart_lost_the_reply() -> None:
    port = str(free_port())
    server = ServerProcess("--port", port, "--synthetic-tokens-per-s", "100")
    chat = subprocess.Popen(
        [
            SEEDANCE,
            "chat",
            "--url",
            f"ws://127.0.0.1:{port}",
            "--once",
            PROMPT,
            "--max-tokens",
            "2000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert chat.stdout is not None
        chat.stdout.read(20)  # the reply is streaming
        server.stop()
        server = ServerProcess("--port", port, "--synthetic-tokens-per-s", "100")
        _, err = chat.communicate(timeout=60)
        assert chat.returncode == 0, err
        assert "[history_lost epoch_changed]" in err and "Traceback" not in err
    finally:
        chat.kill()
        server.stop()


@pytest.mark.slow
async def test_a_reader_that_resumes_gets_the_reply_once(make_server: Any) -> None:
    # Resumed by the SDK while the server had not yet seen the old socket go: two readers for
    # a moment, one client, and still every token once.
    server: RunningServer = make_server(tokens_per_s=2000.0)
    async with connect(server.url) as session:
        stream = session.generate(PROMPT, max_tokens=1000, resumable=True)
        count, dropped = 0, False
        async for chunk in stream:
            count += chunk.n
            if count >= 100 and not dropped:
                dropped = True
                drop(session)
        assert count == 1000 == stream.done.usage.completion_tokens  # type: ignore[union-attr]
        assert session.reconnects == 1
