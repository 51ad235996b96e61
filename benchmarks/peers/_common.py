"""What the raw peer servers share: the one client frame they read, and the engine request."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.engines.synthetic import SyntheticEngine
from seedance.eventloop import install_uvloop
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


def peer_main(
    doc: str | None,
    default_port: int,
    run: Callable[[str, int, SyntheticEngine], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
) -> None:
    """The command line of a raw peer: ``--host --port --ttft-ms --tokens-per-s``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=default_port)
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    install_uvloop()
    engine = SyntheticEngine(ttft_ms=args.ttft_ms, tokens_per_s=args.tokens_per_s)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args.host, args.port, engine))
