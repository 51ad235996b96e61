"""Reference servers that ``make bench`` runs beside Seedance, on the same synthetic engine.

- :mod:`.raw_websockets`: the token stream written directly on the ``websockets`` library, one
  frame per token, no sessions, no limits: the bar for Seedance's token path.
- :mod:`.openai_sse`: a minimal OpenAI-compatible HTTP + SSE server, so that ``seedance bench
  --openai`` has a target to be tested against (and a fast upstream for gateway benchmarks).
"""
