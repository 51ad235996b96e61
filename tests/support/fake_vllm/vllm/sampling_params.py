"""``SamplingParams`` validates itself, as vLLM's does (``ValueError``, then
``VLLMValidationError`` from 0.14)."""

import enum
from dataclasses import dataclass
from typing import Any

from vllm import version


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def invalid(message: str) -> Exception:
    if version() < (0, 14):
        return ValueError(message)
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError(message)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: Any = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise invalid(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.temperature < 0:
            raise invalid(f"temperature must be non-negative, got {self.temperature}.")
        if self.repetition_penalty <= 0:
            raise invalid(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
