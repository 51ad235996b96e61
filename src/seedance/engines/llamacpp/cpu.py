"""Whether llama.cpp may repack the weights on this CPU: ``--repack auto|on|off``.

llama.cpp can lay a model's weights out for the CPU's widest kernels, its "extra buffer
types": interleaved blocks for AVX2/NEON, AMX tiles on Intel Xeons. Where such a kernel exists
it may trap (a VM that reports AMX without enabling its state: SIGILL at the first decode, the
whole server gone) or run slower than the plain layout (AMX decoded SmolLM2 at about 7 tokens/s
against 90-112 without, on a Sapphire Rapids VM). So ``auto``, the default, measures: a child
process loads the model each way and times a short prefill and a batched decode; a layout
whose child dies is never used (``on`` refuses to start with it), and repacking is used only
when it is at least :data:`MIN_GAIN` faster. The decision is cached per CPU, llama.cpp build,
model file and thread count (:func:`cache_key`), so only a first start pays for it (about 5 s
for SmolLM2 on 2 cores).

The child is this module: ``python -m seedance.engines.llamacpp.cpu MODEL --repack on``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from seedance.config import ConfigError
from seedance.engines.llamacpp.native import (
    LIBRARY_DIR,
    ContextShape,
    LlamaContext,
    LlamaModel,
    require_model_file,
)

logger = logging.getLogger(__name__)

#: Repacking must beat the plain layout by this much: the plain layout is the safe one.
MIN_GAIN: Final = 0.05
PROBE_TIMEOUT_S: Final = 120.0
_PREFILL_TOKENS: Final = 64
_DECODE_SEQUENCES: Final = 4
_DECODE_STEPS: Final = 8
_REPEATS: Final = 3
_REFUSED: Final = 3  # the child's exit code for a model it cannot load


@dataclass(frozen=True)
class ProbeRun:
    """One child's result: its seconds for the probe's work, or why it failed."""

    repack: bool
    seconds: float | None = None
    failure: str = ""
    refused: bool = False  # the child refused the model (not a GGUF file, say): not the CPU

    @property
    def ok(self) -> bool:
        return self.seconds is not None


#: Runs the probe child for one layout (a parameter so that tests can hand in a failing one).
Prober = Callable[[Path, int, bool], ProbeRun]


def probe_child(model: Path, threads: int, repack: bool) -> ProbeRun:
    """Time the model in a child process with repacking ``repack``; a crash is a result."""
    argv = [sys.executable, "-m", __name__, str(model), "--threads", str(threads)]
    argv += ["--repack", "on" if repack else "off"]
    return run_probe(argv, repack)


def run_probe(argv: list[str], repack: bool) -> ProbeRun:
    """Run one probe command; its last stdout line is ``{"seconds": S}``."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return ProbeRun(repack, failure=f"no answer within {PROBE_TIMEOUT_S:.0f} s")
    if out.returncode < 0:
        name = signal.Signals(-out.returncode).name
        return ProbeRun(repack, failure=f"killed by {name}{_tail(out.stderr)}")
    if out.returncode == _REFUSED:
        return ProbeRun(repack, failure=out.stderr.strip().splitlines()[-1], refused=True)
    if out.returncode != 0:
        return ProbeRun(repack, failure=f"exit code {out.returncode}{_tail(out.stderr)}")
    try:
        seconds = float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    except (ValueError, KeyError, IndexError, TypeError):
        return ProbeRun(repack, failure=f"unreadable answer {out.stdout[-200:]!r}")
    return ProbeRun(repack, seconds)


def _tail(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return f": {lines[-1][:300]}" if lines else ""


def choose(on: ProbeRun, off: ProbeRun) -> bool:
    """Repack when it ran and was clearly faster; raise when the model cannot run at all."""
    if off.refused:
        raise ConfigError(off.failure)
    if not off.ok:
        raise ConfigError(
            f"llama.cpp cannot run this model on this CPU ({off.failure}); "
            "see docs/engines.md for building llama-cpp-python for this machine"
        )
    if not on.ok:
        return False
    assert on.seconds is not None and off.seconds is not None
    return on.seconds <= (1.0 - MIN_GAIN) * off.seconds


def cache_key(model: Path, threads: int) -> str:
    """What the decision depends on: the CPU, the llama.cpp build, the model file, threads."""
    stat = model.stat()
    parts = {
        "cpu": cpu_identity(),
        "build": sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in LIBRARY_DIR.iterdir()
            if p.is_file()
        ),
        "model": [str(model.resolve()), stat.st_size, stat.st_mtime_ns],
        "threads": threads,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cpu_identity() -> str:
    """The processor's model and instruction-set flags (what a kernel may trap on)."""
    identity = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            seen = set()
            for line in info:
                name, _, value = line.partition(":")
                name = name.strip()
                if name in ("model name", "flags", "Features", "CPU part") and name not in seen:
                    seen.add(name)
                    identity.append(f"{name}={value.strip()}")
    except OSError:  # pragma: no cover - not Linux
        pass
    return "\n".join(identity)


def cache_dir() -> Path:
    """``$SEEDANCE_CACHE_DIR``, else ``$XDG_CACHE_HOME/seedance``, else ``~/.cache/seedance``."""
    explicit = os.environ.get("SEEDANCE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "seedance"


@dataclass(frozen=True)
class Decision:
    """What ``--repack`` resolved to, and how."""

    repack: bool
    how: str  # "flag", "cached" or "probed"
    on: ProbeRun | None = None
    off: ProbeRun | None = None

    def describe(self) -> str:
        text = f"weight repacking {'on' if self.repack else 'off'}"
        if self.how == "flag":
            return f"{text} (--repack)"
        runs = ", ".join(
            f"{'on' if run.repack else 'off'}: "
            + (f"{run.seconds * 1000:.0f} ms" if run.seconds is not None else run.failure)
            for run in (self.on, self.off)
            if run is not None
        )
        cached = ", decided at an earlier start" if self.how == "cached" else ""
        return f"{text} (measured: {runs}{cached})"


def resolve_repack(
    mode: str,
    model: Path,
    threads: int,
    *,
    cache: Path | None = None,
    prober: Prober = probe_child,
) -> Decision:
    """``--repack``'s answer for this model on this machine (see the module's docstring).
    ``on`` is checked against the probe's result (cached, or measured once): a layout that
    kills its child is refused at start, by name, instead of taking the server down at its
    first reply."""
    if mode == "off":
        return Decision(False, "flag")
    if mode == "on":
        probed = resolve_repack("auto", model, threads, cache=cache, prober=prober)
        if probed.on is not None and not probed.on.ok and not probed.on.refused:
            raise ConfigError(
                f"--repack on: llama.cpp's repacked weights fail on this CPU "
                f"({probed.on.failure}); use --repack auto (the default) or off"
            )
        return Decision(True, "flag", probed.on, probed.off)
    require_model_file(model)
    cache = cache or cache_dir()
    path = cache / "llamacpp-repack.json"
    key = cache_key(model, threads)
    cached = _cached(path, key)
    if cached is not None:
        return cached
    with _probing_alone(cache):
        cached = _cached(path, key)  # probed by another server while this one waited
        if cached is not None:
            return cached
        logger.info(
            "probing llama.cpp's weight layouts on this CPU (once per CPU, build and model)"
        )
        off = prober(model, threads, False)
        on = prober(model, threads, True)
        if not on.ok:
            logger.warning(
                "llama.cpp's repacked weights fail on this CPU (%s): serving without them",
                on.failure,
            )
        decision = Decision(choose(on, off), "probed", on, off)
        entries = _read(path)
        entries[key] = {"repack": decision.repack, "runs": [asdict(on), asdict(off)]}
        _write(path, entries)
    return decision


def _cached(path: Path, key: str) -> Decision | None:
    entry = _read(path).get(key)
    if not (isinstance(entry, dict) and isinstance(entry.get("repack"), bool)):
        return None
    runs = [ProbeRun(**run) for run in entry.get("runs", []) if isinstance(run, dict)]
    on = next((r for r in runs if r.repack), None)
    off = next((r for r in runs if not r.repack), None)
    return Decision(entry["repack"], "cached", on, off)


@contextlib.contextmanager
def _probing_alone(cache: Path) -> Iterator[None]:
    """Probe while holding the cache's lock: servers started together on one machine (a
    cluster's nodes, the test suite's processes) would otherwise time each other's work, and
    cache what that contention measured. The lock goes with its holder, even at ``kill -9``."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        lock = open(cache / "llamacpp-repack.lock", "a")  # noqa: SIM115 - held below
    except OSError:  # an unwritable cache: probe unlocked (and cache nothing, see _write)
        yield
        return
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another server's probe of this CPU (%s)", lock.name)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, entries: dict[str, object]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(entries, indent=1))
        partial.replace(path)
    except OSError as exc:  # an unwritable cache costs a probe at the next start, nothing else
        logger.warning("cannot cache the repack decision in %s: %s", path, exc)


# --------------------------------------------------------------------------- the child


def measure(model_path: Path, threads: int, repack: bool) -> float:
    """Seconds for prefills of a short prompt and a few batched decode steps (the best of
    :data:`_REPEATS` rounds)."""
    model = LlamaModel(model_path, repack=repack)
    shape = ContextShape(
        n_seq=_DECODE_SEQUENCES, n_ctx_seq=512, n_batch=_PREFILL_TOKENS, threads=threads
    )
    ctx = LlamaContext(model, shape)
    words = model.tokenize("The quick brown fox jumps over the lazy dog. " * 40, special=False)
    prompt = words[:_PREFILL_TOKENS]

    def prefill(seq: int) -> None:
        ctx.clear_batch()
        for pos, token in enumerate(prompt):
            ctx.add(token, pos, seq, pos == len(prompt) - 1)
        if ctx.decode() != 0:
            raise RuntimeError("llama_decode failed")

    prefill(0)  # warm-up: first touch of the weights, threads started
    ctx.forget(0)
    best = float("inf")
    for _ in range(_REPEATS):
        start = time.perf_counter()
        for seq in range(_DECODE_SEQUENCES):
            prefill(seq)
        for step in range(_DECODE_STEPS):
            ctx.clear_batch()
            for seq in range(_DECODE_SEQUENCES):
                ctx.add(prompt[step], len(prompt) + step, seq, True)
            if ctx.decode() != 0:
                raise RuntimeError("llama_decode failed")
        best = min(best, time.perf_counter() - start)
        for seq in range(_DECODE_SEQUENCES):
            ctx.forget(seq)
    ctx.close()
    model.close()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Time one weight layout (a probe's child).")
    parser.add_argument("model", type=Path)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repack", choices=("on", "off"), required=True)
    args = parser.parse_args(argv)
    try:
        seconds = measure(args.model, args.threads, args.repack == "on")
    except ConfigError as exc:
        print(exc.message, file=sys.stderr)
        sys.exit(_REFUSED)
    print(json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main()
