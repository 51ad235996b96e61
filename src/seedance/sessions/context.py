"""Fitting a conversation into the model's context window."""

from __future__ import annotations

from collections.abc import Sequence

from seedance.protocol.errors import ContextOverflow
from seedance.sessions.session import Turn


def fit_context(
    history: Sequence[Turn],
    new: Sequence[Turn],
    *,
    context_length: int,
    reply_overhead: int,
    max_tokens: int,
) -> tuple[list[Turn], int]:
    """Return the turns to send (history trimmed, then ``new``) and their prompt tokens.

    History is trimmed from the oldest turns until the prompt leaves room for ``max_tokens``;
    system turns go last. When the new turns alone leave no room for a single token, the
    request is a :class:`ContextOverflow`.
    """
    new_tokens = reply_overhead + sum(t.tokens for t in new)
    if new_tokens >= context_length:
        raise ContextOverflow(
            f"the prompt takes {new_tokens} tokens and the model's context holds "
            f"{context_length}; shorten it"
        )
    budget = context_length - new_tokens - max_tokens
    total = sum(t.tokens for t in history)
    if total <= budget:
        return [*history, *new], new_tokens + total
    kept = list(history)
    for system_pass in (False, True):
        i = 0
        while total > budget and i < len(kept):
            if (kept[i].message.role == "system") == system_pass:
                total -= kept[i].tokens
                del kept[i]
            else:
                i += 1
    return [*kept, *new], new_tokens + total
