"""The engine core: an engine in a process of its own (``seedance serve --engine-process``).

The server's process keeps every connection, session and stream log; the engine process runs
the model and nothing else, so that a crash of its native code (llama.cpp's abort, a SIGSEGV,
an out-of-memory kill) is an event the server rides through, not an outage:

- :mod:`~seedance.engines.core.wire`: the messages between them, msgspec structs over a
  ZeroMQ socket (the server's ``DEALER``, the engine's ``ROUTER``, an ``ipc://`` endpoint);
- :mod:`~seedance.engines.core.child`: the engine process (``python -m
  seedance.engines.core``): it builds the configured engine, runs each request it is sent and
  sends back the deltas of one loop round in one message;
- :mod:`~seedance.engines.core.remote`: the server's side, :class:`RemoteEngine`, an
  :class:`~seedance.engines.base.Engine` like any other. It counts and renders prompts with the
  engine's *front* (its tokenizer and chat template, loaded here: ``EngineSpec.front``), starts
  the engine process and restarts it with backoff when it dies, and goes on with each running
  reply once it is back (the reply so far becomes the prompt's continuation, as when a node of
  the cluster takes a generation over).
"""
