"""OpenAI's Realtime API over WebSocket, text only: ``/v1/realtime?model=M``.

A connection is a conversation: a Seedance session of its own (``rt-...``), whose turns are the
conversation's items. ``conversation.item.create`` adds an item to it; ``response.create`` is a
generation of the one request lifecycle (admission, quotas, audit record, metrics, trace) over
those turns, with the session's (or the response's) instructions as a system message that is
never kept; its events are rendered from the generation's stream log as it is written.
``response.cancel`` stops it (``response.done`` says ``cancelled``). One response runs at a
time, as at OpenAI. Both shapes of the ``openai`` package are spoken: GA, and beta when the
``OpenAI-Beta: realtime=v1`` header (or the ``openai-beta.realtime-v1`` subprotocol) is there.

Credentials as the SDK sends them (``Authorization: Bearer``), or as browsers do (the
``openai-insecure-api-key.KEY`` subprotocol; ``realtime`` is then echoed). Every refusal is an
OpenAI-shaped ``error`` event; the connection stays open unless it could not be served at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any, cast

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from seedance.protocol.errors import InvalidRequest, SeedanceError, SessionBusy
from seedance.protocol.messages import ChatMessage, DoneFrame, Generate, RequestId, TenantId
from seedance.protocol.qos import qos_from_headers
from seedance.protocol.realtime import (
    UNSUPPORTED,
    Events,
    ResponseParams,
    SessionConfig,
    Shape,
    decode_event,
    ended,
    item_message,
    response_params,
    update_session,
)
from seedance.server.openai_api import HttpFollower, Receive, Scope, Send, authenticate_http
from seedance.server.requests import Generation, Requester, admit, session_prompt
from seedance.server.state import ApiSocket, ServedModel, ServerState
from seedance.sessions.session import Session, Turn
from seedance.tenants.auth import Principal
from seedance.tenants.policy import check_model

logger = logging.getLogger(__name__)

BROWSER_SUBPROTOCOL = "realtime"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"


class RealtimeEndpoint:
    """``/v1/realtime``, a plain ASGI app."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self.state
        ws = WebSocket(scope, receive, cast(Any, send))
        offered = list(scope.get("subprotocols", ()))
        headers = dict(scope.get("headers", ()))
        beta = b"realtime=v1" in headers.get(b"openai-beta", b"") or BETA_SUBPROTOCOL in offered
        events = Events(Shape.of(beta), "", "")
        # Browsers offer subprotocols and need one back; the Python SDK offers none.
        await ws.accept(BROWSER_SUBPROTOCOL if BROWSER_SUBPROTOCOL in offered else None)
        counted = False
        try:
            principal = authenticate_http(state, scope)
            model = state.resolve_model(ws.query_params.get("model"))
            check_model(principal, model.name, state.models)
            quotas = principal.tenant.quotas
            state.usage.open_connection(principal.name, quotas)
            counted = True
            session, _ = await state.sessions.attach(
                TenantId(principal.name), None, max_for_tenant=quotas.sessions
            )
            model = state.resolve_model(model.name, session.session_id)  # a canary's share
        except SeedanceError as exc:
            if counted:
                state.usage.close_connection(principal.name)
            state.metrics.refused(exc.code)
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await ws.send_json(events.error(exc, None))
                await ws.close(exc.connect_close_code, exc.code)
            return
        connection = Realtime(state, ws, principal, model, session, beta, scope)
        socket = ApiSocket(connection.connection_id, principal, scope, connection.shut_out)
        state.api_sockets.add(socket)
        try:
            await connection.run()
        finally:
            state.api_sockets.discard(socket)
            state.usage.close_connection(principal.name)
            await state.sessions.detach(session)


class Realtime:
    """One Realtime connection: its conversation, its settings, its running response."""

    def __init__(
        self,
        state: ServerState,
        ws: WebSocket,
        principal: Principal,
        model: ServedModel,
        session: Session,
        beta: bool,
        scope: Scope,
    ) -> None:
        self.state = state
        self.ws = ws
        self.principal = principal
        self.model = model
        self.session = session
        self.shape = Shape.of(beta)
        self.events = Events(self.shape, model.name, session.session_id)
        self.config = SessionConfig()
        self.qos = qos_from_headers(scope.get("headers", ()))
        self.connection_id = "rt-" + secrets.token_hex(6)
        self.last_item: str | None = None
        self.generation: Generation | None = None
        self.responding: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()
        self._shutting: asyncio.Task[None] | None = None

    @property
    def limit(self) -> int:
        return self.model.limits.max_tokens

    async def run(self) -> None:
        try:
            await self.send(
                self.events.event("session.created", session=self.events.session(self.config))
            )
            while True:
                text = await self.ws.receive_text()
                event: dict[str, Any] = {}
                try:
                    event = decode_event(text)
                    await self.handle(event)
                except SeedanceError as exc:
                    client_event = event.get("event_id")
                    await self.send(
                        self.events.error(
                            exc, client_event if isinstance(client_event, str) else None
                        )
                    )
        except (WebSocketDisconnect, WebSocketDisconnected):  # its client left, or shut out
            pass
        finally:
            if self.generation is not None:
                self.generation.cancel(silent=True)  # its client left
            tasks = [t for t in (self.responding, self._shutting) if t is not None]
            await asyncio.gather(*tasks, return_exceptions=True)

    def shut_out(self, error: SeedanceError) -> None:
        """Its credential stopped passing: the response under way is cancelled, then the
        error event, and the socket closes."""
        if self.generation is not None:
            self.generation.cancel(silent=True)
        if self._shutting is None:
            self._shutting = asyncio.create_task(self._shut(error), name="realtime-shut-out")

    async def _shut(self, error: SeedanceError) -> None:
        with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected):
            await self.send(self.events.error(error, None))
            await self.ws.close(error.connect_close_code, error.code)

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "session.update":
            self.config = update_session(self.config, event.get("session"), self.shape, self.limit)
            await self.send(
                self.events.event("session.updated", session=self.events.session(self.config))
            )
        elif kind == "conversation.item.create":
            await self.add_item(item_message(event.get("item")), event.get("item", {}).get("id"))
        elif kind == "response.create":
            params = response_params(self.config, event.get("response"), self.shape, self.limit)
            if self.responding is not None and not self.responding.done():
                raise SessionBusy(
                    "conversation_already_has_active_response: a response is in progress; "
                    "cancel it or wait for its response.done"
                )
            started = self.start(params)
            self.responding = asyncio.create_task(self.respond(started, params))
        elif kind == "response.cancel":
            running = self.generation
            wanted = event.get("response_id")
            if running is None or (wanted is not None and wanted != running.request_id):
                raise InvalidRequest("response.cancel: no response in progress to cancel")
            running.cancel(silent=False)
        elif kind in UNSUPPORTED:
            raise InvalidRequest(
                f"{kind}: not supported (a text-only server: no audio, items stay)"
            )
        else:
            raise InvalidRequest(f"type: unknown client event {kind!r}")

    async def add_item(self, message: ChatMessage, item_id: Any) -> None:
        """The item joins the conversation (the session's turns) at once."""
        if self.session.busy:
            raise SessionBusy("a response is in progress; add the item after its response.done")
        engine = self.model.engine
        turn = Turn(message, engine.count_message_tokens(message), self.model.name)
        self.session.commit([turn], reset=False, max_tokens=engine.info.context_length)
        await self.state.sessions.save(self.session)
        item_id = item_id if isinstance(item_id, str) else "item_" + secrets.token_hex(12)
        item = self.events.item(item_id, message, "completed")
        added = self.events.item_added(item, self.last_item)
        if not self.shape.beta:
            added.append(
                self.events.event(
                    "conversation.item.done", previous_item_id=self.last_item, item=item
                )
            )
        self.last_item = item_id
        for event in added:
            await self.send(event)

    def start(self, params: ResponseParams) -> Generation:
        """Admit the response: a generation over the conversation so far."""
        # The version served now (a reload may have swapped one in since the last response).
        self.model = model = self.state.resolve_model(self.model.name, self.session.session_id)
        response_id = RequestId("resp_" + secrets.token_hex(12))
        fields: dict[str, Any] = {
            "messages": [],  # the items are in the session already
            "max_tokens": params.max_output_tokens or self.limit,
            "stream": True,
            "request_id": response_id,
        }
        if params.temperature is not None:
            fields["temperature"] = params.temperature
        message = Generate(**fields)
        preamble = (ChatMessage("system", params.instructions),) if params.instructions else ()
        prompt = session_prompt(model, self.session, message, preamble)
        if not prompt.messages:
            raise InvalidRequest("response.create: the conversation is empty; add an item first")
        if params.temperature is None:
            prompt.unset = frozenset({"temperature"})
        requester = Requester(
            self.principal,
            model,
            "websocket",
            session=self.session,
            connection_id=self.connection_id,
            qos=self.qos,
        )
        self.generation = generation = admit(
            self.state,
            requester,
            message,
            response_id,
            time.monotonic(),
            prompt=prompt,
            operation="realtime",
        )
        return generation

    async def respond(self, generation: Generation, params: ResponseParams) -> None:
        """The response's events, from its log, to its ``response.done``."""
        events = self.events
        shape = self.shape
        response_id = generation.request_id
        item_id = "item_" + secrets.token_hex(12)
        where = {
            "response_id": response_id,
            "item_id": item_id,
            "output_index": 0,
            "content_index": 0,
        }
        reply = ChatMessage("assistant", "")
        await self.send(
            events.event("response.created", response=events.response(response_id, params))
        )
        item = events.item(item_id, reply, "in_progress")
        await self.send(
            events.event(
                "response.output_item.added", response_id=response_id, output_index=0, item=item
            )
        )
        for event in events.item_added(item, self.last_item):
            await self.send(event)
        await self.send(events.event("response.content_part.added", **where, part=events.part("")))
        log = generation.log
        follower = HttpFollower(log)
        log.attach(follower)
        generation.reader_joined()
        try:
            while True:
                await follower.wait()
                text, _ = follower.take()
                if text:
                    await self.send(events.event(shape.text_delta, **where, delta=text))
                if follower.ended:
                    break
        finally:
            log.detach(follower)
            follower.caught_up()
            generation.reader_left()
            self.generation = None
        text = "".join(log.texts)
        status, details = ended(follower.end)
        done_item = events.item(
            item_id,
            ChatMessage("assistant", text),
            "completed" if status == "completed" else "incomplete",
        )
        await self.send(events.event(shape.text_done, **where, text=text))
        await self.send(events.event("response.content_part.done", **where, part=events.part(text)))
        await self.send(
            events.event(
                "response.output_item.done", response_id=response_id, output_index=0, item=done_item
            )
        )
        if not shape.beta:
            await self.send(
                events.event(
                    "conversation.item.done", previous_item_id=self.last_item, item=done_item
                )
            )
        if status in ("completed", "incomplete"):
            self.last_item = item_id  # the reply is in the conversation (the session's turns)
        end = follower.end
        response = events.response(
            response_id,
            params,
            status=status,
            status_details=details,
            output=[done_item],
            usage=end.usage if isinstance(end, DoneFrame) else None,
        )
        await self.send(events.event("response.done", response=response))

    async def send(self, event: dict[str, Any]) -> None:
        async with self._writing:
            await self.ws.send_json(event)
