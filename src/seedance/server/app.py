"""The ASGI application: ``/v2/infer`` (WebSocket), the OpenAI APIs, ``/healthz`` (and
``/health``), ``/v1/models``, ``/v1/embeddings``, ``/tokenize`` and ``/detokenize``.

``create_app()`` returns a Starlette app that can be served by ``seedance serve`` or mounted in
another ASGI application. When mounted elsewhere, call ``await app.state.seedance.drain(30)``
before the host server closes connections, so that running generations can finish.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from seedance.config import EmbeddingsConfig, ServerConfig
from seedance.engines.base import Engine
from seedance.engines.registry import create_engine
from seedance.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from seedance.observability.tracing import Tracing
from seedance.protocol.errors import InvalidRequest, UpgradeRequired
from seedance.server.admin import admin_routes
from seedance.server.embeddings_api import EmbeddingsEndpoint
from seedance.server.endpoint import InferEndpoint
from seedance.server.errors import EXCEPTION_HANDLERS
from seedance.server.http_call import authenticate_call
from seedance.server.lifecycle.models import ServedModel
from seedance.server.oip_api import oip_routes
from seedance.server.openai_api import OpenAIEndpoint, StreamsEndpoint
from seedance.server.realtime import RealtimeEndpoint
from seedance.server.relay_api import RelayEndpoint, relay_verifier
from seedance.server.responses_api import (
    ResponseEndpoint,
    ResponsesEndpoint,
    ResponsesSocketEndpoint,
)
from seedance.server.state import ServerState
from seedance.server.tokenize_api import TokenizeEndpoint
from seedance.server.transparency import transparency_routes
from seedance.server.web import web_routes
from seedance.sessions.store import SessionStore
from seedance.tenants.auth import peer_of

if TYPE_CHECKING:
    from seedance.models.registry import VerifiedModel

_STARTED = int(time.time())


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


INFER_PATH = "/v2/infer"


class SeedanceApp(Starlette):
    """Starlette, with the WebSocket endpoint served without the middleware stack and router
    (one coroutine frame per layer per connection, and per message on the ASGI path)."""

    infer: InferEndpoint | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket" and self.infer is not None:
            path: str = scope["path"]
            root: str = scope.get("root_path", "")
            if root and path.startswith(root):
                path = path[len(root) :]
            if path == INFER_PATH:
                scope["app"] = self
                await self.infer(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def embedding_engine(config: EmbeddingsConfig) -> Engine:
    """The embedding model ``--embedding-model`` names (transformers: imported only then)."""
    from seedance.engines.embeddings import EmbeddingEngine, model_folder

    assert config.model is not None
    folder, name = model_folder(config.model)
    return EmbeddingEngine(
        folder, name=name, threads=config.threads, max_batch_inputs=config.max_batch_inputs
    )


def _versions(state: ServerState) -> dict[str, str | None]:
    """Each served model's version (a registry's), for the probes."""
    return {name: model.version or None for name, model in state.models.items()}


def create_app(
    config: ServerConfig | None = None,
    *,
    engines: Sequence[Engine] | None = None,
    sessions: SessionStore | None = None,
    tracing: Tracing | None = None,
) -> SeedanceApp:
    """Build the app. ``engines`` defaults to the one ``config.engine`` names, ``tracing``
    to what the config and the ``OTEL_*`` variables ask for."""
    config = config or ServerConfig()
    manager = None
    verified: dict[str, VerifiedModel] = {}
    if engines is None and config.registry.path is not None:
        from seedance.models.serving import ModelManager

        manager = ModelManager(config)
        loaded = manager.initial()  # verified before an engine reads a byte
        engines = [engine for engine, _ in loaded]
        verified = {model.name: model for _, model in loaded}
    if engines is None:
        engines = [create_engine(config)]
    if config.embeddings.model is not None:  # beside what serves text, registry or not
        engines = [*engines, embedding_engine(config.embeddings)]
    state = ServerState(config, engines, sessions, tracing)
    services = state.services
    for name, model in verified.items():
        engine = state.models[name].engine
        signed = model.manifest.limits
        state.models.swap(
            ServedModel.of(config, engine, model.version, model.manifest_sha256, signed)
        )
    state.model_manager = manager

    async def healthz(request: Request) -> Response:
        """Liveness, plain; ``?check=initial-load`` (startup: the models are loaded) and
        ``?check=model+signature`` (readiness: loaded, verified, not draining)."""
        check = request.query_params.get("check", "")
        if check == "initial-load":
            return json_response({"status": "ok", "models": _versions(state)})
        if check and check.replace(" ", "+") != "model+signature":
            raise InvalidRequest(f"check: 'initial-load' or 'model+signature', not {check!r}")
        refusal = not_ready()
        if refusal is not None:
            return refusal
        if check:
            return json_response({"status": "ok", "models": _versions(state)})
        return json_response({"status": "ok"})

    def not_ready() -> Response | None:
        """503 while draining or while an engine is unhealthy (None: ready)."""
        if state.draining:
            return json_response({"status": "draining"}, 503)
        ok, detail = state.healthy()
        if not ok:
            return json_response({"status": "unhealthy", "detail": detail}, 503)
        return None

    async def health(request: Request) -> Response:
        """What vLLM and llama-server answer at ``/health`` (load generators such as guidellm
        probe it): 200 when the models serve, 503 while draining or unhealthy."""
        return not_ready() or json_response({"status": "ok"})

    async def metrics(request: Request) -> Response:
        body = state.metrics.render()
        worker = state.config.worker
        if worker is not None:  # one of --workers N: the whole server's, every worker's summed
            from seedance.server.siblings import all_metrics

            body = await all_metrics(worker, body)
        return Response(body, headers={"content-type": METRICS_CONTENT_TYPE})

    async def models(request: Request) -> Response:
        principal = authenticate_call(services, request.scope, "models")
        access, names, peer = services.access, list(state.models), peer_of(request.scope)
        data = [
            {
                "id": name,
                "object": "model",
                "created": _STARTED,
                "owned_by": "seedance",
                "context_length": model.context_length,
                "max_model_len": model.context_length,  # vLLM's name for it
                "engine": model.engine.info.engine,
            }
            for name, model in state.models.items()
            if access.lists(principal, name, model.version, names, model.engine.task, peer)
        ]
        return json_response({"object": "list", "data": data})

    async def webtransport(request: Request) -> Response:
        """Whether and where ``/v2/infer`` is served over WebTransport (``--http3``), for the
        browser SDK: its port and, for a certificate the server made itself, the SHA-256 a
        page passes as ``serverCertificateHashes``. Always 200 (a 404 is a console error in
        every browser that asks)."""
        return json_response(state.webtransport or {"offered": False})

    async def upgrade_required(request: Request) -> Response:
        raise UpgradeRequired(f"{INFER_PATH} is a WebSocket endpoint: connect with ws:// or wss://")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.start()
        if manager is not None:
            manager.start(state.models, state.audit, state.generations.uses)
            for name, model in verified.items():
                key, sha = model.key.id, model.manifest_sha256
                manager.audit(name, "loaded", model.version, key=key, manifest_sha256=sha)
        try:
            yield
        finally:
            if manager is not None:
                await manager.stop()
            await state.close()
            if manager is not None:
                await manager.close()  # the versions being retired, once no request needs them

    infer = InferEndpoint(services)
    app = SeedanceApp(
        routes=[
            WebSocketRoute(INFER_PATH, infer),
            Route(INFER_PATH, upgrade_required),
            Route("/v2/webtransport", webtransport),
            Route("/v2/relay", RelayEndpoint(services, relay_verifier(config)), methods=["POST"]),
            Route("/healthz", healthz),
            Route("/health", health),
            Route("/metrics", metrics),
            Route("/v1/models", models),
            Route("/v1/chat/completions", OpenAIEndpoint(services, "chat"), methods=["POST"]),
            Route("/v1/completions", OpenAIEndpoint(services, "completion"), methods=["POST"]),
            Route("/v1/streams/{request_id}", StreamsEndpoint(services), methods=["GET"]),
            Route("/v1/embeddings", EmbeddingsEndpoint(services), methods=["POST"]),
            Route("/tokenize", TokenizeEndpoint(services, "tokenize"), methods=["POST"]),
            Route("/detokenize", TokenizeEndpoint(services, "detokenize"), methods=["POST"]),
            Route("/v1/responses", ResponsesEndpoint(services), methods=["POST"]),
            WebSocketRoute("/v1/responses", ResponsesSocketEndpoint(services)),
            WebSocketRoute("/v1/realtime", RealtimeEndpoint(services)),
            Route(
                "/v1/responses/{response_id}",
                ResponseEndpoint(services),
                methods=["GET", "DELETE"],
            ),
            Route(
                "/v1/responses/{response_id}/cancel",
                ResponseEndpoint(services, "cancel"),
                methods=["POST"],
            ),
            *admin_routes(state),
            *transparency_routes(state),
            *oip_routes(state),  # after /v2/infer: the protocol's 404 for the rest of /v2/
            *([] if config.no_playground else web_routes()),
        ],
        lifespan=lifespan,
        exception_handlers=EXCEPTION_HANDLERS,
    )
    app.infer = infer
    app.state.seedance = state
    return app
