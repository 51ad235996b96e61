"""``POST /v2/relay``: the far end of the cross-region relay (design 4.3).

An edge gateway in another region (``seedance serve --engine relay``,
:mod:`seedance.engines.relay`) sends one request of one tenant's session here, over HTTP/3 on
one QUIC connection per region, with a relay token (:mod:`seedance.relay.tokens`) in
``Authorization: Bearer``. The token is checked before anything else: signed by an edge this
node trusts (``--relay-trust``), for this node (``aud``: its ``--node-id``), alive, at most 90 s
long, never seen before (by this process, or with ``--redis`` and ``--workers`` by any node or
worker of the cluster: a ``SET NX`` that lasts until the token expires); anything else is
refused with its reason (401, ``unauthorized``) and audited like every refusal. The request
then runs as the token's tenant (a tenant of this node where it has tenants), through the one
request core: admission, quotas, the audit, the stream log.

The body is the ``/v2/infer`` protocol's ``generate`` frame, with ``messages`` the whole
context the edge built and ``model`` a model served here; or ``{"resume": REQUEST_ID,
"after_seq": N}`` to read a relayed reply again after the token ``N`` (a relay connection lost
mid-reply). The answer streams newline-delimited JSON: ``{"type": "start", "request_id"}``,
then ``{"type": "token", "text", "seq", "n"}`` (``seq`` the last token's), then the ``done`` or
``error`` frame of the protocol. Relayed replies are resumable: their stream log outlives a
lost connection for the resume grace.
"""

from __future__ import annotations

import logging
import secrets
from typing import TYPE_CHECKING, Any

import msgspec

from seedance.protocol.codec import FrameLimits, decode_client_text, encode_error, encode_frame
from seedance.protocol.errors import InvalidRequest, SeedanceError, Unauthorized
from seedance.protocol.messages import ErrorFrame, Generate
from seedance.relay.copies import HEADER, MAX_COPIES
from seedance.relay.keys import trusted
from seedance.relay.tokens import LEEWAY_S, RelayClaims, RelayRefused, Verifier, replayed
from seedance.server.http_call import HttpCall, Receive, Scope, Send
from seedance.server.lifecycle.admit import admit, prepare
from seedance.server.lifecycle.reader import Reading
from seedance.server.lifecycle.request import Requester, explicit_prompt
from seedance.server.transport import QUIC_EXTENSION
from seedance.tenants.auth import bearer

if TYPE_CHECKING:
    from seedance.config import ServerConfig
    from seedance.server.lifecycle.generation import Generation
    from seedance.server.lifecycle.services import Services
    from seedance.streams.log import StreamLog
    from seedance.tenants.auth import Principal

logger = logging.getLogger(__name__)

NDJSON = [(b"content-type", b"application/x-ndjson")]
_encode = msgspec.json.Encoder().encode


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """What an edge sends: a generate frame and the model, or a resume."""

    model: str | None = None
    generate: dict[str, Any] | None = None
    resume: str | None = None
    after_seq: int = -1


def relay_verifier(config: ServerConfig) -> Verifier | None:
    """What checks relayed requests' tokens (None: this node takes none)."""
    cluster = config.cluster
    if not cluster.relay_trust:
        return None
    assert cluster.node_id is not None  # the config loader asks for it with --relay-trust
    return Verifier(cluster.node_id, trusted(cluster.relay_trust))


def _repeat(scope: Scope) -> None:
    """Send the link's packets as many times as the edge asks (``seedance-relay-copies``),
    where the link is QUIC (:mod:`seedance.relay.copies`)."""
    asked = dict(scope.get("headers", ())).get(HEADER)
    controls = (scope.get("extensions") or {}).get(QUIC_EXTENSION)
    if asked is not None and controls is not None and asked.isdigit():
        controls["repeat"](min(int(asked), MAX_COPIES))


def _error_line(error: SeedanceError) -> bytes:
    return encode_error(error).encode() + b"\n"


class RelayEndpoint:
    """``POST /v2/relay`` (see the module)."""

    def __init__(self, services: Services, verifier: Verifier | None) -> None:
        self.services = services
        self.verifier = verifier

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = "relay-" + secrets.token_hex(12)
        call = HttpCall(self.services, scope, send, "relay", request_id, errors=_error_line)
        checked: list[RelayClaims] = []

        def authenticate() -> Principal:
            """The relay token, not a tenant's credential: the caller is the token's tenant."""
            claims = self._check(scope)
            checked.append(claims)
            _repeat(scope)
            principal = self.services.access.relayed(claims.tenant, claims.issuer)
            call.principal = call.arrival.principal = principal
            return principal

        await call.answer(receive, lambda body: self._run(call, checked[0], body), authenticate)

    def _check(self, scope: Scope) -> RelayClaims:
        """The token's claims; Unauthorized (with the reason) for anything else."""
        if self.verifier is None:
            raise Unauthorized("this node takes no relayed requests (no --relay-trust)")
        token = bearer(scope.get("headers", ()))
        if token is None:
            raise Unauthorized("a relayed request needs a relay token (Authorization: Bearer)")
        try:
            return self.verifier.verify(token)
        except RelayRefused as exc:
            raise Unauthorized(str(exc)) from None

    async def _first_use(self, claims: RelayClaims) -> None:
        """Take the token, once: in this process, or across the cluster's nodes and workers
        (a replay may reach any of them)."""
        cluster = self.services.cluster
        if cluster is None:
            assert self.verifier is not None
            self.verifier.first_use(claims)
        elif not await cluster.first_use(f"relay-token:{claims.jti}", claims.expires + LEEWAY_S):
            raise replayed(claims)

    async def _run(self, call: HttpCall, claims: RelayClaims, raw: bytes) -> None:
        try:
            try:
                await self._first_use(claims)
            except RelayRefused as exc:
                raise Unauthorized(str(exc)) from None
            try:
                body = msgspec.json.decode(raw, type=_Body)
            except msgspec.DecodeError as exc:
                raise InvalidRequest(f"the relayed request does not parse: {exc}") from None
            if body.resume is not None:
                log, generation, after = await self._resumed(call, body.resume, body.after_seq)
            else:
                generation = self._admit(call, body)
                log, after = generation.log, -1
        except SeedanceError as exc:
            await call.fail(exc)
            return
        logger.info(
            "relayed request %s from %s (tenant %s, session %s)%s",
            log.request_id,
            claims.issuer,
            claims.tenant,
            claims.session,
            f" resumed after seq {after}" if after >= 0 else "",
        )
        await stream(call, log, generation, after)

    def _admit(self, call: HttpCall, body: _Body) -> Generation:
        services = self.services
        if body.generate is None:
            raise InvalidRequest("a relayed request has 'generate' or 'resume'")
        frame = {**body.generate, "type": "generate", "request_id": call.request_id}
        frame["resumable"] = True  # a lost relay connection resumes
        limits = FrameLimits(services.config.max_frame_bytes, services.models.max_tokens)
        message = decode_client_text(_encode(frame), limits)
        if not isinstance(message, Generate) or not message.messages:
            raise InvalidRequest("a relayed generate frame carries its whole context: messages")
        model, message = prepare(services, call.arrival, body.model, None, message)
        prompt = explicit_prompt(model, message.messages or (), raw=False, unset=frozenset())
        requester = Requester(call.principal, model, "http")
        call.generation = generation = admit(
            services, call.arrival, requester, message, prompt=prompt
        )
        return generation

    async def _resumed(
        self, call: HttpCall, request_id: str, after_seq: int
    ) -> tuple[StreamLog, Generation | None, int]:
        services = self.services
        tenant = call.principal.name
        log = await services.streams.find(tenant, request_id, request_id, None)
        call.outcome = "resumed"
        return log, services.generations.get(tenant, request_id), after_seq


async def stream(
    call: HttpCall, log: StreamLog, generation: Generation | None, after_seq: int
) -> None:
    """The reply from the log after ``after_seq``, as newline-delimited JSON, to its end."""
    response = call.response
    await response.start(200, NDJSON)
    await response.write(_encode({"type": "start", "request_id": log.request_id}) + b"\n")
    first = after_seq + 1
    with Reading(log, generation, after_seq) as reading:
        async for text, last_seq in reading:
            line = {"type": "token", "text": text, "seq": last_seq, "n": last_seq - first + 1}
            await response.write(_encode(line) + b"\n")
            first = last_seq + 1
    end = reading.end
    if end is None:
        return
    if isinstance(end, ErrorFrame):
        call.outcome = end.error.code
    else:
        call.outcome = end.finish_reason
    await response.write(encode_frame(end).encode() + b"\n", more=False)
