"""Stop strings over a token stream: stop before the first match, never emit any of it.

A stop string may be split across tokens, so text that could be the start of one is held back
until the next token settles it. Tokens are never split between two emissions, so every piece
of emitted text covers a whole number of tokens (at least one). A pushed piece may stand for
several tokens (an engine that held back a partial UTF-8 character pushes them together).
"""

from __future__ import annotations


class StopMatcher:
    """Feed token texts with :meth:`push`; emit what it returns; :meth:`flush` at the end."""

    __slots__ = ("_held", "_held_text", "_max_keep", "_stops", "_weights", "stopped")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._max_keep = max((len(s) for s in self._stops), default=1) - 1
        self._held: list[str] = []
        self._weights: list[int] = []  # tokens of each held piece
        self._held_text = ""
        self.stopped = False

    def push(self, piece: str, tokens: int = 1) -> tuple[str, int]:
        """Add the text of ``tokens`` tokens; return ``(text, tokens)`` now safe to emit.

        After a stop string is found, :attr:`stopped` is true and the returned text is what came
        before it; nothing more should be pushed.
        """
        if not self._stops:
            return piece, tokens
        self._held.append(piece)
        self._weights.append(tokens)
        self._held_text += piece
        text = self._held_text
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            count, start = 0, 0
            for held, weight in zip(self._held, self._weights, strict=True):
                if start >= cut:
                    break
                count += weight
                start += len(held)
            self._held, self._weights, self._held_text = [], [], ""
            return text[:cut], count
        keep = self._partial_match_length(text)
        if keep == 0:
            return self.flush()
        # Hold the fewest whole tokens at the end that cover the possible partial match.
        held_len, split = 0, len(self._held)
        while held_len < keep:
            split -= 1
            held_len += len(self._held[split])
        if split == 0:
            return "", 0
        emit, count = self._held[:split], sum(self._weights[:split])
        self._held, self._weights = self._held[split:], self._weights[split:]
        self._held_text = "".join(self._held)
        return "".join(emit), count

    def flush(self) -> tuple[str, int]:
        """Release everything held (end of generation)."""
        text, count = self._held_text, sum(self._weights)
        self._held, self._weights, self._held_text = [], [], ""
        return text, count

    def _partial_match_length(self, text: str) -> int:
        for k in range(min(self._max_keep, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
