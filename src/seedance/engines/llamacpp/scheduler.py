"""The decode loop: continuous batching of many requests in one llama.cpp context.

One thread owns the context. Each step it builds one batch: the last sampled token of every
sequence that is generating, then prompt chunks of sequences being prefilled, the shortest
rest first, up to ``n_batch`` tokens, laid out in sequence order; it calls ``llama_decode``
once, samples each sequence that has logits. The step's text goes to the event loop in one
``call_soon_threadsafe`` just before the next ``llama_decode`` releases the GIL (after the
last step: at once), so the event loop handles it while the forward pass runs instead of
holding up the next batch (one stream: +1.3% tokens/s). Requests join and leave between
steps.

The context holds ``n_seq`` sequences ("slots"). A slot remembers which tokens its cells hold,
so a request whose prompt starts with those tokens (the next turn of a conversation) only
prefills the rest. When no slot is free, a request waits; when a request needs a slot, it takes
the free one sharing the longest prefix with its prompt (at least 64 tokens), else the lowest
free one with nothing to save, else the lowest: the running sequences' ids stay together.
Before a slot's cells are overwritten, its state is saved to a host-memory cache (bounded in
bytes, see :class:`StateCache`) from which a later turn of that conversation restores it. A
request whose prompt begins like a running sequence's cells (two conversations under one
system prompt at once) gets a copy of them (saved and loaded: a fiftieth of a prefill's cost
per token) instead of prefilling that prefix again; one that begins like a prompt still being
prefilled (the two arrived together) waits for that prefill to pass the shared part, then
copies it. Reuse is by exact token prefix, so a reused cell always holds what a fresh prefill
would compute.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from seedance.engines.base import SamplingParams
from seedance.engines.batching import BatchJob, DecodeLoop
from seedance.engines.grammar import mask_logits
from seedance.engines.llamacpp.native import LlamaContext, LlamaModel, Sampler, State
from seedance.engines.logprobs import Logprobs

logger = logging.getLogger(__name__)

_MIN_SAVED_TOKENS = 64  # shorter states are cheaper to prefill again than to keep
#: Saving a sequence's cells costs about this many times less per token than prefilling them
#: (2 cores: 174 tokens saved in 2.7 ms, 46 prefilled in 145 ms; 50 leaves a wide margin).
_SAVE_PER_PREFILL = 50


class Job(BatchJob):
    """One request inside the decode thread."""

    __slots__ = ("fed", "last", "sampler", "shared", "slot", "source")

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        limit: int,
        seed: int,
        sink: Any,
        model: LlamaModel,
    ):
        super().__init__(prompt, params, limit, sink)
        self.sampler = Sampler(
            temperature=params.temperature,
            top_p=params.top_p,
            seed=seed,
            vocab_size=model.vocab_size,
            banned=model.eog_tokens if params.ignore_eos else (),
        )
        self.slot: Slot | None = None
        self.fed = 0  # prompt tokens in the slot's cells
        self.last = -1  # the last sampled token, decoded in the next step
        #: The slot of a job prefilling the start of this one's prompt (``shared`` tokens of
        #: it): this one feeds nothing until those cells are there, then copies them.
        self.source: Slot | None = None
        self.shared = 0

    def close(self) -> None:
        self.sampler.close()


@dataclass(slots=True, eq=False)
class Slot:
    """A sequence of the context and the tokens its cells hold (positions 0..n-1)."""

    seq: int
    tokens: list[int]
    job: Job | None = None


class StateCache:
    """Saved sequence states (KV cells) in host memory, bounded in bytes.

    When full, it drops the least recently saved state that holds no more tokens of its own
    than it shares with another saved state (another conversation under its system prompt:
    the prefix stays, a restore cuts that other state to it), and only when every state is
    mostly its own, the least recently saved. Plain LRU dropped a system prompt's last state
    while keeping several conversations under another prompt, so a fleet of conversations
    over many system prompts kept prefilling them again.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[int, tuple[list[int], State]] = OrderedDict()
        self._next = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tokens: list[int], state: State) -> None:
        if len(state) > self.max_bytes:
            return
        self._next += 1
        self._entries[self._next] = (tokens, state)
        self.bytes += len(state)
        while self.bytes > self.max_bytes:
            self.take(self._victim())

    def _victim(self) -> int:
        """The entry to drop (see the class): entries share the most with their neighbours
        in sorted order, so ``n log n`` comparisons find each one's longest shared prefix."""
        ordered = sorted(self._entries, key=lambda key: self._entries[key][0])
        shared = dict.fromkeys(ordered, 0)
        for a, b in itertools.pairwise(ordered):
            n = common_prefix(self._entries[a][0], self._entries[b][0])
            shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
        for key, (tokens, _) in self._entries.items():  # least recently saved first
            if len(tokens) - shared[key] <= shared[key]:
                return key
        return next(iter(self._entries))

    def best(self, prompt: list[int]) -> tuple[int, int]:
        """The entry sharing the longest prefix with ``prompt``: ``(key, length)``."""
        best_key, best_len = -1, 0
        for key, (tokens, _) in self._entries.items():
            n = common_prefix(tokens, prompt)
            if n > best_len:
                best_key, best_len = key, n
        return best_key, best_len

    def take(self, key: int) -> tuple[list[int], State]:
        tokens, state = self._entries.pop(key)
        self.bytes -= len(state)
        return tokens, state


def _kept(pair: tuple[Slot, int]) -> int:
    return pair[1]


def _worth_its_prefix(slot: Slot, keep: int) -> bool:
    """Whether a free slot is worth taking for the ``keep`` tokens it shares with a prompt
    (fewer than :data:`_MIN_SAVED_TOKENS`: a chat template's opening, a system prompt) when no
    sequence runs: its other cells are saved first when worth keeping, which must cost less
    than prefilling the shared ones."""
    rest = len(slot.tokens) - keep
    return keep > 0 and (rest < _MIN_SAVED_TOKENS or rest <= keep * _SAVE_PER_PREFILL)


def _cheapest(pair: tuple[Slot, int]) -> tuple[bool, int]:
    """Taking this free slot saves its cells first (see ``_evict``); then its id."""
    slot, keep = pair
    return len(slot.tokens) - keep >= _MIN_SAVED_TOKENS, slot.seq


def _rest(job: Job) -> int:
    """The prompt tokens ``job`` has yet to prefill."""
    return len(job.prompt) - job.fed


def _seq_of(entry: tuple[Job, list[int]]) -> int:
    slot = entry[0].slot
    assert slot is not None
    return slot.seq


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (slice compares run in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class Scheduler(DecodeLoop):
    """The llama.cpp decode loop over the context's sequences ("slots")."""

    thread_name = "llamacpp-decode"
    flushes_in_step = True
    _active: list[Job]  # type: ignore[assignment]
    _waiting: list[Job]  # type: ignore[assignment]

    def __init__(
        self,
        model: LlamaModel,
        context: LlamaContext,
        *,
        state_cache_bytes: int,
        reuse: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.ctx = context
        self._slots = [Slot(seq, []) for seq in range(context.shape.n_seq)]
        self.cache = StateCache(state_cache_bytes)
        self._reuse = reuse  # off: every prompt is prefilled whole (for measurements)
        self._n_batch = context.shape.n_batch
        self.logprobs = Logprobs(model.piece, model.token_text)

    def _release(self, job: BatchJob) -> None:
        job.close()
        assert isinstance(job, Job)
        slot = job.slot
        if slot is not None:
            slot.job = None
            job.slot = None

    def cells_in_use(self) -> int:
        """KV cells holding tokens (read from another thread: a moment's figure)."""
        return sum(len(slot.tokens) for slot in self._slots)

    def _shutdown(self) -> None:
        for slot in self._slots:
            if slot.job is not None:
                slot.job.close()

    # -- slots -------------------------------------------------------------------------------

    def _admit(self) -> None:
        """Give waiting jobs a free slot, reusing cached cells where the prompt allows."""
        while self._waiting:
            free = [s for s in self._slots if s.job is None]
            if not free:
                return
            job = self._waiting[0]  # stays listed until placed: a failure here reaches it
            prompt = job.prompt
            # The free slot holding the longest prefix of the prompt when it is worth keeping
            # (the next turn of its conversation), or when nothing runs and it shares a short
            # one (a chat template's opening: at one stream, an empty slot cost a new
            # conversation 1.9x the first-token time of one that reused its opening).
            # Otherwise the lowest free one whose cells need no saving, else the lowest: the
            # running sequences keep consecutive ids (llama.cpp decodes a run of consecutive
            # sequences in one pass: 4 streams spread over 8 slots ran at 0.8x llama-server),
            # and a first turn does not wait for a long conversation to be saved when an empty
            # slot is there.
            kept = [(s, common_prefix(s.tokens, prompt)) for s in free]
            slot, keep = max(kept, key=_kept)
            short = keep < _MIN_SAVED_TOKENS
            if short and (self._active or not _worth_its_prefix(slot, keep)):
                slot, keep = min(kept, key=_cheapest)
            if not self._reuse:
                keep = 0
            cached_key, cached_len = self.cache.best(prompt)
            running, shared = self._running_prefix(prompt) if self._reuse else (None, 0)
            source, coming = self._prefilling_prefix(prompt) if self._reuse else (None, 0)
            if coming > max(keep, cached_len, shared):  # it arrived with one that begins so
                slot, keep = self._fresh(free), 0
                job.source, job.shared = source, min(coming, len(prompt) - 1)
            elif shared > max(keep, cached_len):  # a running sequence begins the same way
                assert running is not None  # its cells, cut to the shared prefix below
                state = self.ctx.save_state(running.seq)
                slot = self._fresh(free)
                loaded = self._load(slot, list(running.tokens), state)
                keep = shared if loaded else 0
                self.stats.states_shared += int(loaded)
            elif cached_len > keep:  # a saved conversation beats what the slots hold
                tokens, state = self.cache.take(cached_key)  # before _evict adds to the cache
                slot = self._fresh(free)
                loaded = self._load(slot, tokens, state)
                keep = cached_len if loaded else 0
                self.stats.states_restored += int(loaded)
            elif keep < len(slot.tokens):
                self._evict(slot, keep)
            keep = min(keep, len(prompt) - 1)  # decode at least one token for the logits
            if keep < len(slot.tokens):
                self.ctx.forget(slot.seq, keep)
                del slot.tokens[keep:]
            slot.job, job.slot, job.fed = job, slot, keep
            self._waiting.pop(0)
            self._active.append(job)
            stats = self.stats
            stats.requests_started += 1
            stats.prompt_tokens += len(prompt)
            stats.prompt_tokens_reused += keep
            stats.prompt_tokens_prefilled += len(prompt) - keep

    def _fresh(self, free: list[Slot]) -> Slot:
        """The cheapest of the ``free`` slots, its cells gone (saved first when worth
        keeping)."""
        slot, _ = min(((s, 0) for s in free), key=_cheapest)
        self._evict(slot)
        return slot

    def _load(self, slot: Slot, tokens: list[int], state: State) -> bool:
        """Put saved cells (``state``, holding ``tokens``) into ``slot``, which holds none;
        whether they loaded."""
        loaded = self.ctx.load_state(slot.seq, state)  # a state this context saved always loads
        if loaded:
            slot.tokens = tokens
        else:  # pragma: no cover
            self.ctx.forget(slot.seq)
        return loaded

    def _running_prefix(self, prompt: list[int]) -> tuple[Slot | None, int]:
        """The running sequence whose cells share the longest prefix with ``prompt`` (another
        conversation under the same system prompt, running now), and that length, when
        copying its cells is worth it: at least :data:`_MIN_SAVED_TOKENS` shared, and its
        cells, copied twice (saved, then loaded), cost less than prefilling the shared ones."""
        best, best_len = None, 0
        for slot in self._slots:
            if slot.job is None:
                continue
            n = common_prefix(slot.tokens, prompt)
            if n > best_len and len(slot.tokens) * 2 <= n * _SAVE_PER_PREFILL:
                best, best_len = slot, n
        return (best, best_len) if best_len >= _MIN_SAVED_TOKENS else (None, 0)

    def _prefilling_prefix(self, prompt: list[int]) -> tuple[Slot | None, int]:
        """The sequence still prefilling the start of ``prompt`` (its request arrived at about
        the same time, under the same system prompt), and how many tokens of it they share,
        when its cells do not hold them yet and copying them will be worth it (as for
        :meth:`_running_prefix`)."""
        best: Slot | None = None
        best_len = 0
        for job in self._active:
            slot = job.slot
            if job.source is not None or slot is None or job.fed == len(job.prompt):
                continue
            n = common_prefix(job.prompt, prompt)
            if n > max(best_len, len(slot.tokens)) and len(job.prompt) <= n * _SAVE_PER_PREFILL:
                best, best_len = slot, n
        return (best, best_len) if best_len >= _MIN_SAVED_TOKENS else (None, 0)

    def _follow(self) -> None:
        """Give each job that waits for another's prefill (see :meth:`_prefilling_prefix`)
        that sequence's cells once they hold the shared prefix; one whose sequence will not
        (its job left, or was placed elsewhere) prefills its prompt itself."""
        for job in self._active:
            source, slot = job.source, job.slot
            if source is None or slot is None:
                continue
            shared = job.shared
            if len(source.tokens) < shared or source.tokens[:shared] != job.prompt[:shared]:
                owner = source.job
                if (
                    owner is None
                    or owner.source is not None
                    or owner.fed == len(owner.prompt)
                    or owner.prompt[:shared] != job.prompt[:shared]
                ):
                    job.source = None  # nothing there will prefill it: on its own
                continue
            job.source = None  # its slot holds nothing: it has fed nothing since _fresh
            if not self._load(slot, list(source.tokens), self.ctx.save_state(source.seq)):
                continue  # pragma: no cover
            self.ctx.forget(slot.seq, shared)
            del slot.tokens[shared:]
            job.fed = shared
            stats = self.stats
            stats.states_shared += 1
            stats.prompt_tokens_reused += shared
            stats.prompt_tokens_prefilled -= shared

    def _evict(self, slot: Slot, keep: int = 0) -> None:
        """About to overwrite ``slot`` from ``keep`` on: save a conversation worth keeping."""
        if (
            len(slot.tokens) - keep >= _MIN_SAVED_TOKENS
            and self.cache.max_bytes > 0
            and self.ctx.state_size(slot.seq) <= self.cache.max_bytes
        ):
            self.cache.put(list(slot.tokens), self.ctx.save_state(slot.seq))
            self.stats.states_saved += 1
        if keep == 0:
            self.ctx.forget(slot.seq)
            slot.tokens = []

    # -- one step ----------------------------------------------------------------------------

    def _step(self) -> None:
        self._follow()
        # What each job feeds: its last sampled token, or the next chunk of its prompt while
        # the batch has room. Prompts go the shortest rest first (then in admission order):
        # one that needs a few tokens (a turn whose history is cached) does not wait behind
        # the whole prefill of a long one, which loses a few tokens of a step. One waiting for
        # another's prefill of its prefix feeds nothing.
        fed: list[tuple[Job, list[int]]] = [
            (job, [job.last]) for job in self._active if job.fed == len(job.prompt)
        ]
        decoding = len(fed)
        budget = self._n_batch - decoding
        prefilling = [j for j in self._active if j.fed < len(j.prompt) and j.source is None]
        for job in sorted(prefilling, key=_rest):
            if budget <= 0:
                break
            chunk = job.prompt[job.fed : job.fed + budget]
            fed.append((job, chunk))
            budget -= len(chunk)
        # llama.cpp runs a batch over separate sequence caches as micro-batches of sequences
        # with consecutive ids, taken in batch order. In sequence order a step is one forward
        # pass where it can be; in admission order it was up to one pass per sequence (8
        # streams: 0.7x the tokens/s of llama-server).
        fed.sort(key=_seq_of)
        ctx = self.ctx
        ctx.clear_batch()
        sampled: list[tuple[Job, int]] = []
        for job, tokens in fed:
            index = self._add(job, tokens)
            if index is not None:
                sampled.append((job, index))
        self.batch_shape = (decoding, len(fed) - decoding, ctx.n_tokens)
        self._flush()  # the previous step's text, while llama_decode runs without the GIL
        rc = ctx.decode()
        self.stats.steps += 1
        if rc != 0:
            self._recover(rc, fed)
            return
        self._commit(fed)
        self._sample(sampled)

    def _commit(self, fed: list[tuple[Job, list[int]]]) -> None:
        for job, tokens in fed:
            slot = job.slot
            assert slot is not None
            slot.tokens.extend(tokens)
            if job.fed < len(job.prompt):
                job.fed += len(tokens)

    def _recover(self, rc: int, fed: list[tuple[Job, list[int]]]) -> None:
        """A batch failed: retry each job alone, so one bad request fails only itself."""
        logger.warning("llama_decode returned %d for a batch of %d request(s)", rc, len(fed))
        ctx = self.ctx
        for job, _ in fed:  # a failed decode may leave some cells behind: drop them
            slot = job.slot
            assert slot is not None
            ctx.forget(slot.seq, len(slot.tokens))
        for job, tokens in fed:
            slot = job.slot
            assert slot is not None
            ctx.clear_batch()
            index = self._add(job, tokens)
            code = ctx.decode()
            if code != 0:
                ctx.forget(slot.seq, len(slot.tokens))
                self._fail(job, f"llama.cpp failed to decode (code {code})")
                continue
            self._commit([(job, tokens)])
            if index is not None:
                self._sample([(job, index)])

    def _add(self, job: Job, tokens: list[int]) -> int | None:
        """Put ``tokens`` of ``job`` into the batch after its cells; the batch index of the
        logits to sample, when these tokens end its prompt (or are its last sampled token)."""
        slot = job.slot
        assert slot is not None
        pos, last = len(slot.tokens), len(tokens) - 1
        ends = job.fed + len(tokens) >= len(job.prompt)
        index = 0
        for i, token in enumerate(tokens):
            index = self.ctx.add(token, pos + i, slot.seq, ends and i == last)
        return index if ends else None

    def _sample(self, sampled: list[tuple[Job, int]]) -> None:
        """Sample each job's next token from the logits at its batch index.

        A job bound to a schema samples first as if it were free: a token its grammar accepts
        is kept (most of them: no mask is computed); one it refuses sends the job to the
        masked logits to sample again (llama.cpp's own server checks its grammar the same way).
        That is rejection sampling over the tokens the grammar accepts, so what is kept is
        always valid for the schema. It is not the same draw as masking first: llguidance's
        mask also leaves out tokens that spell text the schema forces in a way the tokenizer
        would not (``":`` then ``"`` where ``":"`` is one token), which the check accepts; the
        model's own choice among valid spellings stands. Measured (benchmarks.grammar_mask,
        docs/engines.md): at 8 streams 1.2 ms of grammar work per step against 2.6 ms when
        every row is masked.
        """
        ctx, model = self.ctx, self.model
        # Log probabilities come from the raw logits: read before a mask changes them.
        summaries = {
            job: self.logprobs.summary(ctx.logits(index), job.top)
            for job, index in sampled
            if job.top is not None
        }
        kept: list[tuple[Job, int, int]] = []
        refused: list[tuple[Job, int]] = []
        for job, index in sampled:
            try:
                token = ctx.sample(job.sampler, index)
            except Exception as exc:  # one request's failure must not stop the others
                logger.exception("sampling failed")
                self._fail(job, f"sampling failed: {exc!r}")
                continue
            if self._fits(job, token):
                kept.append((job, index, token))
            else:
                refused.append((job, index))
        if refused:
            rows = self._masks([job for job, _ in refused], model.vocab_size)
            for row, (job, index) in zip(rows, refused, strict=True):
                mask_logits(ctx.logits(index), row)
                token = ctx.sample(job.sampler, index)
                if self._fits(job, token):
                    kept.append((job, index, token))
                else:  # the mask allowed it: llguidance disagrees with itself
                    self._fail(job, "the reply left its schema")
        for job, index, token in kept:
            if job.logprobs is not None:  # a kept token is never one a mask set to -inf
                logit = float(ctx.logits(index)[token])
                job.logprobs.append(self.logprobs.entry(summaries[job], token, logit))
            if self._take(job, token, None if model.is_eog(token) else model.piece(token)):
                job.last = token
