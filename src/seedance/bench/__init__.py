"""``seedance bench``: a load generator for Seedance and OpenAI-compatible servers, and the
comparison suites behind ``make bench`` (:mod:`seedance.bench.suites`)."""
