"""A minimal OpenAI-compatible server on the synthetic engine: ``/v1/models`` and
``/v1/chat/completions`` (streaming with SSE, or not). A target for ``seedance bench --openai``
in tests, and a fast upstream for gateway benchmarks.

    python -m benchmarks.peers.openai_sse --port 9002 [--tokens-per-s R] [--ttft-ms T]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from seedance.engines.base import GenerationRequest, SamplingParams
from seedance.engines.synthetic import SyntheticEngine
from seedance.protocol.messages import ChatMessage, RequestId

_encode = msgspec.json.Encoder().encode


class _Message(msgspec.Struct):
    role: str
    content: str


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _ChatRequest(msgspec.Struct):
    model: str
    messages: list[_Message]
    max_tokens: int = 16
    stream: bool = False
    stream_options: _StreamOptions | None = None
    seed: int | None = None


_decode_chat = msgspec.json.Decoder(_ChatRequest).decode


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return JSONResponse(body, status_code=status)


def create_app(engine: SyntheticEngine) -> Starlette:
    model = engine.info.name
    counter = 0

    async def models(_: Request) -> Response:
        data = [{"id": model, "object": "model", "created": 0, "owned_by": "seedance"}]
        return JSONResponse({"object": "list", "data": data})

    async def chat(request: Request) -> Response:
        nonlocal counter
        try:
            body = _decode_chat(await request.body())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            return _error(400, f"invalid request: {exc}", "invalid_request")
        if body.model != model:
            return _error(404, f"model {body.model!r} does not exist", "model_not_found")
        if not 1 <= body.max_tokens <= engine.info.max_output_tokens:
            return _error(400, "max_tokens out of range", "invalid_request")
        counter += 1
        completion_id = f"chatcmpl-{counter}"
        messages = tuple(ChatMessage(m.role, m.content) for m in body.messages)  # type: ignore[arg-type]
        prompt_tokens = sum(engine.count_tokens(m.content) for m in messages)
        generation = engine.generate(
            GenerationRequest(
                request_id=RequestId(completion_id),
                messages=messages,
                params=SamplingParams(max_tokens=body.max_tokens, seed=body.seed),
                prompt_tokens=prompt_tokens,
            )
        )
        created = int(time.time())
        head = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
        }

        if not body.stream:
            parts: list[str] = []
            finish = "stop"
            completion = 0
            async for delta in generation:
                parts.append(delta.text)
                completion += delta.tokens
                finish = delta.finish_reason or finish
            return JSONResponse(
                {
                    **head,
                    "object": "chat.completion",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(parts)},
                            "finish_reason": finish,
                        }
                    ],
                    "usage": _usage(prompt_tokens, completion),
                }
            )

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        async def events() -> AsyncIterator[bytes]:
            completion = 0
            first = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "finish_reason": None,
            }
            yield b"data: " + _encode({**head, "choices": [first]}) + b"\n\n"
            try:
                async for delta in generation:
                    completion += delta.tokens
                    choice: dict[str, Any] = {
                        "index": 0,
                        "delta": {"content": delta.text} if delta.text else {},
                        "finish_reason": delta.finish_reason,
                    }
                    yield b"data: " + _encode({**head, "choices": [choice]}) + b"\n\n"
            finally:
                await generation.aclose()
            if include_usage:
                usage = {**head, "choices": [], "usage": _usage(prompt_tokens, completion)}
                yield b"data: " + _encode(usage) + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9002)
    parser.add_argument("--model", default="synthetic")
    parser.add_argument("--ttft-ms", type=float, default=0.0)
    parser.add_argument("--tokens-per-s", type=float, default=0.0)
    args = parser.parse_args(argv)
    engine = SyntheticEngine(name=args.model, ttft_ms=args.ttft_ms, tokens_per_s=args.tokens_per_s)
    print(json.dumps({"listening": f"http://{args.host}:{args.port}/v1"}), flush=True)
    uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
