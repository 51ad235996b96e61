"""Gateway mode's routing by prefix, SLA and load: which upstream a request goes to.

**Policy.** An upstream may name the service classes it is kept for (``http://gpu:8000/v1#
critical+high``); one that names none serves every class. A request (its ``X-QoS-Priority``
class; ``normal`` without one) goes to an upstream that is up and names its class; when none
does, to one that names no class; when none of those is up either, to any that is up, rather
than to none. Among the candidates, the one with the lowest expected wait::

    score = p99 TTFT  x  (1 + requests in flight from here + requests waiting there)
                      /  (1 - KV cache use there, at most 0.95)

- **p99 TTFT**: of the upstream's last 256 replies within 60 s, measured here from the request
  to its first token (with fewer than 100, the slowest of them); until it has 8, the median of
  the other upstreams' figures (0.1 s when none has any), so a new upstream is tried rather
  than starved.
- **waiting** and **KV cache use**: read every few seconds from the upstream's ``/metrics``
  where it exports them (Seedance's ``seedance_requests_waiting`` and
  ``seedance_kv_cache_usage_ratio``, vLLM's ``vllm:num_requests_waiting`` and
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.10), llama.cpp's
  ``llamacpp:requests_deferred`` and ``llamacpp:kv_cache_usage_ratio``); 0 when it does not.

Ties go to the upstream that has served fewer requests.

**Prefixes** (``--upstream-routing prefix``). An upstream that served a prompt
keeps its prefix's KV cache warm (vLLM's prefix caching, llama-server's slots, Seedance's
sessions), so the next prompt that begins the same way (the conversation's next turn, another
conversation under the same system prompt) is served fastest there. The gateway remembers, for
each upstream, the prefix blocks of the prompts it sent there (the chained hashes of the
prompt's whole :data:`BLOCK_BYTES`-byte blocks, as llm-d and vLLM hash KV blocks, the least
recently sent forgotten past :data:`REMEMBERED_BLOCKS`), with bounded load (Mirrokni, Thorup
and Zadimoghaddam's consistent hashing with bounded loads): an upstream takes a prompt only
while its requests in flight, this one counted, stay within :data:`LOAD_FACTOR` times the
candidates' average, rounded up, or while it is among the least loaded (at low load the
rounding alone would leave no upstream within the bound). Among those, a prompt goes to the
one with the least prefill ahead of its first token: the blocks of it that upstream was not
sent, and those still to prefill of the prompts sent there that wait for their first token
and need no more (an engine that prefills the shortest rest first, as Seedance's does, lets
a short one pass the longer ones). With nothing waiting that is the one holding the longest
run of its leading blocks; for a prompt no upstream holds, the one with the least prefill
under way, where the requests in flight counted a reply being decoded, which costs an
upstream little, like a long prompt being prefilled. Ties go to the load-based choice above.
A holder of a much longer run (:data:`STRETCH_BLOCKS` more than the best within the bound: a
long conversation's history) may take :data:`HEADROOM` request more than the least loaded
holds: its prefill elsewhere costs more than one more request in its batch, while a short
gain (a system prompt the others hold too, a turn's last words) is not worth unbalancing the
upstreams for (suite 24 of ``make bench``: with every such gain stretched, the p50 first
token of a trace came out 1.2x least-loaded routing's). A prefix never leaves a request
without an upstream. The SLA classes choose the candidates first.
``load``: the load-based choice alone; ``round-robin``: the candidates in turn (both for
comparison).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from prometheus_client.parser import text_string_to_metric_families

WINDOW_S: Final = 60.0
WINDOW_REPLIES: Final = 256
MIN_SAMPLES: Final = 8
DEFAULT_TTFT_S: Final = 0.1
MAX_KV: Final = 0.95
#: A prompt's prefix is hashed in blocks of this many bytes (about 64 tokens of English).
BLOCK_BYTES: Final = 256
#: Blocks of a prompt's beginning that count (64 KiB).
MAX_BLOCKS: Final = 256
#: Prefix blocks remembered per upstream (8 bytes each, with the dictionary's own).
REMEMBERED_BLOCKS: Final = 100_000
#: An upstream takes a prompt for its prefix while its requests in flight stay within this
#: many times the candidates' average.
LOAD_FACTOR: Final = 1.25
#: A holder of :data:`STRETCH_BLOCKS` more of a prompt's prefix than the best upstream within
#: that bound may hold this many more than the least loaded candidate (a batching server's
#: queue is little longer for one more).
HEADROOM: Final = 1
#: 1 KiB, about 256 tokens: a prefill worth one more request in a batch.
STRETCH_BLOCKS: Final = 4
#: How a request's upstream is chosen (--upstream-routing).
ROUTINGS: Final = ("prefix", "load", "round-robin")

#: Metric families that say how many requests wait at an upstream, and how full its KV cache is.
WAITING: Final = (
    "seedance_requests_waiting",
    "vllm:num_requests_waiting",
    "llamacpp:requests_deferred",
)
KV_USE: Final = (
    "seedance_kv_cache_usage_ratio",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "llamacpp:kv_cache_usage_ratio",
)
#: Counter families of the prompt tokens an upstream was given, and of those its prefix cache
#: served (llama-server exports neither).
PROMPTED: Final = ("seedance_engine_prompt_tokens", "vllm:prefix_cache_queries")
CACHED: Final = ("seedance_engine_prompt_cached_tokens", "vllm:prefix_cache_hits")


class LatencyWindow:
    """Recent first-token times of one upstream."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=WINDOW_REPLIES)
        self._clock = clock

    def add(self, ttft_s: float) -> None:
        self._samples.append((self._clock(), ttft_s))

    def p99(self) -> float | None:
        """None until the window holds ``MIN_SAMPLES`` replies."""
        limit = self._clock() - WINDOW_S
        while self._samples and self._samples[0][0] < limit:
            self._samples.popleft()
        if len(self._samples) < MIN_SAMPLES:
            return None
        ordered = sorted(t for _, t in self._samples)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def prefix_blocks(parts: Iterable[str]) -> list[bytes]:
    """The chained hashes of a prompt's whole leading blocks (``parts``: its messages, each as
    role and content): block i's hash covers every byte before its end, so two prompts share
    it exactly when they begin with the same bytes up to there."""
    data = b"\x1e".join(part.encode() for part in parts)[: BLOCK_BYTES * MAX_BLOCKS]
    chained, blocks = b"", []
    for at in range(0, len(data) - BLOCK_BYTES + 1, BLOCK_BYTES):
        chained = hashlib.blake2b(chained + data[at : at + BLOCK_BYTES], digest_size=8).digest()
        blocks.append(chained)
    return blocks


class PrefixMemory:
    """The prefix blocks of prompts sent to one upstream, the least recently sent forgotten
    first."""

    def __init__(self, limit: int = REMEMBERED_BLOCKS) -> None:
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.limit = limit

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, blocks: list[bytes]) -> int:
        """How many of ``blocks``, from the first, this upstream was sent."""
        count = 0
        for block in blocks:
            if block not in self._blocks:
                break
            count += 1
        return count

    def remember(self, blocks: list[bytes]) -> None:
        for block in blocks:
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.limit:
            self._blocks.popitem(last=False)


@dataclass(slots=True, eq=False)
class Upstream:
    """One OpenAI-compatible server, and what is known of it."""

    base_url: str
    classes: frozenset[str] = frozenset()  # empty: every class
    in_flight: int = 0
    down_until: float = 0.0  # 0: up
    failures: int = 0
    requests: int = 0
    ttft: LatencyWindow = field(default_factory=LatencyWindow)
    waiting: float = 0.0  # from its /metrics
    kv_use: float | None = None  # from its /metrics
    #: Prompt tokens it was given, and those its cache served, since it started (its
    #: /metrics, where it says).
    prompt_cache: tuple[int, int] | None = None
    prefixes: PrefixMemory = field(default_factory=PrefixMemory)
    #: The prompt blocks each of its requests from here had to prefill (of those not yet
    #: past their first token), as :meth:`prefill_ahead` counts them.
    prefilling: list[int] = field(default_factory=list)

    @staticmethod
    def parse(url: str) -> Upstream:
        """``http://host:port/v1``, with the classes it serves after ``#`` (``+`` between)."""
        base, _, fragment = url.partition("#")
        classes = frozenset(c.strip() for c in fragment.split("+") if c.strip())
        return Upstream(base.rstrip("/"), classes)

    def prefill_ahead(self, blocks: int) -> int:
        """The blocks it will prefill before the first token of a prompt that needs
        ``blocks`` here: its own, and those of the prompts in progress that need no more (an
        engine that prefills the shortest rest first, as Seedance's does, lets it pass the
        longer ones; one that goes in order makes this an underestimate)."""
        return blocks + sum(n for n in self.prefilling if n <= blocks)

    @property
    def up(self) -> bool:
        return self.down_until == 0.0

    @property
    def metrics_url(self) -> str:
        """Its ``/metrics``: beside the API's ``/v1``."""
        return self.base_url.removesuffix("/v1") + "/metrics"

    def read_metrics(self, text: str) -> None:
        waiting, kv = 0.0, None
        prompted = cached = None
        for family in text_string_to_metric_families(text):
            if family.name in WAITING:
                waiting += sum(s.value for s in family.samples)
            elif family.name in KV_USE and family.samples:
                value = max(s.value for s in family.samples)
                kv = max(kv or 0.0, value / 100 if value > 1 else value)  # some say percent
            elif family.name in PROMPTED:
                prompted = (prompted or 0) + _total(family.samples)
            elif family.name in CACHED:
                cached = (cached or 0) + _total(family.samples)
        self.waiting, self.kv_use = waiting, kv
        if prompted is not None and cached is not None:
            self.prompt_cache = (prompted, cached)


def _total(samples: Iterable[Any]) -> int:
    """A counter family's value (its ``_total`` samples, not its ``_created``)."""
    return int(sum(s.value for s in samples if not s.name.endswith("_created")))


def choose(
    upstreams: Iterable[Upstream],
    service_class: str | None,
    blocks: list[bytes] | None = None,
    *,
    routing: str = "load",
    turn: int = 0,
) -> Upstream | None:
    """The upstream a request of ``service_class`` goes to (see the module); None: none up.
    ``blocks``: its prompt's :func:`prefix_blocks`; ``turn``: a count of the requests routed
    so far (``round-robin``)."""
    up = [u for u in upstreams if u.up]
    if not up:
        return None
    wanted = service_class or "normal"
    candidates = [u for u in up if wanted in u.classes] or [u for u in up if not u.classes] or up
    if routing == "round-robin":
        return candidates[turn % len(candidates)]
    score = _wait_score(up)
    if routing != "prefix" or not blocks:
        return min(candidates, key=score)
    average = (sum(u.in_flight for u in candidates) + 1) / len(candidates)
    least = min(u.in_flight for u in candidates)
    cap = max(math.ceil(LOAD_FACTOR * average), least + 1)
    held = [(u.prefixes.matched(blocks), u) for u in candidates]
    within = [pair for pair in held if pair[1].in_flight + 1 <= cap]  # never empty
    matched = max(n for n, _ in within)
    stretched, holder = min(
        (pair for pair in held if pair[1].in_flight <= least + HEADROOM),
        key=lambda pair: (-pair[0], pair[1].in_flight, pair[1].requests),
    )
    if stretched >= matched + STRETCH_BLOCKS:
        return holder

    def prefill_wait(pair: tuple[int, Upstream]) -> tuple[int, tuple[float, int]]:
        n, u = pair
        return u.prefill_ahead(len(blocks) - n + 1), score(u)

    return min(within, key=prefill_wait)[1]


def _wait_score(up: list[Upstream]) -> Callable[[Upstream], tuple[float, int]]:
    """An upstream's expected wait (see the module), then the requests it served: the lower,
    the better."""
    known = [p for p in (u.ttft.p99() for u in up) if p is not None]
    fallback = statistics.median(known) if known else DEFAULT_TTFT_S

    def score(u: Upstream) -> tuple[float, int]:
        ttft = u.ttft.p99()
        kv = min(u.kv_use or 0.0, MAX_KV)
        wait = (fallback if ttft is None else ttft) * (1 + u.in_flight + u.waiting) / (1 - kv)
        return wait, u.requests

    return score
