"""The vLLM engine on this machine's GPU, in a few minutes, with nothing downloaded.

    make gpu-smoke [WHEELS=folder]          (or: python3 scripts/gpu_smoke.py [--wheels F])

Makes a virtual environment (``.venv-gpu``) with Seedance and vLLM when it has none, from a
folder of wheels where the machine has no package access (pieces ``NAME.part-aa``, ``-ab`` ...
are joined first; docs/gpu.md says how to make such a folder), builds a tiny random-weight
Llama around SmolLM2's tokenizer and chat template (tests/support/tiny_model.py), serves it with
``seedance serve --engine vllm`` and checks, over real sockets, what a user relies on. Prints
one line per check and a summary with the versions; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SLOTS = 2  # --max-running: two requests run at once, the rest wait in priority order
START_TIMEOUT_S = 300


# ---- the environment ---------------------------------------------------------------------


def join_pieces(folder: Path) -> None:
    """``NAME.part-aa``, ``NAME.part-ab`` ... (from ``split -b 64M NAME NAME.part-``) become
    ``NAME`` again."""
    pieces: dict[str, list[Path]] = {}
    for piece in folder.glob("*.part-*"):
        pieces.setdefault(piece.name.rsplit(".part-", 1)[0], []).append(piece)
    for name, parts in pieces.items():
        whole = folder / name
        if whole.exists():
            continue
        print(f"joining {len(parts)} pieces into {name}", flush=True)
        with open(whole.with_suffix(".joining"), "wb") as out:
            for part in sorted(parts):
                out.write(part.read_bytes())
        whole.with_suffix(".joining").rename(whole)


def ensure_venv(venv: Path, wheels: Path | None) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"making {venv} (Seedance with vLLM)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    source = ["--no-index", "--find-links", str(wheels)] if wheels else []
    if wheels:
        join_pieces(wheels)
    install = [str(python), "-m", "pip", "install", "--quiet", *source]
    subprocess.run([*install, "-e", f"{ROOT}[vllm]"], check=True)
    return python


# ---- the checks --------------------------------------------------------------------------


class Smoke:
    def __init__(self, url: str, http: str) -> None:
        self.url = url
        self.http = http
        self.results: list[tuple[str, bool, str]] = []

    async def check(self, name: str, run: Callable[[], Awaitable[str]]) -> None:
        started = time.perf_counter()
        try:
            detail = await run()
            ok = True
        except Exception as exc:
            detail, ok = f"{type(exc).__name__}: {exc}", False
        took = time.perf_counter() - started
        self.results.append((name, ok, detail))
        print(f"{'ok  ' if ok else 'FAIL'} {name} ({took:.2f} s): {detail}", flush=True)

    def get(self, path: str) -> tuple[int, str]:
        with urllib.request.urlopen(f"{self.http}{path}", timeout=5) as response:
            return response.status, response.read().decode()

    async def metric(self, name: str) -> float:
        _, text = await asyncio.to_thread(self.get, "/metrics")
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        if match is None:
            raise AssertionError(f"/metrics has no {name}")
        return float(match[1])

    async def run_all(self) -> None:
        from seedance.client import connect

        greedy: dict[str, str] = {}

        async def stream_exact() -> str:
            async with connect(self.url) as session:
                stream = session.generate("Say something.", temperature=0, max_tokens=48)
                seq, first, start = 0, 0.0, time.perf_counter()
                async for chunk in stream:
                    assert chunk.seq == seq, (chunk.seq, seq)
                    first = first or time.perf_counter()
                    seq += chunk.n
                done = stream.done
                assert done is not None and done.finish_reason in ("stop", "length"), done
                assert seq == done.usage.completion_tokens, (seq, done.usage)
                again = await session.complete("Say something.", temperature=0, max_tokens=48)
                assert again.text == stream.text, "greedy replies differ"
                greedy["text"] = stream.text
                rate = (seq - 1) / max(time.perf_counter() - first, 1e-9)
                return (
                    f"{seq} tokens ({done.finish_reason}), TTFT {(first - start) * 1000:.0f} ms, "
                    f"{rate:.0f} tokens/s, the same again"
                )

        async def seeded() -> str:
            poem = {"temperature": 1.0, "seed": 5, "max_tokens": 24, "reset": True}
            async with connect(self.url) as session:
                await session.complete("Write a poem.", **poem)  # warm-up: prefix cached
                a = await session.complete("Write a poem.", **poem)
                b = await session.complete("Write a poem.", **poem)
            assert a.text == b.text, (a.text, b.text)
            return f"equal after a warm-up ({a.usage.completion_tokens} tokens)"

        async def stop_string() -> str:
            text = greedy.get("text", "")
            cut = len(text) // 2
            stop = text[cut : cut + 3]
            if len(text) < 8 or not stop.strip():
                raise AssertionError(f"the greedy reply is too short to cut: {text!r}")
            expected = text[: text.index(stop)]
            async with connect(self.url) as session:
                done = await session.complete(
                    "Say something.", temperature=0, max_tokens=48, stop=stop
                )
            assert done.finish_reason == "stop", done.finish_reason
            assert done.text == expected, (done.text, expected)
            return f"cut at {stop!r}: {len(expected)} characters, exactly"

        async def cancel() -> str:
            async with connect(self.url) as session:
                long = session.generate("Tell me a story.", temperature=0.7, max_tokens=1000)
                await anext(aiter(long))
                await long.cancel()
                assert (await long.collect()).finish_reason == "cancelled"
            deadline = time.perf_counter() + 1.0
            while (held := await self.metric("seedance_engine_requests")) > 0:
                assert time.perf_counter() < deadline, f"{held} request(s) left in vLLM after 1 s"
                await asyncio.sleep(0.02)
            return "no unfinished request in vLLM within 1 s"

        async def priority() -> str:
            # A session runs one generation at a time: a connection for each request.
            async with contextlib.AsyncExitStack() as stack:
                sessions = [await stack.enter_async_context(connect(self.url)) for _ in range(4)]
                busy = [
                    session.generate(f"Story {i}.", temperature=0.7, max_tokens=1000)
                    for i, session in enumerate(sessions[:SLOTS])
                ]
                for stream in busy:  # both slots are taken
                    await anext(aiter(stream))
                order: list[str] = []

                async def run(name: str, session: Any, priority: int) -> None:
                    await session.generate(name, max_tokens=4, priority=priority).collect()
                    order.append(name)

                # A request is sent when its stream is first read: low, then high, both wait.
                low = asyncio.create_task(run("low", sessions[SLOTS], -5))
                await asyncio.sleep(0.1)
                high = asyncio.create_task(run("high", sessions[SLOTS + 1], 5))
                await asyncio.sleep(0.1)
                assert not order, f"{order} ran with both slots busy"
                await busy[0].cancel()  # one slot frees: the higher priority takes it
                await asyncio.gather(low, high)
                await busy[1].cancel()
            assert order == ["high", "low"], order
            return f"with {SLOTS} slots busy, priority 5 ran before -5 when one freed"

        async def same_id() -> str:
            async def one() -> int:
                async with connect(self.url) as session:
                    stream = session.generate("Hi.", max_tokens=32, request_id="twin")
                    return (await stream.collect()).usage.completion_tokens

            counts = await asyncio.gather(one(), one())
            assert all(n > 0 for n in counts), counts
            return f"both replied ({counts[0]} and {counts[1]} tokens)"

        async def many() -> str:
            async def one(i: int) -> int:
                async with connect(self.url) as session:
                    done = await session.complete(f"Count to {i}.", max_tokens=32, seed=i)
                    return done.usage.completion_tokens

            started = time.perf_counter()
            counts = await asyncio.gather(*(one(i) for i in range(16)))
            assert all(n > 0 for n in counts), counts
            took = time.perf_counter() - started
            return f"16 streams, {sum(counts)} tokens in {took:.1f} s"

        async def healthz() -> str:
            status, _ = await asyncio.to_thread(self.get, "/healthz")
            assert status == 200, status
            return "200"

        await self.check("greedy stream, exact token counts", stream_exact)
        await self.check("seeded replies are equal", seeded)
        await self.check("a stop string is cut exactly", stop_string)
        await self.check("cancel leaves nothing in vLLM", cancel)
        await self.check("priority order with two slots", priority)
        await self.check("two live requests with the same id", same_id)
        await self.check("16 concurrent streams", many)
        await self.check("/healthz", healthz)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def versions() -> str:
    import torch
    import vllm

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"vLLM {vllm.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}"


def smoke(work: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: the vLLM engine runs only on CUDA GPUs", file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    from tests.support.tiny_model import tiny_llama

    began = time.perf_counter()
    model = tiny_llama(work / "tiny-llama")
    port = free_port()
    log = open(work / "server.log", "w+")  # noqa: SIM115 - read back at the end
    argv = [str(Path(sys.executable).with_name("seedance")), "serve", "--engine", "vllm"]
    argv += ["--model-path", str(model), "--port", str(port), "--max-running", str(SLOTS)]
    argv += ["--gpu-memory-utilization", "0.3", "--n-ctx", "4096"]
    print("$", " ".join(argv), flush=True)
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    http = f"http://127.0.0.1:{port}"
    smoke = Smoke(f"ws://127.0.0.1:{port}/v2/infer", http)
    try:
        deadline = time.perf_counter() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode}")
            try:
                with urllib.request.urlopen(f"{http}/healthz", timeout=2):
                    break
            except OSError:
                if time.perf_counter() > deadline:
                    raise RuntimeError("the server was not ready in time") from None
                time.sleep(1)
        print(f"ready in {time.perf_counter() - began:.0f} s", flush=True)
        asyncio.run(smoke.run_all())
    except Exception as exc:
        smoke.results.append(("start", False, str(exc)))
        print(f"FAIL start: {exc}", flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(60)
            smoke.results.append(("shutdown", code == 0, f"exit code {code}"))
        except subprocess.TimeoutExpired:
            server.kill()
            smoke.results.append(("shutdown", False, "still running 60 s after SIGTERM"))
        log.seek(0)
        text = log.read()
        errors = [line for line in text.splitlines() if "Traceback" in line or " ERROR " in line]
        smoke.results.append(("server log", not errors, errors[0] if errors else "no errors"))
        print(f"{smoke.results[-2][0]}: {smoke.results[-2][2]}", flush=True)
    failed = [name for name, ok, _ in smoke.results if not ok]
    took = time.perf_counter() - began
    print(f"\n{versions()}; {took:.0f} s in all")
    if failed:
        print(f"FAILED: {', '.join(failed)} (server log: {work / 'server.log'})")
        return 1
    print(f"all {len(smoke.results)} checks passed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv-gpu")
    parser.add_argument("--wheels", type=Path, help="install from this folder of wheels")
    parser.add_argument("--work", type=Path, help="keep the model and the log here")
    args = parser.parse_args()
    if "VIRTUAL_ENV_SMOKE" not in os.environ:  # run again inside the environment
        python = ensure_venv(args.venv.resolve(), args.wheels)
        os.environ["VIRTUAL_ENV_SMOKE"] = "1"
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        return smoke(args.work)
    with tempfile.TemporaryDirectory(prefix="seedance-gpu-smoke-") as work:
        return smoke(Path(work))


if __name__ == "__main__":
    sys.exit(main())
