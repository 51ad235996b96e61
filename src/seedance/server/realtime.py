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
OpenAI-shaped ``error`` event, reported as every API's are (a ``refused`` audit record, a log
line, a metric, a span); the connection stays open unless it could not be served at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Mapping
from typing import Any, cast

import msgspec
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from seedance.protocol.codec import DEFAULT_MAX_TOKENS
from seedance.protocol.errors import (
    CLOSE_GOING_AWAY,
    InvalidRequest,
    SeedanceError,
    SessionBusy,
    Unauthorized,
)
from seedance.protocol.messages import (
    ChatMessage,
    DoneFrame,
    Generate,
    RequestId,
    TenantId,
)
from seedance.protocol.openai import audit_seq
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
from seedance.protocol.tools import CallReader, Tools
from seedance.server.http_call import Receive, Scope, Send
from seedance.server.lifecycle.admit import Requester, admit, choose_model, prepare, session_prompt
from seedance.server.lifecycle.connections import Counted, count_connection
from seedance.server.lifecycle.generation import Generation
from seedance.server.lifecycle.models import ServedModel
from seedance.server.lifecycle.peers import Kind
from seedance.server.lifecycle.reader import Reading
from seedance.server.lifecycle.refusals import Arrival
from seedance.server.lifecycle.services import Services
from seedance.sessions.session import Session, Turn
from seedance.tenants.auth import Principal

logger = logging.getLogger(__name__)

BROWSER_SUBPROTOCOL = "realtime"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
PATH = "/v1/realtime"


class RealtimeEndpoint:
    """``/v1/realtime``, a plain ASGI app."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        services = self.services
        received = time.monotonic()
        ws = WebSocket(scope, receive, cast(Any, send))
        offered = list(scope.get("subprotocols", ()))
        headers = dict(scope.get("headers", ()))
        beta = b"realtime=v1" in headers.get(b"openai-beta", b"") or BETA_SUBPROTOCOL in offered
        events = Events(Shape.of(beta), "", "")
        # Browsers offer subprotocols and need one back; the Python SDK offers none.
        await ws.accept(BROWSER_SUBPROTOCOL if BROWSER_SUBPROTOCOL in offered else None)
        counted: Counted | None = None  # the connection's place in its tenant's count
        principal: Principal | None = None
        model: ServedModel | None = None
        try:
            principal = services.access.authenticate(scope)
            model = choose_model(services, principal, ws.query_params.get("model"))
            quotas = principal.tenant.quotas
            counted = await count_connection(services, principal.name, quotas)
            session, _ = await services.sessions.attach(
                TenantId(principal.name), None, max_for_tenant=quotas.sessions
            )
            model = services.models.resolve(model.name, session.session_id)  # a canary's share
        except SeedanceError as exc:
            if counted is not None:
                counted.release()
            arrival = services.refusals.arrive(
                "websocket", scope, "realtime", received=received, path=PATH
            )
            arrival.principal, arrival.model = principal, model
            services.refusals.refuse(arrival, exc)
            with contextlib.suppress(WebSocketDisconnect, RuntimeError):
                await ws.send_json(events.error(exc, None))
                await ws.close(exc.connect_close_code, exc.code)
            return
        connection = Realtime(services, ws, principal, model, session, beta, scope)
        services.peers.add(connection)
        try:
            await connection.run()
        finally:
            services.peers.discard(connection)
            assert counted is not None
            counted.release()
            await services.sessions.detach(session)


class Realtime:
    """One Realtime connection: its conversation, its settings, its running response (a
    :class:`~seedance.server.lifecycle.peers.Peer` of the server)."""

    kind: Kind = "realtime"
    movable = False

    def __init__(
        self,
        services: Services,
        ws: WebSocket,
        principal: Principal,
        model: ServedModel,
        session: Session,
        beta: bool,
        scope: Scope,
    ) -> None:
        self.services = services
        self.ws = ws
        self.principal = principal
        self.model = model
        self.session = session
        self.shape = Shape.of(beta)
        self.events = Events(self.shape, model.name, session.session_id)
        self.config = SessionConfig()
        self.qos = qos_from_headers(scope.get("headers", ()))
        self.connection_id = "rt-" + secrets.token_hex(6)
        self.name = f"realtime {self.connection_id}"
        self.last_item: str | None = None
        self.generation: Generation | None = None
        self.responding: asyncio.Task[None] | None = None
        self._writing = asyncio.Lock()
        self._shutting: asyncio.Task[None] | None = None

    @property
    def limit(self) -> int:
        """What an event's token limit is checked against: the engine's (a model's signed
        limit is applied to the response, by name, with its version)."""
        return self.model.limits.max_tokens

    @property
    def scope(self) -> Mapping[str, Any]:
        return self.ws.scope

    @property
    def idle(self) -> bool:
        return self.responding is None or self.responding.done()

    async def run(self) -> None:
        try:
            await self.send(
                self.events.event("session.created", session=self.events.session(self.config))
            )
            while True:
                text = await self.ws.receive_text()
                received = time.monotonic()
                arrival: Arrival | None = None
                event: dict[str, Any] = {}
                try:
                    event = decode_event(text)
                    if event["type"] == "response.create":  # a request: it is traced
                        arrival = self._arrival(received)
                    await self.handle(event, arrival)
                except SeedanceError as exc:
                    self.services.refusals.refuse(arrival or self._arrival(received), exc)
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

    def _arrival(self, received: float) -> Arrival:
        """A client event read at ``received``, as its report names it."""
        arrival = self.services.refusals.arrive(
            "websocket", self.scope, "realtime", received=received, path=PATH
        )
        arrival.principal, arrival.model = self.principal, self.model
        arrival.connection_id, arrival.session_id = self.connection_id, self.session.session_id
        return arrival

    def shut_out(self, error: Unauthorized) -> None:
        """Its credential stopped passing: the response under way is cancelled, then the
        error event, and the socket closes."""
        if self.generation is not None:
            self.generation.cancel(silent=True)
        self._close_soon(error, error.connect_close_code, error.code)

    def going_away(self) -> None:
        self._close_soon(None, CLOSE_GOING_AWAY, "server shutting down")

    async def shutdown(self) -> None:
        """What runs has had its final event (the drain cancelled its generation): close."""
        if self.responding is not None:
            await asyncio.gather(self.responding, return_exceptions=True)
        self.going_away()

    def _close_soon(self, error: SeedanceError | None, code: int, reason: str) -> None:
        if self._shutting is None:
            self._shutting = asyncio.create_task(
                self._close(error, code, reason), name="realtime-close"
            )

    async def _close(self, error: SeedanceError | None, code: int, reason: str) -> None:
        with contextlib.suppress(WebSocketDisconnect, WebSocketDisconnected, RuntimeError):
            if error is not None:
                await self.send(self.events.error(error, None))
            await self.ws.close(code, reason)

    async def handle(self, event: dict[str, Any], arrival: Arrival | None = None) -> None:
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
            assert arrival is not None
            started = self.start(params, arrival)
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
        self.session.commit([turn], reset=False, max_tokens=self.model.context_length)
        await self.services.sessions.save(self.session)
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

    def start(self, params: ResponseParams, arrival: Arrival) -> Generation:
        """Admit the response: a generation over the conversation so far."""
        arrival.request_id = response_id = RequestId("resp_" + secrets.token_hex(12))
        if not self.session.turns:
            raise InvalidRequest("response.create: the conversation is empty; add an item first")
        # "inf": the conversation is kept whole where it leaves room for a default reply, and
        # the reply then may take what room is left, up to the model's limit.
        inf = params.max_output_tokens is None
        fields: dict[str, Any] = {
            "messages": [],  # the items are in the session already
            "max_tokens": params.max_output_tokens
            or min(DEFAULT_MAX_TOKENS, self.model.max_tokens),
            "stream": True,
            "request_id": response_id,
        }
        if params.temperature is not None:
            fields["temperature"] = params.temperature
        fields.update(params.tool_fields())
        unset = frozenset() if params.temperature is not None else frozenset({"temperature"})
        # The version served now (a reload may have swapped one in since the last response).
        self.model, message = prepare(
            self.services,
            arrival,
            self.model.name,
            self.session.session_id,
            Generate(**fields),
            unset=unset,
            field=self.shape.max_tokens,
        )
        preamble = (ChatMessage("system", params.instructions),) if params.instructions else ()
        prompt = session_prompt(self.model, self.session, message, preamble)
        if inf:
            room = min(self.model.max_tokens, self.model.context_length - prompt.tokens)
            message = msgspec.structs.replace(message, max_tokens=max(message.max_tokens, room))
        prompt.unset = unset
        requester = Requester(
            self.principal,
            self.model,
            "websocket",
            session=self.session,
            connection_id=self.connection_id,
            qos=self.qos,
        )
        self.generation = generation = admit(
            self.services, arrival, requester, message, prompt=prompt
        )
        return generation

    async def respond(self, generation: Generation, params: ResponseParams) -> None:
        """The response's events, from its log, to its ``response.done``: a message, or (a
        reply to tools that begins a call) its calls."""
        events = self.events
        response_id = generation.request_id
        await self.send(
            events.event("response.created", response=events.response(response_id, params))
        )
        tools = generation.tools
        output: _Message | _Calls = _Message(self, response_id)
        opened = False
        log = generation.log
        try:
            with Reading(log, generation) as reading:
                async for text, _ in reading:
                    if not opened:
                        if not text:
                            continue
                        if tools is not None and tools.is_call(text):
                            output = _Calls(self, response_id, tools)
                        opened = True
                        await output.open()
                    await output.feed(text)
        finally:
            self.generation = None
        if not opened:  # an empty reply
            await output.open()
        end = reading.end
        status, details = ended(end)
        items = await output.close(status)
        response = events.response(
            response_id,
            params,
            status=status,
            status_details=details,
            output=items,
            usage=end.usage if isinstance(end, DoneFrame) else None,
        )
        response.update(audit_seq(end))
        await self.send(events.event("response.done", response=response))

    async def item_done(
        self, response_id: str, index: int, item: dict[str, Any], previous: str | None
    ) -> None:
        """An output item is whole: ``response.output_item.done`` (and GA's
        ``conversation.item.done``, after the item ``previous``)."""
        events = self.events
        await self.send(
            events.event(
                "response.output_item.done", response_id=response_id, output_index=index, item=item
            )
        )
        if not self.shape.beta:
            await self.send(
                events.event("conversation.item.done", previous_item_id=previous, item=item)
            )

    async def send(self, event: dict[str, Any]) -> None:
        async with self._writing:
            await self.ws.send_json(event)


class _Message:
    """A response's output as one assistant message: its item, its text part, the deltas."""

    def __init__(self, connection: Realtime, response_id: str) -> None:
        self.connection = connection
        self.events = connection.events
        self.response_id = response_id
        self.item_id = "item_" + secrets.token_hex(12)
        self.where = {
            "response_id": response_id,
            "item_id": self.item_id,
            "output_index": 0,
            "content_index": 0,
        }
        self.text = ""

    async def open(self) -> None:
        connection, events = self.connection, self.events
        item = events.item(self.item_id, ChatMessage("assistant", ""), "in_progress")
        await connection.send(
            events.event(
                "response.output_item.added",
                response_id=self.response_id,
                output_index=0,
                item=item,
            )
        )
        for event in events.item_added(item, connection.last_item):
            await connection.send(event)
        part = events.part("")
        await connection.send(events.event("response.content_part.added", **self.where, part=part))

    async def feed(self, text: str) -> None:
        self.text += text
        delta = self.events.event(self.connection.shape.text_delta, **self.where, delta=text)
        await self.connection.send(delta)

    async def close(self, status: str) -> list[dict[str, Any]]:
        """The closing events; the output items."""
        connection, events, text, where = self.connection, self.events, self.text, self.where
        item = events.item(
            self.item_id,
            ChatMessage("assistant", text),
            "completed" if status == "completed" else "incomplete",
        )
        await connection.send(events.event(connection.shape.text_done, **where, text=text))
        part = events.part(text)
        await connection.send(events.event("response.content_part.done", **where, part=part))
        await connection.item_done(self.response_id, 0, item, connection.last_item)
        if status in ("completed", "incomplete"):
            connection.last_item = self.item_id  # the reply is in the conversation
        return [item]


class _Calls:
    """A response's output as the calls it makes: a ``function_call`` item each, its
    arguments streamed in parts (``response.function_call_arguments.delta``)."""

    def __init__(self, connection: Realtime, response_id: str, tools: Tools) -> None:
        self.connection = connection
        self.events = connection.events
        self.response_id = response_id
        self.reader = CallReader(tools, response_id)  # the calls, and how many are whole
        self.item_ids: list[str] = []
        self.previous: list[str | None] = []  # the item before each call's

    async def open(self) -> None:
        pass

    async def feed(self, text: str) -> None:
        connection, events = self.connection, self.events
        for event in self.reader.feed(text):
            index = event.index
            call = self.reader.calls[index]  # its arguments so far
            if event.name:
                self.item_ids.append(item_id := "item_" + secrets.token_hex(12))
                item = events.call_item(item_id, call, "in_progress")
                await connection.send(
                    events.event(
                        "response.output_item.added",
                        response_id=self.response_id,
                        output_index=index,
                        item=item,
                    )
                )
                self.previous.append(connection.last_item)
                for added in events.item_added(item, connection.last_item):
                    await connection.send(added)
                connection.last_item = item_id
                continue
            where = {
                "response_id": self.response_id,
                "item_id": self.item_ids[index],
                "output_index": index,
                "call_id": call.id,
            }
            if event.arguments:
                delta = events.event(
                    "response.function_call_arguments.delta", **where, delta=event.arguments
                )
                await connection.send(delta)
            elif event.done:
                named = {} if connection.shape.beta else {"name": call.name}  # GA names it
                done = events.event(
                    "response.function_call_arguments.done",
                    **where,
                    **named,
                    arguments=call.arguments,
                )
                await connection.send(done)
                item = events.call_item(self.item_ids[index], call, "completed")
                await connection.item_done(self.response_id, index, item, self.previous[index])

    async def close(self, status: str) -> list[dict[str, Any]]:
        """A call left unfinished (the reply failed) is done as incomplete; the output items."""
        items = []
        calls = zip(self.item_ids, self.reader.calls, strict=True)
        for index, (item_id, call) in enumerate(calls):
            whole = index < self.reader.whole
            item = self.events.call_item(item_id, call, "completed" if whole else "incomplete")
            if not whole:
                previous = self.previous[index]
                await self.connection.item_done(self.response_id, index, item, previous)
            items.append(item)
        return items
