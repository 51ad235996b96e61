"""Gateway mode's routing by SLA and load: which upstream a request goes to.

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
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from prometheus_client.parser import text_string_to_metric_families

WINDOW_S: Final = 60.0
WINDOW_REPLIES: Final = 256
MIN_SAMPLES: Final = 8
DEFAULT_TTFT_S: Final = 0.1
MAX_KV: Final = 0.95

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

    @staticmethod
    def parse(url: str) -> Upstream:
        """``http://host:port/v1``, with the classes it serves after ``#`` (``+`` between)."""
        base, _, fragment = url.partition("#")
        classes = frozenset(c.strip() for c in fragment.split("+") if c.strip())
        return Upstream(base.rstrip("/"), classes)

    @property
    def up(self) -> bool:
        return self.down_until == 0.0

    @property
    def metrics_url(self) -> str:
        """Its ``/metrics``: beside the API's ``/v1``."""
        return self.base_url.removesuffix("/v1") + "/metrics"

    def read_metrics(self, text: str) -> None:
        waiting, kv = 0.0, None
        for family in text_string_to_metric_families(text):
            if family.name in WAITING:
                waiting += sum(s.value for s in family.samples)
            elif family.name in KV_USE and family.samples:
                value = max(s.value for s in family.samples)
                kv = max(kv or 0.0, value / 100 if value > 1 else value)  # some say percent
        self.waiting, self.kv_use = waiting, kv


def choose(upstreams: Iterable[Upstream], service_class: str | None) -> Upstream | None:
    """The upstream a request of ``service_class`` goes to (see the module); None: none up."""
    up = [u for u in upstreams if u.up]
    if not up:
        return None
    wanted = service_class or "normal"
    candidates = [u for u in up if wanted in u.classes] or [u for u in up if not u.classes] or up
    known = [p for p in (u.ttft.p99() for u in up) if p is not None]
    fallback = statistics.median(known) if known else DEFAULT_TTFT_S

    def score(u: Upstream) -> tuple[float, int]:
        ttft = u.ttft.p99()
        kv = min(u.kv_use or 0.0, MAX_KV)
        wait = (fallback if ttft is None else ttft) * (1 + u.in_flight + u.waiting) / (1 - kv)
        return wait, u.requests

    return min(candidates, key=score)
