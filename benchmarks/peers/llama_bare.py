"""The physical limit of the llama.cpp engine: llama.cpp driven by a bare loop, no server.

Two measurements, each printed as one JSON line:

- ``generate``: one sequence, prefill then sample-and-decode ``--tokens`` tokens (end-of-text
  ignored), as any generation does; tokens/s of the decode (the first token excluded);
- ``batch``: ``--sequences`` sequences decoded together, ``--steps`` steps of one token each with
  logits but no sampling: llama.cpp's batched decode alone;
- ``prefill``: a prompt of ``--tokens`` tokens in batches of 512, in a context that prefilled
  it once already: prefill tokens/s.

``--repack on|off`` chooses llama.cpp's weight layout (default off: the layout every CPU runs).

    python -m benchmarks.peers.llama_bare generate --tokens 200 --threads 2
    python -m benchmarks.peers.llama_bare batch --sequences 8 --steps 40 --threads 2
    python -m benchmarks.peers.llama_bare prefill --tokens 1024 --threads 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from seedance.engines.llamacpp.engine import model_template
from seedance.engines.llamacpp.native import ContextShape, LlamaContext, LlamaModel, Sampler
from seedance.engines.local import default_model_path, machine_cores
from seedance.protocol.messages import ChatMessage

PROMPT = "Write a long story about a dragon who learns to sail."


def _prompt(model: LlamaModel, text: str) -> list[int]:
    rendered = model_template(model).render([ChatMessage("user", text)], add_generation_prompt=True)
    return model.tokenize(rendered, special=True)


def generate(model: LlamaModel, threads: int, tokens: int, temperature: float) -> dict[str, float]:
    ctx = LlamaContext(model, ContextShape(n_seq=1, n_ctx_seq=4096, n_batch=512, threads=threads))
    sampler = Sampler(temperature=temperature, top_p=1.0, seed=1)
    prompt = _prompt(model, PROMPT)
    start = time.perf_counter()
    for i, token in enumerate(prompt):
        index = ctx.add(token, i, 0, i == len(prompt) - 1)
    assert ctx.decode() == 0
    token = ctx.sample(sampler, index)
    first = time.perf_counter()
    pos = len(prompt)
    for _ in range(tokens - 1):
        ctx.clear_batch()
        ctx.add(token, pos, 0, True)
        assert ctx.decode() == 0
        token = ctx.sample(sampler, 0)
        model.piece(token)  # the text a server would send
        pos += 1
    end = time.perf_counter()
    sampler.close()
    ctx.close()
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": first - start,
        "decode_tokens_per_s": (tokens - 1) / (end - first),
    }


def batch(model: LlamaModel, threads: int, sequences: int, steps: int) -> dict[str, float]:
    shape = ContextShape(n_seq=sequences, n_ctx_seq=1024, n_batch=512, threads=threads)
    ctx = LlamaContext(model, shape)
    prompt = _prompt(model, PROMPT)
    for seq in range(sequences):
        for i, token in enumerate(prompt):
            ctx.add(token, i, seq, i == len(prompt) - 1)
    assert ctx.decode() == 0
    token = prompt[-1]
    start = time.perf_counter()
    for step in range(steps):
        ctx.clear_batch()
        for seq in range(sequences):
            ctx.add(token, len(prompt) + step, seq, True)
        assert ctx.decode() == 0
    elapsed = time.perf_counter() - start
    ctx.close()
    return {"sequences": sequences, "tokens_per_s": sequences * steps / elapsed}


def prefill(model: LlamaModel, threads: int, tokens: int) -> dict[str, float]:
    shape = ContextShape(n_seq=1, n_ctx_seq=tokens + 16, n_batch=512, threads=threads)
    ctx = LlamaContext(model, shape)
    words = model.tokenize(f"{PROMPT} " * (tokens // 4 + 1), special=False)[:tokens]
    for _warm in (True, False):  # the first pass sets the context up; the second is timed
        ctx.forget(0)
        start = time.perf_counter()
        for begin in range(0, tokens, 512):
            ctx.clear_batch()
            chunk = words[begin : begin + 512]
            for i, token in enumerate(chunk):
                ctx.add(token, begin + i, 0, begin + i == tokens - 1)
            assert ctx.decode() == 0
        elapsed = time.perf_counter() - start
    ctx.close()
    return {"prompt_tokens": tokens, "prefill_s": elapsed, "tokens_per_s": tokens / elapsed}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("generate", "batch", "prefill"))
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repack", choices=("on", "off"), default="off")
    args = parser.parse_args(argv)
    model = LlamaModel(args.model_path or default_model_path(), repack=args.repack == "on")
    threads = args.threads or machine_cores()
    if args.mode == "generate":
        result = generate(model, threads, args.tokens, args.temperature)
    elif args.mode == "batch":
        result = batch(model, threads, args.sequences, args.steps)
    else:
        result = prefill(model, threads, args.tokens)
    model.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
