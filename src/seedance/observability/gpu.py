"""GPU memory per device through NVML (``nvidia-ml-py``), for ``/metrics``.

Without an NVIDIA driver or without the package, :func:`open_gpu_memory` returns ``None`` and
the metrics are absent, not zero.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

logger = logging.getLogger(__name__)


class GpuMemory:
    """Reads used and total memory of every GPU NVML sees."""

    def __init__(self, nvml: Any, handles: list[Any]) -> None:
        self._nvml = nvml
        self._handles = handles

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "seedance_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["gpu"]
        )
        total = GaugeMetricFamily(
            "seedance_gpu_memory_total_bytes", "GPU memory of the device (NVML).", labels=["gpu"]
        )
        for index, handle in enumerate(self._handles):
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:  # a device that stopped answering: leave it out of this scrape
                continue
            used.add_metric([str(index)], float(info.used))
            total.add_metric([str(index)], float(info.total))
        yield used
        yield total


def open_gpu_memory() -> GpuMemory | None:
    """NVML's devices, or ``None`` where there is no NVIDIA GPU (or no ``nvidia-ml-py``)."""
    try:
        import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    except Exception:  # no driver, no device: nothing to report
        return None
    if not handles:
        return None
    logger.info("reporting memory of %d GPU(s) on /metrics", len(handles))
    return GpuMemory(pynvml, handles)
