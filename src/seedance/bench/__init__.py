"""``seedance bench``: a load generator for Seedance and OpenAI-compatible servers (load,
targets, metrics, report; the command in :mod:`seedance.bench.cli`). The comparison suites of
``make bench`` that drive it live beside the package, in the repository's ``benchmarks/``."""
