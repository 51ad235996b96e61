"""The ``transformers`` engine: continuous batching of a transformers model in one thread.

transformers has its own continuous batching manager (``model.init_continuous_batching``), but
it draws from one random generator for the whole batch, so a request's seed could not decide
its text, and with transformers 5.24 on the CPU it stalled after the first token. This engine
runs its own loop on the model's plain forward pass instead:

- each step first prefills the prompts that arrived (together, left-padded, one forward pass,
  at most ``PREFILL_TOKENS`` padded tokens), samples their first tokens, and adds their rows to
  the batch (:class:`~seedance.engines.hf.batch.PaddedBatch`);
- then decodes one token for every row in one forward pass;
- each request samples with its own seeded generator (greedy at temperature 0), so the same
  seed gives the same text whatever else runs.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Final

import torch
from llguidance.hf import from_tokenizer as llguidance_tokenizer

from seedance.engines.base import (
    ModelInfo,
    SamplingParams,
)
from seedance.engines.batching import BatchedEngine, BatchJob, DecodeLoop
from seedance.engines.grammar import forbidden
from seedance.engines.hf.batch import PaddedBatch, check_cache
from seedance.engines.hf.loader import Loaded, load, stop_tokens, token_pieces, tokenizer_prompts
from seedance.engines.local import context_per_sequence, machine_cores
from seedance.engines.logprobs import Logprobs

logger = logging.getLogger(__name__)

#: Most padded prompt tokens prefilled in one forward pass (a longer prompt goes alone).
PREFILL_TOKENS: Final = 2048


def output_cache(out: Any) -> Any:
    """The cache a forward pass returned (``cache`` in transformers 5, ``past_key_values``
    before)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else out.past_key_values


class TorchJob(BatchJob):
    """One request inside the decode thread, with its own random generator."""

    __slots__ = ("generator", "ignore_eos", "last", "temperature", "top_p")

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        limit: int,
        seed: int,
        sink: Any,
        device: torch.device,
    ) -> None:
        super().__init__(prompt, params, limit, sink)
        self.temperature = params.temperature
        self.top_p = params.top_p
        self.ignore_eos = params.ignore_eos
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.last = -1  # the last sampled token, decoded in the next step


class TorchLoop(DecodeLoop):
    """Prefill arrivals, then decode one token for every row, in one thread."""

    thread_name = "transformers-decode"
    _active: list[TorchJob]  # type: ignore[assignment]
    _waiting: list[TorchJob]  # type: ignore[assignment]

    def __init__(self, loaded: Loaded, parallel: int) -> None:
        super().__init__()
        self.model = loaded.model
        self.device = loaded.device
        self.parallel = parallel
        self.pieces = token_pieces(loaded.tokenizer)
        self.stops = stop_tokens(loaded)
        tokenizer = loaded.tokenizer
        self.logprobs = Logprobs(
            lambda token: self.pieces[token] if token < len(self.pieces) else b"",
            lambda token: tokenizer.convert_ids_to_tokens(token) or "",
        )
        pad = loaded.tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0
        self.batch = PaddedBatch()
        # transformers 5 names the cache argument ``cache``; 4.x ``past_key_values``.
        parameters = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"

    def _compact(self) -> None:
        batch = self.batch
        rows = [i for i, job in enumerate(batch.owners) if not job.done]
        batch.keep(rows)

    def _admit(self) -> None:
        self._compact()
        taken: list[TorchJob] = []
        longest = 0
        while self._waiting and len(self._active) + len(taken) < self.parallel:
            longest = max(longest, len(self._waiting[0].prompt))
            if taken and longest * (len(taken) + 1) > PREFILL_TOKENS:
                break
            taken.append(self._waiting.pop(0))
        if taken:
            self._prefill(taken)

    @torch.inference_mode()
    def _prefill(self, jobs: list[TorchJob]) -> None:
        width = max(len(job.prompt) for job in jobs)
        ids = torch.full((len(jobs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(jobs), width), dtype=torch.long)
        for row, job in enumerate(jobs):
            n = len(job.prompt)
            ids[row, width - n :] = torch.tensor(job.prompt, dtype=torch.long)
            mask[row, width - n :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
            )
        except Exception as exc:  # these requests fail; the batch goes on
            logger.exception("prefill failed")
            for job in jobs:
                self._fail(job, f"prefill failed: {exc!r}")
            return
        stats = self.stats
        stats.steps += 1
        for job in jobs:
            stats.requests_started += 1
            stats.prompt_tokens += len(job.prompt)
            stats.prompt_tokens_prefilled += len(job.prompt)
        self._active.extend(jobs)
        lengths = mask.sum(-1)
        self.batch.join(output_cache(out), mask, lengths, list(jobs))
        self._sample(out.logits[:, -1, :], jobs)

    @torch.inference_mode()
    def _step(self) -> None:
        batch = self.batch
        jobs: list[TorchJob] = list(batch.owners)
        if not jobs or batch.mask is None or batch.positions is None:
            return
        ids = torch.tensor([[job.last] for job in jobs], dtype=torch.long, device=self.device)
        mask = torch.cat([batch.mask, batch.mask.new_ones((len(jobs), 1))], dim=1)
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=batch.positions[:, None],
                use_cache=True,
                **{self.cache_arg: batch.cache},
            )
        except Exception as exc:  # the batch's cache is suspect: fail its requests, go on
            logger.exception("decode step failed")
            for job in jobs:
                self._fail(job, f"decode failed: {exc!r}")
            batch.clear()
            return
        self.stats.steps += 1
        batch.advance(mask)
        self._sample(out.logits[:, -1, :], jobs)
        self._compact()

    def _sample(self, logits: torch.Tensor, jobs: list[TorchJob]) -> None:
        logits = logits.float()
        # Log probabilities come from the raw logits: read before a mask changes them.
        summaries = {
            row: self.logprobs.summary(logits[row].cpu().numpy(), job.top)
            for row, job in enumerate(jobs)
            if job.top is not None and not job.done
        }
        bound = [row for row, job in enumerate(jobs) if job.grammar is not None and not job.done]
        if bound:  # the tokens a schema forbids, out of its rows
            vocab = logits.shape[-1]
            masks = self._masks([jobs[row] for row in bound], vocab)
            for row, mask in zip(bound, masks, strict=True):
                forbid = torch.from_numpy(forbidden(mask, vocab)).to(logits.device)
                logits[row].masked_fill_(forbid, float("-inf"))
        endless = [row for row, job in enumerate(jobs) if job.ignore_eos and not job.done]
        if endless and self.stops:  # ignore_eos: the end tokens are never drawn
            stops = torch.tensor(sorted(self.stops), device=logits.device)
            for row in endless:
                logits[row].index_fill_(0, stops, float("-inf"))
        greedy = logits.argmax(dim=-1).tolist()
        for row, job in enumerate(jobs):
            if job.done:
                continue
            try:
                token = greedy[row] if job.temperature <= 0 else self._draw(logits[row], job)
                if job.logprobs is not None:  # a sampled token is never one a mask forbade
                    entry = self.logprobs.entry(summaries[row], token, float(logits[row, token]))
                    job.logprobs.append(entry)
                if not self._fits(job, token):  # its mask allowed it: llguidance disagrees
                    self._fail(job, "the reply left its schema")
                    continue
                piece = None if token in self.stops else self.pieces[token]
                if self._take(job, token, piece):
                    job.last = token
            except Exception as exc:  # one request's failure must not stop the others
                logger.exception("sampling failed")
                self._fail(job, f"sampling failed: {exc!r}")

    @staticmethod
    def _draw(logits: torch.Tensor, job: TorchJob) -> int:
        probs = torch.softmax(logits / job.temperature, dim=-1)
        if job.top_p >= 1.0:
            return int(torch.multinomial(probs, 1, generator=job.generator))
        ordered, order = probs.sort(descending=True)
        # Keep the smallest set of tokens whose probability reaches top_p (at least one).
        ordered[(ordered.cumsum(0) - ordered) >= job.top_p] = 0.0
        return int(order[torch.multinomial(ordered, 1, generator=job.generator)])

    def _shutdown(self) -> None:
        self.batch.clear()


class TransformersEngine(BatchedEngine):
    """A transformers causal LM, batched by :class:`TorchLoop`."""

    loop: TorchLoop

    def __init__(
        self,
        *,
        model_path: Path,
        name: str,
        device: str = "auto",
        parallel: int = 8,
        n_ctx: int = 0,
        threads: int = 0,
        chat_template: str | None = None,
    ) -> None:
        self.loaded = loaded = load(model_path, device, threads or machine_cores())
        config = loaded.model.config.get_text_config()
        trained = int(getattr(config, "max_position_embeddings", 0) or 4096)
        context = context_per_sequence(n_ctx, parallel, trained)
        self.max_concurrency = parallel
        self._info = ModelInfo(
            name=name,
            engine="transformers",
            context_length=context,
            max_output_tokens=context,
            version=Path(model_path).name,
        )
        self._use_prompts(tokenizer_prompts(loaded.tokenizer, context, chat_template))
        vocab = int(config.vocab_size)  # the logits' width (the tokenizer's may be less)
        self._use_grammars(lambda: llguidance_tokenizer(loaded.tokenizer, n_vocab=vocab))
        self.loop = TorchLoop(loaded, parallel)
        self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One forward pass: the first request does not pay for it, and the cache is checked."""
        ids = torch.tensor([self.prompts.encode("hello", True) or [0]], device=self.loaded.device)
        check_cache(output_cache(self.loaded.model(input_ids=ids, use_cache=True)))

    def kv_cache_usage(self) -> float:
        batch = self.loop.batch  # read from another thread: a moment's figure
        return len(batch) * batch.columns / (self.max_concurrency * self._info.context_length)

    def _job(
        self, prompt: list[int], params: SamplingParams, limit: int, seed: int, sink: Any
    ) -> TorchJob:
        return TorchJob(prompt, params, limit, seed, sink, self.loaded.device)
