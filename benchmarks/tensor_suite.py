"""Suite 19 of ``make bench``: tensors and tenants' WebAssembly. One server serves
all-MiniLM-L6-v2 beside the synthetic text engine; every figure is measured on what that server
sent.

1. **On the wire**: the ``embed`` frame of ``/v2/infer`` with one 64-token input, its 384
   float32 values as a JSON array (``float``), as base64 inside JSON (``base64``) and as a
   binary tensor frame (``tensor``): the bytes of each frame as the server wrote it, and the
   time the Python SDK takes to turn each into a float32 array (``json.loads`` then
   ``np.asarray`` of the array; ``json.loads``, base64 and ``np.frombuffer``; the tensor frame's
   :func:`~seedance.protocol.tensors.decode_tensor`). Goals: the tensor frame at most 0.30x the
   JSON array's bytes and 0.80x base64's; decoding it at least 10x faster than the JSON array's.
2. **The Open Inference Protocol**: the unchanged ``tritonclient[http]`` against
   ``/v2/models/all-minilm-l6-v2/infer``, 32 inputs of 8 tokens per request (short, so that
   the model's passes leave the protocol's cost in sight: 12,288 numbers per answer), 4
   closed-loop clients (threads, one client each), the outputs in binary (``binary_data=True``,
   the client's default) and as JSON tensors, in alternating rounds. Goal: binary at least 1.0x
   JSON's requests/s.
3. **A stream filter in WebAssembly**: the shipped redaction filter (``examples/wasm/redact.c``,
   built with clang for wasm32-wasi) on every token of 100 concurrent streams (``seedance
   bench -c 100``, 64-token replies), against the same server's replies without it: one server
   with two tenants, one whose ``modules`` run the filter and one without, in alternating
   rounds. The synthetic engine at 50 tokens/s per stream (5,000 tokens/s in all: faster than
   a language model on this machine) is the goal's load; unpaced (the engine as fast as the
   event loop runs) is the filter's ceiling, reported beside it. Goal: delivered tokens/s at
   least 0.9x without the filter, at 50 tokens/s per stream. Then, in one process: a filter
   call's cost (p50 µs, a 6-byte piece through ``Instance.filter``) and a module's start
   (instantiate from the compiled module, p50), whose goal is under 1 ms.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
import timeit
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from benchmarks.embeddings_suite import MODEL, inputs_of
from benchmarks.harness import Contender, fmt, ratio, servers, verdict

if TYPE_CHECKING:
    from benchmarks.harness import Report

OIP_CLIENTS = 4
OIP_BATCH = 32
OIP_TOKENS = 8


async def _frames(url: str, text: str) -> dict[str, bytes]:
    """The answer frames of one ``embed`` in each encoding, as the server wrote them."""
    import websockets

    from seedance.protocol.messages import HEARTBEAT_PING, HEARTBEAT_PONG

    frames: dict[str, bytes] = {}
    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        await ws.recv()  # the session frame
        for encoding in ("float", "base64", "tensor"):
            embed = {"type": "embed", "request_id": encoding, "input": text}
            await ws.send(json.dumps({**embed, "encoding_format": encoding}))
            while True:
                data = await ws.recv()
                if data == HEARTBEAT_PING:
                    await ws.send(HEARTBEAT_PONG)
                    continue
                raw = data if isinstance(data, bytes) else data.encode()
                if raw[:1] == b"\x10":  # the tensor, before the frame that ends the request
                    frames["tensor"] = raw
                    continue
                if encoding != "tensor":
                    frames[encoding] = raw
                break
    return frames


def _decoders() -> dict[str, Any]:
    """What the SDK does to each frame to get a float32 array."""
    import base64

    from seedance.protocol.tensors import decode_tensor

    def from_json(frame: bytes) -> np.ndarray:
        return np.asarray(json.loads(frame)["data"], dtype=np.float32)

    def from_base64(frame: bytes) -> np.ndarray:
        data = json.loads(frame)["data"]
        return np.stack([np.frombuffer(base64.b64decode(v), dtype="<f4") for v in data])

    def from_tensor(frame: bytes) -> np.ndarray:
        return decode_tensor(frame).array

    return {"float": from_json, "base64": from_base64, "tensor": from_tensor}


def _decode_us(decode: Any, frame: bytes, quick: bool) -> float:
    number = 2000 if quick else 20000
    timer = timeit.Timer(lambda: decode(frame))
    return min(timer.repeat(5, number)) / number * 1e6


def _oip_load(address: str, texts: list[str], binary: bool, seconds: float) -> dict[str, float]:
    """:data:`OIP_CLIENTS` closed-loop tritonclient clients for ``seconds``: requests/s."""
    import tritonclient.http as triton

    done, errors = [0], [0]
    latencies: list[float] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(index: int) -> None:
        http = triton.InferenceServerClient(address)
        at = index * OIP_BATCH
        while time.perf_counter() < deadline:
            chunk = [texts[(at + i) % len(texts)].encode() for i in range(OIP_BATCH)]
            at += OIP_BATCH * OIP_CLIENTS
            given = triton.InferInput("text", [OIP_BATCH], "BYTES")
            given.set_data_from_numpy(np.array(chunk, dtype=object), binary_data=binary)
            wanted = [triton.InferRequestedOutput("embedding", binary_data=binary)]
            sent = time.perf_counter()
            try:
                vectors = http.infer(MODEL, [given], outputs=wanted).as_numpy("embedding")
                ok = vectors is not None and vectors.shape == (OIP_BATCH, 384)
            except Exception:
                ok = False
            with lock:
                if ok:
                    done[0] += 1
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors[0] += 1
        http.close()

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(OIP_CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    return {
        "requests_per_s": done[0] / elapsed,
        "p50_ms": statistics.median(latencies) * 1000 if latencies else float("nan"),
        "errors": errors[0],
    }


STREAMS = 100
PACE = 50  # tokens/s per stream


def _build_redact(workdir: Path) -> bytes | None:
    """``examples/wasm/redact.c`` built (None: no clang for wasm32-wasi here)."""
    import shutil
    import subprocess

    if shutil.which("clang") is None or shutil.which("wasm-ld") is None:
        return None
    out = workdir / "redact.wasm"
    result = subprocess.run(
        ["clang", "--target=wasm32-wasi", "-O2", "-nostartfiles", "-Wl,--no-entry",
         "-Wl,--export-dynamic", "-o", str(out), "examples/wasm/redact.c"],
        capture_output=True,
    )  # fmt: skip
    return out.read_bytes() if result.returncode == 0 else None


def _filter_server(workdir: Path, wasm: bytes, pace: int) -> tuple[Contender, str, str]:
    """A server whose tenant ``filtered`` runs every request through the redaction filter and
    whose tenant ``plain`` does not; the contender and the two tenants' keys."""
    from seedance.models.registry import sign_version
    from seedance.models.signing import keygen
    from seedance.tenants.keys import add_key

    key = workdir / "modules.key"
    if not key.exists():
        keygen(key)
        folder = workdir / "registry" / "redact" / "1.0.0"
        folder.mkdir(parents=True)
        (folder / "redact.wasm").write_bytes(wasm)
        sign_version(folder, key, name="redact", version="1.0.0", git_commit="bench",
                     engine="wasm")  # fmt: skip
    config = workdir / f"seedance-{pace}.toml"
    plain = add_key(config, "plain").key
    filtered = add_key(config, "filtered").key
    config.write_text('[tenants.filtered]\nmodules = ["redact"]\n\n' + config.read_text())
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--engine", "synthetic", "--synthetic-tokens-per-s", str(pace)]
    argv += ["--config", str(config), "--module-registry", str(workdir / "registry")]
    argv += ["--module-trust", str(workdir / "modules.key.pub"), "--port", "{port}"]
    argv += ["--max-connections", "20000", "--log-level", "warning"]
    return Contender(f"filter{pace}", "Seedance", argv, "/v2/infer"), plain, filtered


def _filter_loads(report: Report, wasm: bytes) -> dict[int, dict[str, list[float]]]:
    """Delivered tokens/s by pace (0: unpaced) and tenant, one list of rounds each."""
    import tempfile

    from benchmarks.harness import run_bench

    seconds = "5" if report.quick else "12"
    results: dict[int, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pace in (PACE, 0):
            contender, plain, filtered = _filter_server(Path(tmp), wasm, pace)
            keys = {"plain": plain, "filtered": filtered}
            results[pace] = {"plain": [], "filtered": []}
            with servers([contender]) as running:
                url = running[contender.key].url
                for round_ in range(report.rounds):
                    order = ["plain", "filtered"] if round_ % 2 == 0 else ["filtered", "plain"]
                    for who in order:
                        what = f"{pace} tokens/s per stream" if pace else "unpaced"
                        report.log(f"[19 tensors] round {round_ + 1}: filter, {who}, {what}")
                        args = ["--api-key", keys[who], "-c", str(STREAMS), "-d", seconds]
                        args += ["--max-tokens", "64", "--quiet"]
                        data = run_bench(url, args)
                        tps = data["summary"]["delivered_tokens_per_s"]
                        results[pace][who].append(tps)
    return results


def _module_costs(wasm: bytes, quick: bool) -> tuple[float, float]:
    """(a filter call's p50 µs, a module's start from the compiled module p50 µs)."""
    from seedance.wasm import WasmHost

    count = 2000 if quick else 20000
    with WasmHost() as host:
        module = host.compile(wasm)
        instance = module.instantiate()
        calls = []
        for _ in range(count):
            started = time.perf_counter()
            instance.filter(" hello")
            calls.append(time.perf_counter() - started)
        starts = []
        for _ in range(count // 10):
            started = time.perf_counter()
            fresh = module.instantiate()
            starts.append(time.perf_counter() - started)
            fresh.close()
        instance.close()
    return statistics.median(calls) * 1e6, statistics.median(starts) * 1e6


def tensor_suite(report: Report) -> None:
    from sentence_transformers import SentenceTransformer

    from seedance.engines.embeddings import model_folder

    folder, _ = model_folder(MODEL)
    tokenizer = SentenceTransformer(str(folder), device="cpu").tokenizer
    texts = inputs_of(tokenizer, 256, seed=19)
    short = inputs_of(tokenizer, 256, seed=19, tokens=OIP_TOKENS)
    exe = str(Path(sys.executable).with_name("seedance"))
    argv = [exe, "serve", "--engine", "synthetic", "--embedding-model", MODEL]
    argv += ["--port", "{port}", "--log-level", "warning"]
    contender = Contender("seedance", "Seedance", argv, "/v2/infer", pinned=False)
    seconds = 4.0 if report.quick else 10.0
    with servers([contender]) as running:
        server = running["seedance"]
        report.log("[19 tensors] one embed in each encoding")
        frames = asyncio.run(_frames(server.url, texts[0]))
        address = f"127.0.0.1:{server.port}"
        _oip_load(address, short, True, 1.0)  # warm-up
        oip: dict[bool, list[dict[str, float]]] = {True: [], False: []}
        for round_ in range(report.rounds):
            for binary in (True, False) if round_ % 2 == 0 else (False, True):
                what = "binary" if binary else "JSON"
                report.log(f"[19 tensors] round {round_ + 1}: tritonclient, {what}")
                oip[binary].append(_oip_load(address, short, binary, seconds))
    decoders = _decoders()
    check = [decoders[name](frames[name]) for name in ("float", "base64", "tensor")]
    assert all(np.array_equal(check[0].reshape(-1), c.reshape(-1)) for c in check[1:])
    sizes = {name: len(frame) for name, frame in frames.items()}
    times = {name: _decode_us(decoders[name], frames[name], report.quick) for name in frames}
    wire_ok = sizes["tensor"] <= 0.30 * sizes["float"] and sizes["tensor"] <= 0.80 * sizes["base64"]
    decode_ok = times["tensor"] * 10 <= times["float"]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        wasm = _build_redact(Path(tmp))
    filtered = _filter_loads(report, wasm) if wasm is not None else None
    costs = _module_costs(wasm, report.quick) if wasm is not None else None
    rates = {b: statistics.median(r["requests_per_s"] for r in runs) for b, runs in oip.items()}
    p50 = {b: statistics.median(r["p50_ms"] for r in runs) for b, runs in oip.items()}
    errors = {b: sum(int(r["errors"]) for r in runs) for b, runs in oip.items()}
    oip_ok = rates[True] >= rates[False] and errors[True] == errors[False] == 0
    report.goals += [
        ("19. Tensor frame: at most 0.30x a JSON array's bytes and 0.80x base64's", "", wire_ok),
        ("19. Tensor frame: decoded at least 10x faster than the JSON array", "", decode_ok),
        ("19. OIP binary data: at least 1.0x the requests/s of JSON tensors", "", oip_ok),
    ]
    wasm_lines = ["clang for wasm32-wasi is not installed here: the filter was not measured."]
    if filtered is not None and costs is not None:
        paced = {who: statistics.median(v) for who, v in filtered[PACE].items()}
        ceiling = {who: statistics.median(v) for who, v in filtered[0].items()}
        filter_ok = paced["filtered"] >= 0.9 * paced["plain"]
        start_ok = costs[1] < 1000
        report.goals += [
            (f"19. A WebAssembly filter on every token of {STREAMS} streams: at least 0.9x the "
             f"delivered tokens/s without it ({PACE} tokens/s per stream)", "", filter_ok),
            ("19. A module's start from the compiled module: under 1 ms p50", "", start_ok),
        ]  # fmt: skip
        wasm_lines = [
            f"**A stream filter in WebAssembly**: the redaction example on every token of "
            f"{STREAMS} concurrent streams (64-token replies), a tenant with the filter beside one "
            f"without on one server, alternating rounds. Goal: at least 0.9x the delivered "
            f"tokens/s without it at {PACE} tokens/s per stream: {verdict(filter_ok)}; a module's "
            f"start under 1 ms p50: {verdict(start_ok)}.",
            "",
            "| engine pace | without the filter, tokens/s | with it | ratio |",
            "|---|---|---|---|",
            f"| {PACE} tokens/s per stream | {fmt(paced['plain'], 0)} | "
            f"{fmt(paced['filtered'], 0)} | {ratio(paced['filtered'], paced['plain'])} |",
            f"| unpaced (the filter's ceiling) | {fmt(ceiling['plain'], 0)} | "
            f"{fmt(ceiling['filtered'], 0)} | {ratio(ceiling['filtered'], ceiling['plain'])} |",
            "",
            f"One filter call (a 6-byte piece, in one process): **{fmt(costs[0], 1)} µs** p50; a "
            f"module's start (instantiate from the compiled module): **{fmt(costs[1], 1)} µs** "
            "p50. In the server a call also crosses to a thread of the module pool and back; "
            "under load a call takes every piece that came meanwhile.",
            "",
        ]
    labels = {"float": "JSON array (`float`)", "base64": "base64 in JSON", "tensor": "tensor frame"}
    wire_rows = [
        f"| {labels[name]} | {sizes[name]:,} | {ratio(sizes[name], sizes['float'])} "
        f"| {fmt(times[name], 1)} | {ratio(times['float'], times[name])} |"
        for name in ("float", "base64", "tensor")
    ]
    report.sections.append(
        "\n".join(
            [
                "## 19. Tensors and WebAssembly",
                "",
                "One server with all-MiniLM-L6-v2 (`seedance serve --engine synthetic "
                f"--embedding-model {MODEL}`). **On the wire**: the answer to one `embed` of a "
                "64-token input (384 float32 values) in each encoding, as the server wrote it, "
                "and the Python SDK's time to make a float32 array of it (best of 5 runs of "
                f"{'2,000' if report.quick else '20,000'}). Goals: the tensor frame at most 0.30x "
                "the JSON array's bytes and 0.80x base64's: "
                f"{verdict(wire_ok)}; decoded at least 10x faster than the JSON array: "
                f"{verdict(decode_ok)}.",
                "",
                "| encoding | bytes | / JSON array | decode µs | speed-up over the JSON array |",
                "|---|---|---|---|---|",
                *wire_rows,
                "",
                "**The Open Inference Protocol**: `tritonclient[http]` (unchanged) against "
                f"`/v2/models/{MODEL}/infer`, {OIP_BATCH} inputs of {OIP_TOKENS} tokens per request, "
                f"{OIP_CLIENTS} closed-loop clients, the input and the `embedding` output in "
                "binary (Triton's binary data extension, the client's default) or as JSON "
                "tensors, alternating rounds. Goal: binary at least 1.0x JSON's requests/s: "
                f"{verdict(oip_ok)}.",
                "",
                "| tensors | requests/s | p50 ms | errors |",
                "|---|---|---|---|",
                f"| binary | {fmt(rates[True], 1)} ({ratio(rates[True], rates[False])}) "
                f"| {fmt(p50[True], 1)} | {errors[True]} |",
                f"| JSON | {fmt(rates[False], 1)} | {fmt(p50[False], 1)} | {errors[False]} |",
                "",
                *wasm_lines,
                "Commands (PORT filled in by the runner; the filter's registry, keys and tenants "
                "made by the suite in a temporary folder):",
                "",
                "```",
                contender.display(),
                f"seedance serve --engine synthetic --synthetic-tokens-per-s {PACE} --config "
                "seedance.toml --module-registry registry --module-trust modules.key.pub "
                "--port PORT",
                f"seedance bench ws://127.0.0.1:PORT/v2/infer --api-key KEY -c {STREAMS} "
                "--max-tokens 64 -d 12",
                "```",
                "",
            ]
        )
    )
