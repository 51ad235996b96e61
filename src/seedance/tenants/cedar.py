"""Access policies in Cedar (``--policy FILE``, docs/policy.md), decided with ``cedarpy``.

A policy file is validated against Seedance's schema (``seedance.cedarschema``: what a policy
can name) when it is loaded; one that does not validate is refused with every error, and a
running server keeps the policies it had (:class:`PolicyFile`, which reloads the file when it
changes). Without ``--policy`` the server decides by the tenants table's rules in Python
(:mod:`seedance.tenants.policy`), which ``default.cedar`` says in Cedar, decision for decision.

Every decision is asked as

- principal ``Seedance::Caller::"CREDENTIAL"`` (in ``Seedance::Tenant::"NAME"``): the key id,
  ``jwt:SUBJECT``, ``cert:SHA256`` or ``relay:ISSUER``, its role and kind, a certificate's
  subject, a token's string claims as its tags;
- action ``generate``, ``embed``, ``use`` (tokenize, the Open Inference Protocol, WASI-NN) or an
  administrative verb (in ``Seedance::Action::"admin"``);
- resource ``Seedance::Model::"NAME"`` (its version), or ``Seedance::Server::"seedance"``;
- context: the request's priority and QoS class, the server's region, the hour, minute and
  weekday (1 Monday .. 7 Sunday) in the policy time zone, end-to-end encryption on or off,
  whether tools were offered, the client's address.

A request is allowed when a ``permit`` matches and no ``forbid`` does; the ids of the policies
that decided (their ``@id`` annotation, else Cedar's ``policyN``) go to its audit record.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import re
import zoneinfo
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

import cedarpy
import msgspec

from seedance.protocol.errors import Forbidden
from seedance.tenants.auth import Principal
from seedance.tenants.policy import may_use

logger = logging.getLogger(__name__)

SCHEMA: Final = resources.files(__package__).joinpath("seedance.cedarschema").read_text()
DEFAULT_POLICY: Final = resources.files(__package__).joinpath("default.cedar").read_text()

#: The actions a policy may name: what a request does, and the administrative verbs.
ADMIN: Final = {"type": "Seedance::Action", "id": "admin"}
ADMIN_ACTIONS: Final = (
    "reload_models",
    "reload_modules",
    "read_tenants",
    "revoke_key",
    "end_session",
    "read_runtime",
)
#: The context's attributes; a policy set is given only those its text names.
CONTEXT: Final = (
    "priority",
    "qos",
    "region",
    "hour",
    "minute",
    "weekday",
    "e2e",
    "tools",
    "client",
)
#: The action hierarchy, which every request's entities carry.
ACTIONS: Final = [
    {"uid": {"type": "Seedance::Action", "id": verb}, "attrs": {}, "parents": [ADMIN]}
    for verb in ADMIN_ACTIONS
]
_AUTHORIZE: Final = cedarpy._internal.is_authorized
_decode: Final = msgspec.json.Decoder(dict[str, Any]).decode
_ACTION_NAMED: Final = re.compile(r' for Seedance::Action::"[^"]*"')
_POLICY_NAMED: Final = re.compile(r"policy `([^`]+)`")
#: Entity sets kept (one per caller and model), and decisions kept: all dropped past this many.
KEPT: Final = 4096


class PolicyError(ValueError):
    """A policy set that does not parse or validate against the schema: every reason."""


class Denied(Forbidden):
    """A request the policies deny: ``policies`` names those that did (for its audit record)."""

    def __init__(self, message: str, policies: tuple[str, ...]) -> None:
        super().__init__(message)
        self.policies = policies


@dataclass(frozen=True, slots=True)
class Ask:
    """What a decision is asked about (see the module)."""

    principal: Principal
    action: str
    model: str | None = None  # None: the server (resume, an administrative verb)
    version: str = ""
    served: tuple[str, ...] = ()  # the models served (a tenant's models are those it may use)
    priority: int = 0
    qos: str = ""
    region: str = ""
    e2e: bool = False
    tools: bool = False
    client: str | None = None  # an IP address
    at: datetime.datetime | None = None  # now


@dataclass(frozen=True, slots=True)
class Decision:
    """Cedar's answer, and why."""

    allowed: bool
    #: The policies that decided: the permits that allowed, or the forbids that denied.
    policies: tuple[str, ...]
    #: What Cedar could not evaluate for this request (a permit among it does not permit; a
    #: forbid denies, named in ``policies``).
    errors: tuple[str, ...] = ()

    def explain(self, ask: Ask) -> str:
        what = f"model {ask.model!r}" if ask.model is not None else "this server"
        who = f"{ask.principal.name} ({ask.principal.credential})"
        if self.errors and not self.allowed and self.policies:
            return (
                f"policy {', '.join(self.policies)} could not be evaluated for {who} to "
                f"{ask.action} {what}, so it denies"
            )
        if self.policies:
            return f"policy {', '.join(self.policies)} forbids {who} to {ask.action} {what}"
        return f"no policy permits {who} to {ask.action} {what}"


class Policies:
    """A policy set, validated against the schema and parsed once."""

    def __init__(self, text: str, source: str = "policy", timezone: str = "UTC") -> None:
        result = cedarpy.validate_policies(text, SCHEMA)
        if not result.validation_passed:
            names = result.id_annotations_by_policy_id
            reasons: dict[str, None] = {}  # each once, not once per action it applies to
            for error in result.errors:
                reason = _ACTION_NAMED.sub("", error.error)
                if error.policy_id in names:
                    reason = reason.replace(f"`{error.policy_id}`", f"`{names[error.policy_id]}`")
                reasons[reason] = None
            raise PolicyError(f"{source}: " + "; ".join(reasons or ["does not validate"]))
        try:
            self._set = cedarpy.PolicySet.from_str(text)
            static = json.loads(cedarpy.policies_to_json_str(text))["staticPolicies"]
        except ValueError as exc:
            raise PolicyError(f"{source}: {exc}") from None
        #: Each policy's name (its @id, else Cedar's policyN), and the forbids among them.
        self._names = {p: s.get("annotations", {}).get("id") or p for p, s in static.items()}
        self._forbids = frozenset(p for p, s in static.items() if s["effect"] == "forbid")
        self.text = text
        self.source = source
        self.count = len(self._set)
        if self.count == 0:  # a file being written, or emptied by mistake: it would deny all
            raise PolicyError(f"{source}: no policy (a server with none would refuse everything)")
        try:
            self.zone = zoneinfo.ZoneInfo(timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise PolicyError(f"no time zone {timezone!r} (an IANA name: Europe/Paris)") from None
        # Only what the policies name is built into each request's context (a policy set
        # validated against the schema names no attribute it lacks).
        self._context = tuple(a for a in CONTEXT if a in text)
        self._entities: dict[tuple[Any, ...], cedarpy.Entities] = {}
        self._decisions: dict[tuple[Any, ...], Decision] = {}
        #: Whether decisions are kept (see :meth:`decide`; off to measure Cedar's own cost).
        self.memo = True

    def decide(self, ask: Ask) -> Decision:
        """Cedar's decision. A decision is a function of the policies, the entities and the
        request alone, so each is kept (``memo``): the same caller asking the same thing in
        the same context (the same minute, when the policies name it) is answered from memory."""
        context = self._context_of(ask)
        key, entities = self._entities_of(ask)
        memo = (key, ask.action, context)
        found = self._decisions.get(memo) if self.memo else None
        if found is not None:
            return found
        request = {
            "principal": {"type": "Seedance::Caller", "id": ask.principal.credential},
            "action": {"type": "Seedance::Action", "id": ask.action},
            "resource": (
                {"type": "Seedance::Model", "id": ask.model}
                if ask.model is not None
                else {"type": "Seedance::Server", "id": "seedance"}
            ),
            "context": context,
        }
        # cedarpy's own call, without its wrapper's copies and JSON round trips (pinned).
        result = _decode(_AUTHORIZE(request, self._set, entities._inner, None, False))
        diagnostics = result.get("diagnostics", {})
        names = self._names
        errors = tuple(str(e) for e in diagnostics.get("errors", ()))
        # Cedar skips a policy it cannot evaluate (an overflow, say); a forbid skipped so
        # would let through what it might have stopped: that denies here, naming it.
        failed = [p for e in errors for p in _POLICY_NAMED.findall(e) if p in self._forbids]
        if failed:
            decision = Decision(False, tuple(names.get(p, p) for p in failed), errors)
        else:
            decision = Decision(
                result["decision"] == "Allow",
                tuple(names.get(p, p) for p in diagnostics.get("reason", ())),
                errors,
            )
        if errors:
            logger.warning(
                "policies %s: a decision for %s (%s) could not evaluate %s",
                self.source,
                ask.principal.name,
                ask.action,
                "; ".join(errors),
            )
        if len(self._decisions) >= KEPT:
            self._decisions.clear()
        self._decisions[memo] = decision
        return decision

    def _context_of(self, ask: Ask) -> str:
        wanted = self._context
        context: dict[str, Any] = {}
        if "priority" in wanted:
            context["priority"] = ask.priority
        if "qos" in wanted:
            context["qos"] = ask.qos
        if "region" in wanted:
            context["region"] = ask.region
        if any(a in wanted for a in ("hour", "minute", "weekday")):
            at = (ask.at or datetime.datetime.now(datetime.timezone.utc)).astimezone(self.zone)
            for name, value in (("hour", at.hour), ("minute", at.minute)):
                if name in wanted:
                    context[name] = value
            if "weekday" in wanted:
                context["weekday"] = at.isoweekday()
        if "e2e" in wanted:
            context["e2e"] = ask.e2e
        if "tools" in wanted:
            context["tools"] = ask.tools
        if "client" in wanted and ask.client is not None and _is_address(ask.client):
            context["client"] = {"__extn": {"fn": "ip", "arg": ask.client}}
        return msgspec.json.encode(context).decode()

    def _entities_of(self, ask: Ask) -> tuple[tuple[Any, ...], cedarpy.Entities]:
        """The entities of ``ask`` (its caller, tenant and model), and what they were built
        from."""
        principal, tenant = ask.principal, ask.principal.tenant
        key = (
            tenant.name,
            tenant.tier,
            tenant.max_priority,
            tenant.models,
            ask.served,
            principal.credential,
            principal.role,
            principal.subject,
            principal.claims,
            ask.model,
            ask.version,
        )
        found = self._entities.get(key)
        if found is not None:
            return key, found
        allowed = [m for m in ask.served if may_use(principal, m)]
        tenant_uid = {"type": "Seedance::Tenant", "id": tenant.name}
        entities: list[dict[str, Any]] = [
            {
                "uid": tenant_uid,
                "attrs": {
                    "tier": tenant.tier,
                    "max_priority": tenant.max_priority,
                    "models": allowed,
                },
                "parents": [],
            },
            {
                "uid": {"type": "Seedance::Caller", "id": principal.credential},
                "attrs": {
                    "tenant": {"__entity": tenant_uid},
                    "role": principal.role,
                    "kind": kind_of(principal.credential),
                    "subject": principal.subject,
                },
                "parents": [tenant_uid],
                "tags": dict(principal.claims),
            },
        ]
        entities += ACTIONS
        if ask.model is not None:
            entities.append(
                {
                    "uid": {"type": "Seedance::Model", "id": ask.model},
                    "attrs": {"name": ask.model, "version": ask.version},
                    "parents": [],
                }
            )
        built = cedarpy.Entities.from_json_str(json.dumps(entities))
        if len(self._entities) >= KEPT:
            self._entities.clear()
        self._entities[key] = built
        return key, built


def kind_of(credential: str) -> str:
    """``key``, ``token``, ``certificate``, ``relay`` or ``open``, from how it is named."""
    if credential == "-":
        return "open"
    prefix = credential.partition(":")[0]
    return {"jwt": "token", "cert": "certificate", "relay": "relay"}.get(prefix, "key")


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def load(path: Path, timezone: str = "UTC") -> Policies:
    """The policies of the file at ``path``; :class:`PolicyError` when it cannot be used."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: {getattr(exc, 'strerror', None) or exc}") from None
    return Policies(text, str(path), timezone)


class PolicyFile:
    """The server's policies: the file ``--policy`` names, reloaded when it changes (the access
    watcher says when); a file that does not load keeps the policies there were, and the log
    says why."""

    def __init__(self, path: Path, timezone: str = "UTC") -> None:
        self.path = path
        self.timezone = timezone
        self.policies = load(path, timezone)

    def describe(self) -> str:
        return f"{self.policies.count} Cedar policies from {self.path}"

    def decide(self, ask: Ask) -> Decision:
        return self.policies.decide(ask)

    def check(self, ask: Ask) -> Decision:
        """The decision, or :class:`Forbidden` naming the policies that denied."""
        decision = self.policies.decide(ask)
        if not decision.allowed:
            raise Denied(decision.explain(ask), decision.policies)
        return decision

    def reload(self) -> bool:
        try:
            self.policies = load(self.path, self.timezone)
        except PolicyError as exc:
            logger.error("policies not reloaded, the old ones stay: %s", exc)
            return False
        logger.info("policies reloaded: %s", self.describe())
        return True
