"""Suite 18 of ``make bench``: a load generator nobody here wrote. ``guidellm`` (the vLLM
project's benchmark tool, from PyPI, unchanged, in a virtual environment of its own: ``make
bench`` creates ``.venv-guidellm``; its dependencies would change ours) drives Seedance's OpenAI
API and llama.cpp's ``llama-server`` on the embedded SmolLM2 at 1, 4 and 8 concurrent streams.

guidellm makes its synthetic prompts with the model's tokenizer, exported here from the GGUF
(transformers reads it) into a folder it loads. Each contender gets the same guidellm command:
chat completions, streamed, 64 prompt tokens and up to 128 output tokens, each concurrency for
a fixed time. The contenders run in turn, the order reversed every other round.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.harness import Contender, fmt, ratio, servers, venv_version, verdict
from benchmarks.llama_suite import llama_server, seedance_llama

if TYPE_CHECKING:
    from benchmarks.harness import Report

#: Where ``make bench`` installs guidellm (override with ``GUIDELLM=/path/to/guidellm``).
GUIDELLM_DEFAULT = ".venv-guidellm/bin/guidellm"
STREAMS = (1, 4, 8)
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 128


def guidellm_executable() -> Path | None:
    path = Path(os.environ.get("GUIDELLM", GUIDELLM_DEFAULT))
    return path if path.exists() else None


def export_tokenizer(folder: Path) -> Path:
    """The embedded model's tokenizer, from its GGUF, as a folder guidellm can load."""
    from transformers import AutoTokenizer

    from seedance.engines.local import default_model_path

    model = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)
    tokenizer.save_pretrained(folder)
    return folder


def guidellm_argv(exe: Path, target: str, tokenizer: Path, seconds: int, out: Path) -> list[str]:
    """One guidellm run: every concurrency of :data:`STREAMS` against ``target``."""
    data = f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}"
    return [
        str(exe),
        "run",
        *("--backend", f"kind=openai_http,target={target}"),
        *("--profile", f"kind=concurrent,streams={STREAMS[0]}"),
        *("--override", "profile.streams", ",".join(map(str, STREAMS))),
        *("--constraint", f"kind=max_duration,seconds={seconds}"),
        *("--data", data),
        *("--tokenizer", f"kind=hf_auto,model={tokenizer}"),
        *("--output", f"kind=json,path={out}"),
        "--disable-console-interactive",
    ]


def figures(result: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Per concurrency: requests/s, output tokens/s, TTFT and ITL medians (ms), errors (the
    requests still running when the time was up, cut, are not errors)."""
    out = {}
    for benchmark in result["benchmarks"]:
        streams = int(benchmark["config"]["strategy"]["streams"])
        metrics = benchmark["metrics"]
        totals = metrics["request_totals"]
        out[streams] = {
            "requests_per_s": metrics["requests_per_second"]["successful"]["mean"],
            "tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
            "ttft_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
            "itl_ms": metrics["inter_token_latency_ms"]["successful"]["median"],
            "errors": float(totals.get("errored", 0)),
        }
    return out


def guidellm_suite(report: Report) -> None:
    exe = guidellm_executable()
    if exe is None:
        report.log("[18 guidellm] guidellm not found (make bench installs it): left out")
        report.sections.append(
            "## 18. guidellm\n\nLeft out: guidellm was not installed (`make bench` installs it "
            "in `.venv-guidellm`; or set `GUIDELLM=/path/to/guidellm`)."
        )
        return
    seconds = 10 if report.quick else 30
    contenders = [seedance_llama("Seedance", "seedance"), llama_server(report)]
    contenders = [_http(c) for c in contenders]
    runs: dict[str, list[dict[int, dict[str, float]]]] = {c.key: [] for c in contenders}
    with tempfile.TemporaryDirectory() as tmp, servers(contenders) as running:
        tokenizer = export_tokenizer(Path(tmp) / "tokenizer")
        for round_ in range(report.rounds):
            order = contenders if round_ % 2 == 0 else contenders[::-1]
            for contender in order:
                report.log(f"[18 guidellm] round {round_ + 1}: {contender.label}")
                target = running[contender.key].url.removesuffix("/v1")
                out = Path(tmp) / f"{contender.key}-{round_}.json"
                argv = guidellm_argv(exe, target, tokenizer, seconds, out)
                done = subprocess.run(argv, capture_output=True, text=True, check=False)
                if done.returncode != 0 or not out.exists():
                    raise RuntimeError(f"guidellm failed against {contender.label}: {done.stderr}")
                runs[contender.key].append(figures(json.loads(out.read_text())))
    _write(report, contenders, runs, venv_version(exe, "guidellm"), seconds)


def _http(contender: Contender) -> Contender:
    """The contender's OpenAI API (guidellm speaks HTTP)."""
    return dataclasses.replace(contender, path="/v1")


def _median(runs: list[dict[int, dict[str, float]]], streams: int, name: str) -> float:
    return statistics.median(run[streams][name] for run in runs if streams in run)


def _write(
    report: Report,
    contenders: list[Contender],
    runs: dict[str, list[dict[int, dict[str, float]]]],
    version: str,
    seconds: int,
) -> None:
    ours, theirs = runs["seedance"], runs["llama"]
    rows = []
    goal = True
    for streams in STREAMS:
        tps = _median(ours, streams, "tokens_per_s"), _median(theirs, streams, "tokens_per_s")
        rps = _median(ours, streams, "requests_per_s"), _median(theirs, streams, "requests_per_s")
        ttft = _median(ours, streams, "ttft_ms"), _median(theirs, streams, "ttft_ms")
        itl = _median(ours, streams, "itl_ms"), _median(theirs, streams, "itl_ms")
        errors = sum(r[streams]["errors"] for r in ours), sum(r[streams]["errors"] for r in theirs)
        goal = goal and tps[0] >= tps[1] and errors[0] == 0
        rows.append(
            f"| {streams} | {fmt(tps[0], 1)} / {fmt(tps[1], 1)} ({ratio(*tps)}) "
            f"| {fmt(rps[0], 2)} / {fmt(rps[1], 2)} | {fmt(ttft[0], 0)} / {fmt(ttft[1], 0)} "
            f"| {fmt(itl[0], 1)} / {fmt(itl[1], 1)} | {errors[0]:.0f} / {errors[1]:.0f} |"
        )
    report.goals.append(
        ("18. guidellm: at least llama-server's output tokens/s at 1, 4 and 8 streams", "", goal)
    )
    command = guidellm_argv(Path("guidellm"), "URL", Path("TOKENIZER"), seconds, Path("OUT.json"))
    report.sections.append(
        "\n".join(
            [
                "## 18. guidellm: a load generator nobody here wrote",
                "",
                f"`guidellm` {version} (PyPI, unchanged) against Seedance's OpenAI API and "
                "`llama-server` on the embedded SmolLM2, chat completions streamed, "
                f"{PROMPT_TOKENS} prompt tokens (guidellm's synthetic text, made with the "
                f"model's tokenizer) and up to {OUTPUT_TOKENS} output tokens, {seconds} s at "
                f"each concurrency, {report.rounds} rounds (medians). guidellm asks for exactly "
                f"{OUTPUT_TOKENS} tokens (`max_completion_tokens` with `ignore_eos: true`), "
                "which both servers honour. Output tokens/s, requests/s and the medians of TTFT "
                "and inter-token latency as guidellm measures them. "
                f"Goal: at least llama-server's output tokens/s at each: {verdict(goal)}.",
                "",
                "| streams | output tokens/s, Seedance / llama-server | requests/s | TTFT p50 ms "
                "| ITL p50 ms | errors |",
                "|---|---|---|---|---|---|",
                *rows,
                "",
                "Commands (PORT, URL and TOKENIZER filled in by the runner):",
                "",
                "```",
                *(c.display() for c in contenders),
                " ".join(command),
                "```",
            ]
        )
    )
