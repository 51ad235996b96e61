"""Inference backends behind one interface (:class:`~seedance.engines.base.Engine`)."""

from seedance.engines.base import (
    Engine,
    EngineHealth,
    GenerationRequest,
    ModelInfo,
    SamplingParams,
    TokenDelta,
)

__all__ = [
    "Engine",
    "EngineHealth",
    "GenerationRequest",
    "ModelInfo",
    "SamplingParams",
    "TokenDelta",
]
