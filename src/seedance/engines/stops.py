"""Stop strings over a token stream: stop before the first match, never emit any of it.

A stop string may be split across tokens, so text that could be the start of one is held back
until the next token settles it. Tokens are never split between two emissions, so every piece
of emitted text covers a whole number of tokens (at least one). A pushed piece may stand for
several tokens (an engine that held back a partial UTF-8 character pushes them together).

The text is read once, a character at a time, by an Aho-Corasick automaton of the stop
strings: its state is the longest end of the text that begins a stop string (the part to hold
back), and it knows when one ends. Each token costs the length of its text, however long the
stop strings or the held text (a reply that keeps almost matching a long stop string used to
cost time quadratic in its length).
"""

from __future__ import annotations

from collections import deque


class _Automaton:
    """Aho-Corasick over the stop strings. A state is a prefix of a stop string: its
    ``depth`` is the prefix's length, ``longest[s]`` the length of the longest stop string that
    ends it (0: none)."""

    __slots__ = ("depth", "fail", "goto", "longest")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        longest = [0]
        for stop in stops:
            state = 0
            for char in stop:
                nxt = self.goto[state].get(char)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[state][char] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    longest.append(0)
                state = nxt
            longest[state] = len(stop)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's fallback is settled before its children's
            state = queue.popleft()
            longest[state] = max(longest[state], longest[self.fail[state]])
            for char, child in self.goto[state].items():
                self.fail[child] = self.step(self.fail[state], char)
                queue.append(child)
        self.longest = longest

    def step(self, state: int, char: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(char)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]


class StopMatcher:
    """Feed token texts with :meth:`push`; emit what it returns; :meth:`flush` at the end."""

    __slots__ = ("_automaton", "_held", "_held_chars", "_state", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        stops = tuple(s for s in stops if s)
        self._automaton = _Automaton(stops) if stops else None
        self._state = 0
        self._held: deque[tuple[str, int]] = deque()  # (text, tokens) of each held piece
        self._held_chars = 0
        self.stopped = False

    def push(self, piece: str, tokens: int = 1) -> tuple[str, int]:
        """Add the text of ``tokens`` tokens; return ``(text, tokens)`` now safe to emit.

        After a stop string is found, :attr:`stopped` is true and the returned text is what came
        before it; nothing more should be pushed.
        """
        automaton = self._automaton
        if automaton is None:
            return piece, tokens
        state, longest = self._state, automaton.longest
        before = self._held_chars  # where the piece starts in the held text
        cut = -1  # where the earliest stop string found in this piece starts
        for i, char in enumerate(piece):
            state = automaton.step(state, char)
            if longest[state]:
                start = before + i + 1 - longest[state]
                cut = start if cut < 0 else min(cut, start)
        self._state = state
        self._held.append((piece, tokens))
        self._held_chars += len(piece)
        if cut >= 0:
            return self._stop(cut)
        # Hold the fewest whole pieces at the end that cover the possible start of a stop string.
        keep = automaton.depth[state]
        held = self._held
        texts, count = [], 0
        while held and self._held_chars - len(held[0][0]) >= keep:
            text, weight = held.popleft()
            self._held_chars -= len(text)
            texts.append(text)
            count += weight
        return "".join(texts), count

    def _stop(self, cut: int) -> tuple[str, int]:
        """A stop string starts ``cut`` characters into the held text: what comes before it."""
        self.stopped = True
        texts, count, start = [], 0, 0
        for text, weight in self._held:
            if start >= cut:
                break
            texts.append(text)
            count += weight
            start += len(text)
        self._held.clear()
        self._held_chars = 0
        return "".join(texts)[:cut], count

    def flush(self) -> tuple[str, int]:
        """Release everything held (end of generation)."""
        text = "".join(t for t, _ in self._held)
        count = sum(w for _, w in self._held)
        self._held.clear()
        self._held_chars = 0
        return text, count
