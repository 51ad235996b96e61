"""Engine pieces without a server: stop strings, the synthetic engine, the registry."""

from __future__ import annotations

import asyncio
import random

import pytest

from seedance.config import ConfigError, ServerConfig
from seedance.config_loader import load_config
from seedance.engines.base import GenerationRequest, SamplingParams, TokenDelta
from seedance.engines.registry import available_engines, create_engine
from seedance.engines.stops import StopMatcher
from seedance.engines.synthetic import Faults, SyntheticEngine, SyntheticOptions
from seedance.protocol.errors import EngineError
from seedance.protocol.messages import ChatMessage, RequestId
from tests.support.servers import server_config


def run_matcher(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, int, bool, list[int]]:
    matcher = StopMatcher(stops)
    text, tokens, counts = "", 0, []
    for piece in pieces:
        out, n = matcher.push(piece)
        assert (out == "") == (n == 0) or out == ""
        text += out
        tokens += n
        counts.append(n)
        if matcher.stopped:
            return text, tokens, True, counts
    out, n = matcher.flush()
    return text + out, tokens + n, False, counts


def test_stop_string_split_across_tokens() -> None:
    text, tokens, stopped, _ = run_matcher(["Hel", "lo wo", "rld", "!"], ("o world",))
    assert (text, stopped) == ("Hell", True)
    assert tokens == 2  # "Hel" and the token that holds "lo wo"


def test_no_stop_emits_everything_with_every_token_counted() -> None:
    pieces = ["a", "b", "c", "w", "o", "x"]
    text, tokens, stopped, counts = run_matcher(pieces, ("world",))
    assert (text, tokens, stopped) == ("abcwox", 6, False)
    assert counts[3:5] == [0, 0]  # "w", "wo" held while they could start "world"


def test_stop_at_the_very_start_and_empty_stops() -> None:
    assert run_matcher(["STOP", "x"], ("STOP",))[:3] == ("", 0, True)
    assert run_matcher(["a", "b"], ())[:3] == ("ab", 2, False)


def naive_stop(pieces: list[str], stops: tuple[str, ...]) -> str | None:
    """After each token, look for any stop in all the text so far; cut at the first found."""
    text = ""
    for piece in pieces:
        text += piece
        found = [text.find(s) for s in stops if s in text]
        if found:
            return text[: min(found)]
    return None


def test_stop_matcher_against_a_naive_search() -> None:
    rng = random.Random(5)
    alphabet = "ab c"
    for _ in range(3000):
        pieces = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
            for _ in range(rng.randint(1, 12))
        ]
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        )
        expected = naive_stop(pieces, stops)
        text, tokens, stopped, _ = run_matcher(pieces, stops)
        if expected is None:
            assert (text, tokens, stopped) == ("".join(pieces), len(pieces), False)
        else:
            assert (text, stopped) == (expected, True), (pieces, stops)


def request(content: str, **params: object) -> GenerationRequest:
    messages = (ChatMessage("user", content),)
    return GenerationRequest(RequestId("r"), messages, SamplingParams(**params), prompt_tokens=5)  # type: ignore[arg-type]


async def drain(engine: SyntheticEngine, req: GenerationRequest) -> list[TokenDelta]:
    return [d async for d in engine.generate(req)]


async def test_synthetic_is_deterministic_and_exact() -> None:
    engine = SyntheticEngine()
    a = await drain(engine, request("hello", max_tokens=50, seed=1))
    b = await drain(engine, request("hello", max_tokens=50, seed=1))
    c = await drain(engine, request("hello", max_tokens=50, seed=2))
    text = "".join(d.text for d in a)
    assert text == "".join(d.text for d in b) != "".join(d.text for d in c)
    assert sum(d.tokens for d in a) == 50 and a[-1].finish_reason == "length"
    assert engine.count_tokens(text) == 50  # its tokenizer agrees with its own output
    assert engine.stats.requests_finished == 3 and engine.stats.active == 0


async def test_synthetic_pacing() -> None:
    engine = SyntheticEngine(ttft_ms=100, tokens_per_s=100)
    loop = asyncio.get_running_loop()
    started = loop.time()
    stream = engine.generate(request("x", max_tokens=11))
    await stream.__anext__()
    first = loop.time() - started
    async for _ in stream:
        pass
    total = loop.time() - started
    assert 0.09 <= first < 0.5
    assert 0.19 <= total < 1.0


async def test_synthetic_echo_replies_with_the_message_exactly() -> None:
    engine = SyntheticEngine(echo=True)
    hostile = 'Hi <script>alert("x")</script>\n```js\nlet a = 1;\n``` café'
    deltas = await drain(engine, request(hostile, max_tokens=100))
    assert "".join(d.text for d in deltas) == hostile
    assert deltas[-1].finish_reason == "stop"
    assert sum(d.tokens for d in deltas) == engine.count_tokens(hostile)
    cut = await drain(engine, request(hostile, max_tokens=3))  # max_tokens still holds
    assert sum(d.tokens for d in cut) == 3 and cut[-1].finish_reason == "length"


async def test_synthetic_abort_on_close() -> None:
    engine = SyntheticEngine(tokens_per_s=1000)
    stream = engine.generate(request("x", max_tokens=1000))
    await stream.__anext__()
    await stream.aclose()
    assert engine.stats.requests_aborted == 1 and engine.stats.active == 0
    produced = engine.stats.tokens_generated
    await asyncio.sleep(0.05)
    assert engine.stats.tokens_generated == produced


async def test_synthetic_respects_the_context_window() -> None:
    engine = SyntheticEngine(context_length=20)
    deltas = await drain(
        engine,
        GenerationRequest(
            RequestId("r"),
            (ChatMessage("user", "x"),),
            SamplingParams(max_tokens=100),
            prompt_tokens=15,
        ),
    )
    assert sum(d.tokens for d in deltas) == 5


async def outcomes(engine: SyntheticEngine, n: int, max_tokens: int = 4) -> list[str]:
    """Each request's fate: "ok", or "failed after K tokens" (K = 0: before the first)."""
    fates = []
    for i in range(n):
        received = 0
        try:
            async for delta in engine.generate(request(f"q{i}", max_tokens=max_tokens)):
                received += delta.tokens
        except EngineError:
            fates.append(f"failed after {received}")
        else:
            fates.append("ok")
    return fates


async def test_synthetic_faults_fail_requests_at_their_rate_and_the_same_ones_every_run() -> None:
    faults = Faults(error_rate=0.1, error_midstream=0.5, seed=7)
    first = await outcomes(SyntheticEngine(faults=faults), 400)
    again = await outcomes(SyntheticEngine(faults=faults), 400)
    other = await outcomes(SyntheticEngine(faults=Faults(error_rate=0.1, seed=8)), 400)
    assert first == again != other  # the seed decides which requests fail
    failed = [f for f in first if f != "ok"]
    assert 25 <= len(failed) <= 55  # 10% of 400
    before = failed.count("failed after 0")
    assert 0.3 * len(failed) <= before <= 0.7 * len(failed)  # half of them mid-reply
    midway = {f for f in failed if f != "failed after 0"}
    assert midway == {"failed after 1", "failed after 2", "failed after 3"}  # never at the end
    assert all(f in ("ok", "failed after 0") for f in other)  # none mid-reply by default


async def test_synthetic_faults_spike_the_first_token() -> None:
    engine = SyntheticEngine(ttft_ms=1, faults=Faults(spike_rate=0.5, spike_ms=60, seed=3))
    loop = asyncio.get_running_loop()
    firsts = []
    for i in range(12):
        started = loop.time()
        stream = engine.generate(request(f"q{i}", max_tokens=1))
        await stream.__anext__()
        firsts.append(loop.time() - started)
        await stream.aclose()
    late = [t for t in firsts if t >= 0.06]
    assert len(late) == engine.stats.spikes_injected and 2 <= len(late) <= 10
    assert all(t < 0.05 for t in firsts if t < 0.06)
    assert engine.stats.faults_injected == 0


async def test_synthetic_incidents_come_and_go_with_the_clock() -> None:
    now = [1005.5]  # in the incident that starts at 1005
    faults = Faults(incident_every_s=20, incident_s=2, incident_error_rate=1.0, incident_at=1005)
    engine = SyntheticEngine(faults=faults, clock=lambda: now[0])
    assert await outcomes(engine, 5) == ["failed after 0"] * 5
    now[0] = 1007.0  # over
    assert await outcomes(engine, 5) == ["ok"] * 5
    now[0] = 986.0  # the one before, in step
    assert await outcomes(engine, 1) == ["failed after 0"]
    now[0] = 1026.9  # the next one
    assert await outcomes(engine, 1) == ["failed after 0"]
    assert engine.stats.faults_injected == 7 and engine.stats.requests_aborted == 7
    assert engine.stats.active == 0


def test_synthetic_fault_options_reach_the_engine() -> None:
    assert SyntheticEngine(faults=Faults()).faults is None  # nothing to inject: no dice drawn
    engine = create_engine(
        server_config(engine="synthetic", error_rate=0.05, spike_rate=0.02, spike_ms=200)
    )
    assert isinstance(engine, SyntheticEngine) and engine.faults is not None
    assert (engine.faults.error_rate, engine.faults.spike_ms) == (0.05, 200)
    with pytest.raises(ConfigError, match="--synthetic-error-rate"):
        load_config({"engine": "synthetic", "synthetic_error_rate": "1.5"}, {})
    assert SyntheticOptions().fault_seed == 0


def test_registry_finds_the_builtin_engine() -> None:
    assert "synthetic" in available_engines()
    engine = create_engine(server_config(engine="synthetic", model="named", ttft_ms=5))
    assert isinstance(engine, SyntheticEngine)
    assert engine.info.name == "named" and engine.ttft_s == 0.005
    with pytest.raises(ConfigError, match=r"unknown engine 'nope'; installed engines: .*synthetic"):
        create_engine(ServerConfig(engine="nope"))


def test_stop_matcher_counts_pieces_that_stand_for_several_tokens() -> None:
    matcher = StopMatcher(("END",))
    assert matcher.push("caf", 1) == ("caf", 1)
    assert matcher.push("é E", 3) == ("", 0)  # ends with "E", which may start "END": held
    assert matcher.push("N", 1) == ("", 0)
    assert matcher.push("D!", 2) == ("é ", 3)  # the text before the stop, and its tokens
    assert matcher.stopped
    assert StopMatcher(()).push("日本", 4) == ("日本", 4)
    other = StopMatcher(("END",))
    assert other.push("a E", 2) == ("", 0)
    assert other.flush() == ("a E", 2)
