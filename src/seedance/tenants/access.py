"""The server's door: origins, credentials, the tenant tables and the access policies (the
tenants table's rules, or Cedar's with ``--policy``), reloaded as their files change."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from seedance.config import ConfigError, ServerConfig
from seedance.config_loader import load_access
from seedance.protocol.errors import Forbidden
from seedance.tenants import cedar, policy
from seedance.tenants.auth import (
    OPEN_PRINCIPAL,
    Authenticator,
    Principal,
    certificate_of,
    client_address,
    credential_of,
)
from seedance.tenants.cedar import Ask, PolicyFile
from seedance.tenants.config import AccessConfig, Tenant
from seedance.tenants.keys import revoke_key

logger = logging.getLogger(__name__)

#: How often the config file is checked for changed tenants and keys.
RELOAD_INTERVAL_S: Final = 1.0


class Access:
    """Who may connect: the browser origins allowed, and the tenants' credentials.

    ``on_revoked`` is called with the ids of keys that stopped passing (revoked or removed from
    the file), and ``on_subjects_dropped`` with the client certificate subjects that no longer
    stand for the tenant they did, so that the connections holding them are closed at once.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config_file = Path(config.config_file) if config.config_file else None
        self.authenticator = Authenticator(config.access or AccessConfig())
        self.allowed_origins = frozenset(config.allowed_origins)
        self.on_revoked: Callable[[set[str]], None] | None = None
        self.on_subjects_dropped: Callable[[set[str]], None] | None = None
        #: Keys revoked on other nodes of the cluster: refused here too, after every reload.
        self._revoked_elsewhere: set[str] = set()
        self._watcher: asyncio.Task[None] | None = None
        #: The Cedar policies (``--policy``); None: the tenants table's rules decide.
        self.policies: PolicyFile | None = None
        if config.policy.file is not None:
            try:
                self.policies = PolicyFile(Path(config.policy.file), config.policy.timezone)
            except cedar.PolicyError as exc:
                raise ConfigError(f"--policy: {exc}") from None
        self._config = None if self.config_file is None else WatchedFile(self.config_file)
        #: The files read again when they change, and what reads them.
        self._watched: list[tuple[WatchedFile, Callable[[], object]]] = []
        if self._config is not None:
            self._watched.append((self._config, self.reload))
        if self.policies is not None:
            self._watched.append((WatchedFile(self.policies.path), self.policies.reload))
        self.region = dict(config.labels).get("region", "")

    @property
    def open(self) -> bool:
        return self.authenticator.open

    def describe(self) -> str:
        """One line for the startup log."""
        access = self.authenticator.access
        if access.open:
            return (
                "no tenants configured: the server is open to anyone who can reach it "
                "(add one with: seedance keys add TENANT --config FILE)"
            )
        keys = sum(1 for t in access.tenants.values() for k in t.keys if not k.revoked)
        jwt = access.auth.jwt
        tokens = f", JWTs ({', '.join(self.authenticator.jwt_algorithms)})" if jwt else ""
        subjects = sum(len(t.tls_subjects) for t in access.tenants.values())
        certs = f", {subjects} client certificate subject(s)" if subjects else ""
        return f"{len(access.tenants)} tenant(s), {keys} API key(s){tokens}{certs}"

    # ------------------------------------------------------------------ decisions

    def check_model(
        self, principal: Principal, model: str, version: str, served: Iterable[str], action: str
    ) -> None:
        """May ``principal`` ``action`` (generate, embed, use) ``model``? Forbidden if not. With
        policies a generation is decided once, at its admission (:meth:`check_generation`),
        where its priority is known."""
        if self.policies is None:
            policy.check_model(principal, model, served)
        elif action != "generate":
            self.policies.check(Ask(principal, action, model, version, tuple(served)))

    def lists(
        self,
        principal: Principal,
        model: str,
        version: str,
        served: Iterable[str],
        task: str,
        peer: str,
    ) -> bool:
        """Whether ``GET /v1/models`` lists ``model`` (one that does ``task``) to ``principal``:
        the tenants table's patterns, or whether the policies let it ``task`` the model now."""
        if self.policies is None:
            return policy.may_use(principal, model)
        ask = Ask(principal, task, model, version, tuple(served), region=self.region,
                  client=_address(peer))  # fmt: skip
        return self.policies.decide(ask).allowed

    def check_generation(
        self,
        principal: Principal,
        model: str,
        version: str,
        served: Iterable[str],
        *,
        priority: int,
        qos: str,
        tools: bool,
        e2e: bool,
        peer: str,
    ) -> tuple[str, ...] | None:
        """May ``principal`` generate with ``model`` at ``priority``? Forbidden if not; the
        policies that allowed it (None without policies)."""
        if self.policies is None:
            policy.check_priority(principal, priority)
            return None
        ask = Ask(
            principal, "generate", model, version, tuple(served), priority=priority, qos=qos,
            region=self.region, e2e=e2e, tools=tools, client=_address(peer),
        )  # fmt: skip
        return self.policies.check(ask).policies

    def check_resume(self, principal: Principal, peer: str, *, e2e: bool = False) -> None:
        """May ``principal`` follow one of its replies again? (Always, by the tenants table.)"""
        if self.policies is not None:
            ask = Ask(principal, "resume", region=self.region, e2e=e2e, client=_address(peer))
            self.policies.check(ask)

    def check_admin(self, principal: Principal, verb: str, peer: str) -> None:
        """May ``principal`` (at ``peer``) do the administrative ``verb``? Forbidden if not."""
        if self.open:
            raise Forbidden(
                "this server has no tenants, so no administrators: configure an admin key"
            )
        if self.policies is None:
            if principal.role != "admin":
                raise Forbidden(f"credential {principal.credential} is not an admin's")
            return
        self.policies.check(Ask(principal, verb, region=self.region, client=_address(peer)))

    def check_origin(self, headers: Iterable[tuple[bytes, bytes]]) -> None:
        """Refuse a browser handshake from an origin not on the allow-list (when there is one);
        clients that send no ``Origin`` (not browsers) pass."""
        if not self.allowed_origins:
            return
        for name, value in headers:
            if name == b"origin":
                origin = value.decode("latin-1").rstrip("/")
                if origin not in self.allowed_origins:
                    raise Forbidden(f"origin {origin[:200]} is not allowed")
                return

    def authenticate(self, scope: Mapping[str, Any]) -> Principal:
        """The caller of an ASGI request (WebSocket or HTTP): its credential, else its client
        certificate."""
        if self.authenticator.open:
            return OPEN_PRINCIPAL
        credential = credential_of(scope)
        certificate = None if credential else certificate_of(scope)  # a credential counts first
        return self.authenticator.authenticate(credential, client_address(scope), certificate)

    def relayed(self, tenant: str, issuer: str) -> Principal:
        """The caller of a request relayed by the edge gateway ``issuer`` for ``tenant``
        (whose relay token was checked): that tenant of this node, or, on an open node, a
        tenant of that name with the open defaults. Forbidden for a tenant this node lacks."""
        credential = f"relay:{issuer}"
        if self.authenticator.open:
            return Principal(Tenant(name=tenant, max_priority=10), credential, "user")
        found = self.authenticator.access.tenants.get(tenant)
        if found is None:
            raise Forbidden(f"tenant {tenant!r} is not a tenant of this node")
        return Principal(found, credential, "user")

    # ------------------------------------------------------------------ reloads

    async def start(self) -> None:
        if self._watched and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="access-reload")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            for file, read in self._watched:
                if file.changed():
                    read()

    def revoke(self, key_id: str) -> str:
        """Revoke a key now: in the config file when there is one (so that it stays revoked),
        and in memory; its connections are closed. Returns the key's tenant."""
        tenants = self.authenticator.access.tenants.values()
        tenant = next((t.name for t in tenants for k in t.keys if k.id == key_id), None)
        if tenant is None:
            raise KeyError(key_id)
        if self._config is not None:
            revoke_key(self._config.path, key_id)
            self._config.seen()
            self.reload()
        else:
            before = self.authenticator.key_ids()
            self.authenticator.revoke(key_id)
            if self.on_revoked is not None and key_id in before:
                self.on_revoked({key_id})
        return tenant

    def revoke_elsewhere(self, key_ids: set[str]) -> set[str]:
        """Keys another node of the cluster revoked: refused here from now on, whatever the
        tenants file says. Returns those that passed until now."""
        self._revoked_elsewhere |= key_ids
        passing = self.authenticator.key_ids() & key_ids
        for key_id in passing:
            self.authenticator.revoke(key_id)
        return passing

    def reload(self) -> bool:
        """Read the tenants and keys again; a bad file is logged and the old tables kept."""
        assert self.config_file is not None
        try:
            access = load_access(self.config_file) or AccessConfig()
        except ConfigError as exc:
            logger.error("tenants not reloaded, the old ones stay: %s", exc.message)
            return False
        before, subjects_before = self.authenticator.key_ids(), self.authenticator.subjects()
        self.authenticator.load(access)
        for key_id in self._revoked_elsewhere:
            self.authenticator.revoke(key_id)
        gone = before - self.authenticator.key_ids()
        subjects = self.authenticator.subjects()
        dropped = {s for s, tenant in subjects_before.items() if subjects.get(s) != tenant}
        logger.info("tenants reloaded from %s: %s", self.config_file, self.describe())
        if gone and self.on_revoked is not None:
            self.on_revoked(gone)
        if dropped and self.on_subjects_dropped is not None:
            self.on_subjects_dropped(dropped)
        return True


class WatchedFile:
    """A file read again when it changes: its modification time and size as last seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen()

    def seen(self) -> None:
        """Take the file as it is now for read (this process wrote it itself)."""
        self._stamp = self._now()

    def changed(self) -> bool:
        """Whether it changed since last seen (then it counts as seen); a file gone has not."""
        stamp = self._now()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        return True

    def _now(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size


def _address(peer: str) -> str | None:
    """The address of a ``host:port`` peer (None: not known)."""
    return peer.rpartition(":")[0] or None
