"""What the raw peer servers share: the one client frame they read, and the engine request."""

from __future__ import annotations

import msgspec

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.messages import ChatMessage, RequestId


class GenerateFrame(msgspec.Struct):
    type: str
    prompt: str = ""
    max_tokens: int = 16
    request_id: str | None = None
    seed: int | None = None


decode_generate = msgspec.json.Decoder(GenerateFrame).decode
encode = msgspec.json.Encoder().encode


def engine_request(
    engine: SyntheticEngine, frame: GenerateFrame, request_id: str
) -> GenerationRequest:
    return GenerationRequest(
        request_id=RequestId(request_id),
        messages=(ChatMessage("user", frame.prompt),),
        params=SamplingParams(max_tokens=frame.max_tokens, seed=frame.seed),
        prompt_tokens=engine.count_tokens(frame.prompt),
    )


def done_frame(request_id: str, finish: str, completion: int) -> bytes:
    return encode(
        {
            "type": "done",
            "done": True,
            "request_id": request_id,
            "finish_reason": finish,
            "usage": {"completion_tokens": completion},
        }
    )
