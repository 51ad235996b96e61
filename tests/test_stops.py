"""The stop matcher against its definition, on any text and any split into tokens, and its
cost on a reply that keeps almost matching a long stop string."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from seedance.engines.stops import StopMatcher

# A small alphabet makes near matches and overlapping stop strings common.
texts = st.text(alphabet="abc\u00e9\n", max_size=40)
stops = st.lists(st.text(alphabet="abc\u00e9\n", min_size=1, max_size=6), max_size=3)


def expected(pieces: list[str], stop_strings: list[str]) -> tuple[str, bool]:
    """What must come out: the text up to the earliest stop string found by the piece that
    completes the first one (a stream cannot know about a later piece)."""
    text = ""
    for piece in pieces:
        text += piece
        found = [i for i in (text.find(s) for s in stop_strings) if i >= 0]
        if found:
            return text[: min(found)], True
    return text, False


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(texts, max_size=12), stop_strings=stops)
def test_output_is_the_text_before_the_first_stop_string(
    pieces: list[str], stop_strings: list[str]
) -> None:
    matcher = StopMatcher(tuple(stop_strings))
    out, tokens, weights = "", 0, []
    for piece in pieces:
        text, count = matcher.push(piece)
        weights.append(count)
        out, tokens = out + text, tokens + count
        if matcher.stopped:
            break
    else:
        text, count = matcher.flush()
        out, tokens = out + text, tokens + count
    want, stopped = expected(pieces, stop_strings)
    assert (out, matcher.stopped) == (want, stopped)
    # Whole tokens only, each counted once; nothing of a stop string ever came out.
    assert tokens <= len(pieces)
    if not stopped:
        assert tokens == len(pieces)
    for stop in stop_strings:
        assert stop not in out


def test_cost_is_linear_in_the_reply_however_long_the_stop_string() -> None:
    def cost(n: int) -> float:
        matcher = StopMatcher(("a" * n + "b",))  # the reply keeps almost matching it
        started = time.process_time()
        for _ in range(n):
            assert matcher.push("a") == ("", 0)
        assert matcher.flush() == ("a" * n, n)
        return time.process_time() - started

    small, large = min(cost(2000) for _ in range(3)), min(cost(16000) for _ in range(3))
    assert large < 8 * small * 3  # 8x the tokens: linear is 8x; quadratic was 64x
