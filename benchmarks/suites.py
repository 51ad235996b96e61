"""``make bench``: Seedance against the servers users would pick instead, in one run, written to
``docs/benchmarks.md``: one module per suite (``benchmarks/*.py``), the harness they share
(:mod:`benchmarks.harness`), and this runner. Run from the repository's root:

    python -m benchmarks.suites [--quick] [--rounds N] [--suites 1,5] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.browser_suite import browser_suite
from benchmarks.cluster_suite import cluster_suite
from benchmarks.confidential_suite import confidential_suite
from benchmarks.design_table import design_table
from benchmarks.embeddings_suite import embeddings_suite
from benchmarks.fan_out import fan_out
from benchmarks.gateway_suite import gateway_suite
from benchmarks.guidellm_suite import guidellm_suite
from benchmarks.ha_suite import ha_suite
from benchmarks.harness import Report, cores
from benchmarks.http_suite import http_suite
from benchmarks.idle import idle
from benchmarks.lineage_suite import lineage_suite
from benchmarks.llama_suite import llama_suite, native_suite
from benchmarks.observability_suite import observability_suite
from benchmarks.openai_suite import openai_suite
from benchmarks.prefix_suite import prefix_suite
from benchmarks.processes_suite import processes_suite
from benchmarks.qos_suite import qos_suite
from benchmarks.relay_suite import relay_suite
from benchmarks.reload_suite import reload_suite
from benchmarks.resume_suite import resume_suite
from benchmarks.structured_suite import structured_suite
from benchmarks.tensor_suite import tensor_suite
from benchmarks.token_path import token_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, 2,000 idle connections")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per contender (default 2)")
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--suites",
        default="1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25",
        help="which suites to run (default all: 1-25)",
    )
    args = parser.parse_args(argv)
    if cores() < 2:
        print("note: fewer than 2 cores; server and load generator share them", file=sys.stderr)
    report = Report(args.quick, args.rounds, args.out)
    started = time.time()
    chosen = {s.strip() for s in args.suites.split(",")}
    suites: dict[str, Callable[[], None]] = {
        "1": functools.partial(token_path, report),
        "2": functools.partial(fan_out, report),
        "3": functools.partial(idle, report),
        "4": functools.partial(design_table, report),
        "5": functools.partial(llama_suite, report),
        "6": functools.partial(http_suite, report),
        "7": functools.partial(gateway_suite, report),
        "8": functools.partial(observability_suite, report),
        "9": functools.partial(resume_suite, report),
        "10": functools.partial(cluster_suite, report),
        "11": functools.partial(qos_suite, report),
        "12": functools.partial(browser_suite, report),
        "13": functools.partial(openai_suite, report),
        "14": functools.partial(reload_suite, report),
        "15": functools.partial(confidential_suite, report),
        "16": functools.partial(embeddings_suite, report),
        "17": functools.partial(structured_suite, report),
        "18": functools.partial(guidellm_suite, report),
        "19": functools.partial(tensor_suite, report),
        "20": functools.partial(relay_suite, report),
        "21": functools.partial(processes_suite, report),
        "22": functools.partial(native_suite, report),
        "23": functools.partial(ha_suite, report),
        "24": functools.partial(prefix_suite, report),
        "25": functools.partial(lineage_suite, report),
    }
    for key in sorted(chosen, key=int):
        suites[key]()
    report.write(started)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
