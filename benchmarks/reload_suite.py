"""Suite 14 of ``make bench``: the model reloaded under load, five times, against no reload.

A registry holds the embedded SmolLM2 six times over (versions 1.0.0 to 1.5.0, signed with a
key made for the run, the weights linked, not copied); ``seedance serve`` serves it with the
watcher on. Clients keep a steady stream of requests going (each of ``CLIENTS`` sessions asks
again as soon as its reply ends). For the first half of the run nothing changes; in the second
half a new version is promoted every few seconds, five times, and the server verifies, loads,
warms and swaps each in while the requests run. Reported per half: requests, errors, and the
time to first token (p50, p99), measured by the clients; and which versions answered.

The clients run in a child process on the client core (``python -m
benchmarks.reload_suite URL SECONDS CLIENTS``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Contender, fmt, machine_lines, servers
from seedance.bench.metrics import percentile

if TYPE_CHECKING:
    from benchmarks.harness import Report

VERSIONS = ("1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0", "1.5.0")
CLIENTS = 4
MAX_TOKENS = 16


def make_registry(root: Path) -> Path:
    """The embedded model, once per version, signed; returns the public key's path."""
    from seedance.engines.llamacpp.cpu import resolve_repack
    from seedance.engines.local import default_model_path, machine_cores
    from seedance.models.registry import Registry, place, sign_version
    from seedance.models.signing import keygen

    decided = resolve_repack("auto", default_model_path(), machine_cores())
    repack = "on" if decided.repack else "off"

    key = root / "bench.key"
    public, _ = keygen(key)
    gguf = default_model_path()
    for version in VERSIONS:
        folder = root / "registry" / "smollm2" / version
        folder.mkdir(parents=True)
        place(gguf, folder)
        sign_version(
            folder,
            key,
            name="smollm2",
            version=version,
            git_commit="bench",
            engine="llamacpp",
            # The layout fixed as the engine decides it for this CPU (cached by the probe):
            # "auto" in the manifest would probe at every load, under the load.
            engine_options={"parallel": 8, "n_ctx": 8 * 1024, "repack": repack},
        )
    Registry(root / "registry").promote("smollm2", VERSIONS[0])
    return public


async def _client(url: str, index: int, until: float, out: list[dict[str, Any]]) -> None:
    from websockets.asyncio.client import connect

    async with connect(f"{url}?session_id=reload-{index}", compression=None) as ws:
        await ws.recv()  # session
        turn = 0
        while time.time() < until:
            turn += 1
            request = {
                "prompt": f"Say something short about the number {turn}.",
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "reset": True,
            }
            started = time.time()
            await ws.send(json.dumps(request))
            first = None
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "token" and first is None:
                    first = time.time()
                if frame["type"] in ("done", "error"):
                    break
            out.append(
                {
                    "at": started,
                    "ttft_ms": None if first is None else (first - started) * 1000,
                    "ok": frame["type"] == "done",
                    "error": frame.get("error", {}).get("code"),
                    "version": frame.get("model_version"),
                }
            )


async def _clients(url: str, seconds: float, clients: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    until = time.time() + seconds
    await asyncio.gather(*(_client(url, i, until, out) for i in range(clients)))
    return out


def reload_suite(report: Report) -> None:
    seconds = 40 if report.quick else 90
    with tempfile.TemporaryDirectory(prefix="seedance-reload-") as scratch:
        root = Path(scratch)
        public = make_registry(root)
        registry = root / "registry"
        exe = str(Path(sys.executable).with_name("seedance"))
        argv = [
            *(exe, "serve", "--port", "{port}", "--log-level", "warning"),
            *("--model-registry", str(registry), "--model-trust", str(public)),
            *("--model", "smollm2", "--model-watch-s", "0.5", "--threads", "2"),
        ]
        contender = Contender(
            "reload", "Seedance, from a registry", argv, "/v2/infer", pinned=False
        )
        from seedance.models.registry import Registry

        with servers([contender]) as running:
            url = running["reload"].url
            report.log(f"[14 reload] {seconds} s of requests, 5 reloads in the second half")
            started = time.time()
            half = seconds / 2
            promotions: list[float] = []

            def promote() -> None:
                for i, version in enumerate(VERSIONS[1:]):
                    time.sleep(max(0.0, started + half + i * (half / 6) - time.time()))
                    Registry(registry).promote("smollm2", version)
                    promotions.append(time.time())

            promoter = threading.Thread(target=promote, daemon=True)
            promoter.start()
            out = subprocess.run(
                [sys.executable, "-m", __name__, url, str(seconds), str(CLIENTS)],
                capture_output=True,
                text=True,
                check=True,
            )
            promoter.join()
    results = json.loads(out.stdout)
    split = started + half
    phases = {
        "no reload": [r for r in results if r["at"] < split],
        "5 reloads": [r for r in results if r["at"] >= split],
    }
    rows = []
    for name, rs in phases.items():
        ttft = [r["ttft_ms"] for r in rs if r["ttft_ms"] is not None]
        errors = Counter(r["error"] for r in rs if not r["ok"])
        versions = Counter(r["version"] for r in rs if r["ok"])
        rows.append(
            f"| {name} | {len(rs)} | {sum(errors.values())} | {fmt(statistics.median(ttft), 1)} "
            f"| {fmt(percentile(sorted(ttft), 99), 1)} | "
            + ", ".join(f"{v}: {n}" for v, n in sorted(versions.items()))
            + " |"
        )
    reloaded = phases["5 reloads"]
    failed = sum(1 for r in reloaded if not r["ok"])
    last = max((r["version"] or "" for r in reloaded), default="")
    ok = failed == 0 and last == VERSIONS[-1]
    report.goals.append(
        (
            "14. Reload under load: 5 reloads, 0 errors, the last version serving",
            f"{failed} errors",
            ok,
        )
    )
    report.sections.append(
        "\n".join(
            [
                "## 14. Reloading the model under load",
                "",
                f"The embedded SmolLM2 served from a registry of six signed versions; {CLIENTS} "
                f"sessions ask for {MAX_TOKENS}-token replies back to back for {seconds} s. In "
                "the second half a new version is promoted five times, and the server's watcher "
                "(every 0.5 s) verifies, loads, warms and swaps each in while the requests run. "
                "TTFT is measured by the clients; a request counts in the half it started in.",
                "",
                *machine_lines(),
                "",
                "| half | requests | errors | TTFT p50 ms | TTFT p99 ms | versions that answered |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                "```",
                contender.display()
                .replace(str(registry), "REGISTRY")
                .replace(str(public), "KEY.pub"),
                f"python -m benchmarks.reload_suite URL {seconds} {CLIENTS}",
                "```",
                "",
            ]
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description="steady requests for the reload suite")
    parser.add_argument("url")
    parser.add_argument("seconds", type=float)
    parser.add_argument("clients", type=int)
    args = parser.parse_args()
    results = asyncio.run(_clients(args.url, args.seconds, args.clients))
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
