"""What binding a reply to a JSON Schema costs per token, with each way of doing it.

A bare decode loop over the embedded SmolLM2 (no server), ``--streams`` sequences decoded
together for ``--tokens`` steps, greedy, each reply bound to ``benchmarks/risk_schema.json``
(12 fields, nested) by one of:

- ``none``: no schema (the floor);
- ``llguidance``: the llamacpp engine's own path (:mod:`seedance.engines.grammar`): each
  sequence samples as if free and keeps a token its grammar allows; the step's sequences whose
  token it forbade get their masks computed together, set to -inf in their logits, and sample
  again (rejection sampling);
- ``masked``: llguidance as the transformers engine uses it: every bound row's mask computed
  (together) and applied before sampling;
- ``gbnf``: llama.cpp's grammar sampler in each sequence's sampler chain, from the GBNF that
  llama-cpp-python writes for the schema (what ``llama-server`` uses for ``json_schema``).

Prints, per mode, tokens/s, the milliseconds a step spends on the grammar (checks and masks)
and on llama.cpp's sampling (the grammar sampler's work, for ``gbnf``; a step samples one token
per stream), and the rows masked, as JSON lines, and the CPU:

    python -m benchmarks.grammar_mask --streams 1
    python -m benchmarks.grammar_mask --streams 8
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import llama_cpp as lc
from llama_cpp.llama_grammar import json_schema_to_gbnf

from benchmarks.harness import cpu
from seedance.engines.grammar import Grammars, Masks, mask_logits
from seedance.engines.llamacpp.engine import grammar_vocabulary, model_template
from seedance.engines.llamacpp.native import ContextShape, LlamaContext, LlamaModel, Sampler
from seedance.engines.local import default_model_path, machine_cores
from seedance.protocol.messages import ChatMessage
from seedance.protocol.schemas import output_schema

SCHEMA = Path(__file__).with_name("risk_schema.json")
PROMPT = "Describe a risky card payment as JSON."


def run(model: LlamaModel, mode: str, streams: int, tokens: int, threads: int) -> dict[str, Any]:
    schema = output_schema(json.loads(SCHEMA.read_text()), "schema")
    ctx = LlamaContext(model, ContextShape(streams, 1024, 512, threads))
    samplers = [Sampler(temperature=0.0, top_p=1.0, seed=s) for s in range(streams)]
    if mode == "gbnf":
        gbnf = json_schema_to_gbnf(schema.text).encode()
        for sampler in samplers:  # the grammar first, then the greedy pick
            chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
            lc.llama_sampler_chain_add(
                chain, lc.llama_sampler_init_grammar(model.vocab, gbnf, b"root")
            )
            lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
            sampler.close()
            sampler.ptr = chain
    matchers = []
    if mode in ("llguidance", "masked"):
        grammars = Grammars(lambda: grammar_vocabulary(model))
        matchers = [grammars.matcher(schema) for _ in range(streams)]
    masks = Masks()
    rendered = model_template(model).render(
        [ChatMessage("user", PROMPT)], add_generation_prompt=True
    )
    prompt = model.tokenize(rendered, special=True)
    ctx.clear_batch()
    index = [0] * streams
    for seq in range(streams):
        for pos, token in enumerate(prompt):
            index[seq] = ctx.add(token, pos, seq, pos == len(prompt) - 1)
    assert ctx.decode() == 0
    live, produced = list(range(streams)), [0] * streams
    grammar_s = sample_s = 0.0
    masked = 0  # rows masked (a sampled token the schema forbade)
    steps, start = 0, time.perf_counter()
    for step in range(tokens):
        picked: dict[int, int] = {}
        refused: list[int] = []
        if mode == "masked":  # a mask for every row first, then sampling
            t0 = time.perf_counter()
            rows = masks.fill([matchers[seq] for seq in live], model.vocab_size)
            for row, seq in zip(rows, live, strict=True):
                mask_logits(ctx.logits(index[seq]), row)
            grammar_s += time.perf_counter() - t0
            masked += len(live)
        for seq in live:
            t0 = time.perf_counter()
            token = ctx.sample(samplers[seq], index[seq])
            t1 = time.perf_counter()
            if matchers and matchers[seq].try_consume_tokens([token]) != 1:
                refused.append(seq)
            else:
                picked[seq] = token
            grammar_s, sample_s = grammar_s + time.perf_counter() - t1, sample_s + t1 - t0
        if refused:  # the engine's way: only a forbidden token costs a mask
            t0 = time.perf_counter()
            rows = masks.fill([matchers[seq] for seq in refused], model.vocab_size)
            for row, seq in zip(rows, refused, strict=True):
                mask_logits(ctx.logits(index[seq]), row)
                picked[seq] = token = ctx.sample(samplers[seq], index[seq])
                assert matchers[seq].try_consume_tokens([token]) == 1
            grammar_s += time.perf_counter() - t0
            masked += len(refused)
        sampled = {}
        for seq, token in picked.items():
            if model.is_eog(token) or (matchers and matchers[seq].is_stopped()):
                continue
            sampled[seq] = token
            produced[seq] += 1
        steps += 1
        live = sorted(sampled)
        if not live:
            break
        ctx.clear_batch()
        for seq in live:
            index[seq] = ctx.add(sampled[seq], len(prompt) + step, seq, True)
        assert ctx.decode() == 0
    elapsed = time.perf_counter() - start
    ctx.close()
    for sampler in samplers:
        sampler.close()
    return {
        "mode": mode,
        "streams": streams,
        "tokens": sum(produced),
        "tokens_per_s": round(sum(produced) / elapsed, 1),
        "grammar_ms_per_step": round(1000 * grammar_s / steps, 3),
        "sample_ms_per_step": round(1000 * sample_s / steps, 3),
        "rows_masked": masked,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--threads", type=int, default=machine_cores())
    parser.add_argument("--modes", default="none,llguidance,masked,gbnf")
    args = parser.parse_args(argv)
    model = LlamaModel(default_model_path())
    print(json.dumps({"cpu": cpu(), "threads": args.threads}))
    for mode in args.modes.split(","):
        print(json.dumps(run(model, mode, args.streams, args.tokens, args.threads)), flush=True)
    model.close()


if __name__ == "__main__":
    main()
