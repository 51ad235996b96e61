"""The Open Inference Protocol over HTTP (KServe v2; Triton's HTTP/REST API with its binary
tensor data extension), as ``tritonclient`` and the ``kserve`` SDK speak it, on the served
models (body and answer: :mod:`seedance.protocol.oip`).

=========================================  ===================================================
``GET /v2``                                 the server: name, version, extensions
``GET /v2/health/live``                     200 ``{"live": true}`` while the process serves
``GET /v2/health/ready``                    200 ``{"ready": true}``; 503 while draining or an
                                            engine is unhealthy (as ``/health``)
``GET /v2/models/{name}``                   the model's inputs and outputs (below)
``GET /v2/models/{name}/ready``             200, or 503 while it cannot serve
``POST /v2/models/{name}/infer``            a request: JSON tensors or binary data
anything else under ``/v2/``                404, in the protocol's shape
=========================================  ===================================================

``/versions/{version}`` may follow the model's name: a model from a signed registry answers to
its version, others to none. Errors are ``{"error": "..."}`` with the status each Seedance error
names. A text model takes ``text_input`` (BYTES, one prompt, continued as it is: the
completions API's raw prompt) and answers ``text_output`` and ``finish_reason``; its sampling
fields come as request ``parameters`` or as one-element input tensors of the same names. An
embedding model takes ``text`` (BYTES, a string per input) or ``input_ids`` (integers,
``[inputs, tokens]``) and answers ``embedding`` (FP32, ``[inputs, size]``). Both run through
the one request core, as every API does (:mod:`seedance.server.lifecycle`).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Union

import msgspec
import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from seedance import __version__
from seedance.protocol.embeddings import embeddings_request
from seedance.protocol.errors import (
    InvalidRequest,
    ModelNotFound,
    NotFound,
    Overloaded,
    SeedanceError,
)
from seedance.protocol.messages import EmbedFields
from seedance.protocol.oip import (
    BYTES,
    HEADER_LENGTH,
    InferInput,
    InferOutput,
    InferRequest,
    decode_infer,
    decompress_body,
    encode_infer,
    oip_error,
    parse_header_length,
)
from seedance.server.http_call import HttpCall, Receive, Scope, Send, authenticate_call
from seedance.server.lifecycle.admit import admit_raw, choose_model
from seedance.server.lifecycle.drain import SHUTTING_DOWN
from seedance.server.lifecycle.embed import embed
from seedance.server.lifecycle.reader import read_to_end
from seedance.server.modules import ServedModule
from seedance.server.wasi_nn import EngineBackend

if TYPE_CHECKING:
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.services import Services
    from seedance.server.state import ServerState
    from seedance.tenants.auth import Principal

#: Sampling fields a text model takes, as request parameters or one-element input tensors,
#: and the JSON type each must be.
SAMPLING: Final = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "seed": int,
    "stop": str,
    "ignore_eos": bool,
    "priority": int,
}
_JSON: Final = "application/json"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An input or output in a model's metadata (-1: any size)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False

    def json(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"name": self.name, "datatype": self.datatype}
        spec["shape"] = list(self.shape)
        if self.optional:
            spec["parameters"] = {"optional": True}
        return spec


def _scalar_type(kind: type) -> str:
    return {int: "INT64", float: "FP32", str: "BYTES", bool: "BOOL"}[kind]


TEXT_INPUTS: Final = (
    TensorSpec("text_input", BYTES, (1,)),
    *(TensorSpec(name, _scalar_type(kind), (1,), True) for name, kind in SAMPLING.items()),
)
TEXT_OUTPUTS: Final = (
    TensorSpec("text_output", BYTES, (1,)),
    TensorSpec("finish_reason", BYTES, (1,)),
)


PIPELINE_INPUTS: Final = (TensorSpec("input", BYTES, (1,)),)
PIPELINE_OUTPUTS: Final = (TensorSpec("output", BYTES, (1,)),)

#: What a path's name names: a served model, or a tenant's pipeline module.
Target = Union["ServedModel", "ServedModule"]


def find(services: Services, principal: Principal, name: str, version: str | None) -> Target:
    """The served model ``name``, else the caller's pipeline module of that name; held to
    ``version`` (from the path) when one is given."""
    try:
        found: Target = choose_model(services, principal, name, task=None)
    except ModelNotFound:
        modules = services.modules
        if modules is None or name not in modules.modules:
            raise
        found = modules.get(principal, name, ModelNotFound)
        if not found.has("run"):
            raise ModelNotFound(
                f"module {name} is not a pipeline (it exports no seedance_run)"
            ) from None
    return _versioned(found, version)


def signature(model: Target) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """A served model's inputs and outputs, as its metadata lists them."""
    if isinstance(model, ServedModule):
        return PIPELINE_INPUTS, PIPELINE_OUTPUTS
    engine = model.engine
    if engine.task != "embed":
        return TEXT_INPUTS, TEXT_OUTPUTS
    size = getattr(engine, "dimensions", -1)
    inputs = (
        TensorSpec("text", BYTES, (-1,), True),
        TensorSpec("input_ids", "INT64", (-1, -1), True),
    )
    return inputs, (TensorSpec("embedding", "FP32", (-1, size)),)


def model_metadata(model: Target) -> dict[str, Any]:
    inputs, outputs = signature(model)
    metadata: dict[str, Any] = {"name": model.name}
    if model.version:
        metadata["versions"] = [model.version]
    if isinstance(model, ServedModule):
        metadata["platform"] = "seedance_wasm"
    else:
        metadata["platform"] = f"seedance_{model.engine.info.engine}"
    metadata["inputs"] = [spec.json() for spec in inputs]
    metadata["outputs"] = [spec.json() for spec in outputs]
    return metadata


def _oip_response(status: int, body: dict[str, Any]) -> Response:
    return Response(msgspec.json.encode(body), status, media_type=_JSON)


def error_body(error: SeedanceError) -> bytes:
    """An error in the protocol's shape: ``{"error": "..."}``."""
    return oip_error(error.message)


def _error_response(error: SeedanceError) -> Response:
    return Response(error_body(error), error.http_status, media_type=_JSON)


def _versioned(model: Target, version: str | None) -> Target:
    """``model`` when ``version`` (from the path) is the one it serves."""
    if version is None or version == model.version:
        return model
    serves = f"version {model.version}" if model.version else "no versions (leave it out)"
    raise ModelNotFound(f"model {model.name} has no version {version!r}; it serves {serves}")


def oip_routes(state: ServerState) -> list[BaseRoute]:
    """The routes of the protocol (see the module), for the app to mount."""
    services = state.services

    def ready() -> bool:
        return not state.draining and state.healthy()[0]

    def served(request: Request, operation: str) -> Target:
        principal = authenticate_call(services, request.scope, operation)
        params = request.path_params
        return find(services, principal, params["name"], params.get("version"))

    async def server_metadata(request: Request) -> Response:
        body = {"name": "seedance", "version": __version__, "extensions": ["binary_tensor_data"]}
        return _oip_response(200, body)

    async def live(request: Request) -> Response:
        return _oip_response(200, {"live": True})

    async def server_ready(request: Request) -> Response:
        ok = ready()
        return _oip_response(200 if ok else 503, {"ready": ok})

    async def metadata(request: Request) -> Response:
        try:
            return _oip_response(200, model_metadata(served(request, "model_metadata")))
        except SeedanceError as exc:
            return _error_response(exc)

    async def model_ready(request: Request) -> Response:
        try:
            model = served(request, "model_ready")
        except SeedanceError as exc:
            return _error_response(exc)
        ok = ready()
        return _oip_response(200 if ok else 503, {"name": model.name, "ready": ok})

    async def unknown(request: Request) -> Response:
        return _error_response(
            NotFound(
                f"{request.method} {request.url.path} is not an endpoint of the Open Inference "
                "Protocol here: /v2/health/live, /v2/health/ready, /v2/models/{name}, "
                "/v2/models/{name}/ready, /v2/models/{name}/infer"
            )
        )

    infer = InferEndpoint(services)
    routes: list[BaseRoute] = [
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", server_ready),
    ]
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [
            Route(base, metadata),
            Route(base + "/ready", model_ready),
            Route(base + "/infer", infer, methods=["POST"]),
        ]
    methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]
    routes.append(Route("/v2/{rest:path}", unknown, methods=methods))
    return routes


class InferEndpoint:
    """``POST /v2/models/{name}[/versions/{version}]/infer``, as a plain ASGI app: an HTTP
    call like every other (the caller checked before its body is read, refusals reported by
    the one reporter), answered in the protocol's shapes."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = HttpCall(
            self.services, scope, send, "infer", "oip-" + secrets.token_hex(12), errors=error_body
        )
        await call.answer(receive, lambda body: self.run(call, body))

    async def run(self, call: HttpCall, body: bytes) -> None:
        try:
            request, model = self._read(call, body)
            if isinstance(model, ServedModule):
                outputs = await self._pipeline(call, request, model)
            elif model.engine.task == "embed":
                outputs = await self._embed(call, request, model)
            else:
                outputs = await self._generate(call, request, model)
            wanted = _chosen(request, outputs, model.name)
            answer, json_length = encode_infer(
                model.name,
                [(output, request.wants_binary(output.name)) for output in wanted],
                model_version=model.version or None,
                request_id=request.id,
            )
        except Exception as exc:
            await call.fail(exc)
            return
        headers = [(b"content-type", _JSON.encode())]
        if json_length is not None:
            headers = [
                (b"content-type", b"application/octet-stream"),
                (HEADER_LENGTH.lower().encode(), str(json_length).encode()),
            ]
        await call.response.respond(200, headers, answer)

    def _read(self, call: HttpCall, body: bytes) -> tuple[InferRequest, Target]:
        """The model the path names (which the caller may use), then the request."""
        params = call.scope.get("path_params", {})
        model = find(self.services, call.principal, params["name"], params.get("version"))
        if not isinstance(model, ServedModule):
            call.arrival.model = model
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in call.scope["headers"]}
        limit = self.services.config.max_frame_bytes
        body = decompress_body(body, headers.get("content-encoding"), limit=limit)
        request = decode_infer(body, parse_header_length(headers.get(HEADER_LENGTH.lower())))
        return request, model

    async def _pipeline(
        self, call: HttpCall, request: InferRequest, module: ServedModule
    ) -> list[InferOutput]:
        """A tenant's pipeline module: the bytes of ``input`` through its ``seedance_run``,
        which may call served models through WASI-NN (each call a request of the tenant)."""
        inputs = _inputs(request, {"input"}, module.name)
        given = inputs.get("input")
        data = [] if given is None else _bytes(given)
        if len(data) != 1:
            raise InvalidRequest(f"inputs: module {module.name} takes one input: BYTES, [1]")
        table = self.services.modules
        assert table is not None
        backend = EngineBackend(self.services, call.principal, module, asyncio.get_running_loop())

        def work() -> bytes:
            instance = module.module.instantiate(
                backend=backend, allow=module.imports, limits=module.limits
            )
            try:
                return instance.run(data[0])
            finally:
                instance.close()

        output = await table.call(module, "run", work)
        table.ok(module, "run")
        call.outcome = "completed"
        return [InferOutput("output", BYTES, (1,), [output])]

    async def _embed(
        self, call: HttpCall, request: InferRequest, model: ServedModel
    ) -> list[InferOutput]:
        inputs = _inputs(request, {"text", "input_ids"}, model.name)
        if len(inputs) != 1:
            raise InvalidRequest(f"model {model.name} takes one input: text or input_ids")
        (given,) = inputs.values()
        fields = EmbedFields(input=None, model=model.name)
        if given.name == "text":
            texts: list[str | int | list[int]] = [_text(v, "text") for v in _bytes(given)]
            fields.input = texts
            embedding = embeddings_request(fields)
        else:
            if not isinstance(given.data, np.ndarray) or given.data.dtype.kind not in "iu":
                raise InvalidRequest("input_ids: token ids, an integer datatype")
            rows = given.data.reshape(1, -1) if given.data.ndim == 1 else given.data
            if rows.ndim != 2:
                raise InvalidRequest("input_ids: shape [tokens] or [inputs, tokens]")
            embedding = embeddings_request(fields, rows.astype(np.int64).tolist())
        done = await embed(self.services, call.arrival, embedding)
        call.outcome, call.prompt_tokens = "embedded", done.tokens
        vectors = done.vectors
        return [InferOutput("embedding", "FP32", vectors.shape, vectors)]

    async def _generate(
        self, call: HttpCall, request: InferRequest, model: ServedModel
    ) -> list[InferOutput]:
        services = self.services
        inputs = _inputs(request, {spec.name for spec in TEXT_INPUTS}, model.name)
        prompt = inputs.get("text_input")
        if prompt is None:
            raise InvalidRequest(f"inputs: model {model.name} needs text_input (BYTES, [1])")
        texts = _bytes(prompt)
        if len(texts) != 1:
            raise InvalidRequest("text_input: one prompt per request (shape [1])")
        text = _text(texts[0], "text_input")
        call.generation = generation = admit_raw(
            services, call.arrival, call.principal, model, text, _sampling(request, inputs),
            stream=False,
        )  # fmt: skip
        done = await read_to_end(generation.log, generation)
        if done.finish_reason == "cancelled":  # over HTTP only the server cancels: shutdown
            raise Overloaded(SHUTTING_DOWN)
        call.outcome = done.finish_reason
        reply = "".join(generation.log.texts).encode()
        return [
            InferOutput("text_output", BYTES, (1,), [reply]),
            InferOutput("finish_reason", BYTES, (1,), [done.finish_reason.encode()]),
        ]


def _inputs(request: InferRequest, known: set[str], model: str) -> dict[str, InferInput]:
    """The request's inputs by name, each one the model takes."""
    inputs = {given.name: given for given in request.inputs}
    unknown = sorted(set(inputs) - known)
    if unknown:
        raise InvalidRequest(
            f"inputs: model {model} has no input {', '.join(unknown)} "
            f"(it takes {', '.join(sorted(known))})"
        )
    return inputs


def _bytes(given: InferInput) -> list[bytes]:
    if given.datatype != BYTES or not isinstance(given.data, list):
        raise InvalidRequest(f"{given.name}: expected BYTES, got {given.datatype}")
    return given.data


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise InvalidRequest(f"{name}: not UTF-8 text") from None


def _sampling(request: InferRequest, inputs: dict[str, InferInput]) -> dict[str, Any]:
    """The sampling fields of a text request: its parameters, and one-element inputs of the
    same names (a field given both ways is refused)."""
    unknown = sorted(set(request.parameters) - set(SAMPLING))
    if unknown:
        raise InvalidRequest(
            f"parameters: {', '.join(unknown)} not supported; a text model takes "
            f"{', '.join(SAMPLING)}"
        )
    fields: dict[str, Any] = {}
    for name, kind in SAMPLING.items():
        value: Any = request.parameters.get(name)
        given = inputs.get(name)
        if given is not None:
            if value is not None:
                raise InvalidRequest(f"{name}: given as a parameter and as an input")
            value = _scalar(given)
        if value is None:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidRequest(f"{name}: expected {kind.__name__}, got {value!r}")
        fields[name] = value
    return fields


def _scalar(given: InferInput) -> Any:
    data = given.data
    count = len(data) if isinstance(data, list) else data.size
    if count != 1:
        raise InvalidRequest(f"{given.name}: one value (shape [1]), got {list(given.shape)}")
    if isinstance(data, list):
        return _text(data[0], given.name)
    return data.reshape(-1)[0].item()


def _chosen(request: InferRequest, outputs: list[InferOutput], model: str) -> list[InferOutput]:
    """The outputs the request asked for, in its order (all of them when it named none)."""
    if request.outputs is None:
        return outputs
    by_name = {output.name: output for output in outputs}
    chosen = []
    for index, requested in enumerate(request.outputs):
        output = by_name.get(requested.name)
        if output is None:
            raise InvalidRequest(
                f"outputs[{index}].name: model {model} has no output {requested.name!r} "
                f"(it gives {', '.join(by_name)})"
            )
        chosen.append(output)
    return chosen
