"""``make bench``, ``make bench-compare`` and ``make soak``: the comparison suites against the
servers users would pick instead, their reference peers (``peers/``), the llama-server build,
this tree against another revision, and the soak. Beside the package, not in it (as vLLM keeps
``benchmarks/`` beside ``vllm bench``): run from a checkout, ``python -m benchmarks.suites``.
The load generator they drive, ``seedance bench``, is the package's (:mod:`seedance.bench`)."""
