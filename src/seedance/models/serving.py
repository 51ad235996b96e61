"""Serving a registry's model: verified at start and at every reload, swapped without
dropping a stream.

At start the promoted version of ``--model`` is verified (:func:`~seedance.models.registry.
verify`) before its engine reads a byte; a refusal stops the start with the reason. A reload
(``POST /admin/models/reload``, or the watcher every ``--model-watch-s`` seconds when the
promoted version changed) verifies the new version, loads it beside the old one, warms it
with one generation, then swaps it in atomically: requests admitted from then on go to it,
requests in flight finish on the old one, which is closed once the last has ended. One reload
at a time, so never more than two versions in memory. A refused or failed reload leaves the
running version serving; every outcome is logged and written to the audit log.

Signing writes a version's signature last, so a version without one (``manifest.sig`` or
``model.sig``) is still being written: a reload waits for it (``waiting``), and refuses nothing.
A refused version is not checked again until a file of it changes (a version copied in file
by file is checked again as its files arrive, whatever their order).

Sessions that move to the new version are prefilled again from their text: each version has
its engine, so no session is given another model's KV cache.

A version lower than the one served is refused (``rollback``) when it comes as the newest
version; an operator rolls back by promoting the older version (``seedance models promote``),
which is then loaded like any other.

**Canaries.** ``NAME/CANARY`` (``seedance models canary``) names a version and a share: it is
loaded beside the stable version and takes that share of the sessions, by a hash of the session
id (sticky: a session stays on the version it got, on every node). Promoting the canary makes it
the stable version without loading anything; removing it retires it. Two versions at most: a
new stable version other than the canary retires the canary first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from seedance.config import ConfigError, ServerConfig
from seedance.engines.base import Engine, GenerationRequest, SamplingParams
from seedance.engines.registry import create_engine, engine_spec
from seedance.models.openssf import BUNDLE
from seedance.models.registry import (
    PROMOTED,
    SIGNATURE,
    ModelRefused,
    Registry,
    VerifiedModel,
    verify,
)
from seedance.models.signing import TrustedKey, load_trusted
from seedance.observability.audit import kinds as audit
from seedance.protocol.messages import ChatMessage, RequestId

if TYPE_CHECKING:
    from collections.abc import Callable

    from seedance.server.lifecycle.audit import AuditGate
    from seedance.server.lifecycle.models import ModelTable, ServedModel

logger = logging.getLogger(__name__)

Outcome = Literal["loaded", "unchanged", "waiting", "refused", "failed"]
RETIRE_POLL_S = 0.05
#: A version's files: each entry's path, size and modification time.
Fingerprint = tuple[tuple[str, int, int], ...]


@dataclass(frozen=True, slots=True)
class Reload:
    """What a reload of one model (its stable version, or its canary) did."""

    model: str
    outcome: Outcome
    version: str  # the version served after it ("": no canary)
    reason: str | None = None
    message: str | None = None
    role: str = "stable"
    share: float | None = None  # a canary's


class ModelManager:
    """The registry a server serves from, and its reloads."""

    def __init__(self, config: ServerConfig) -> None:
        assert config.registry.path is not None
        if not config.registry.trust:
            raise ConfigError("--model-registry needs --model-trust (the signers' public keys)")
        self.config = config
        self.registry = Registry(Path(config.registry.path))
        try:
            self.trusted: dict[str, TrustedKey] = load_trusted(
                [Path(p) for p in config.registry.trust]
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model-trust: {exc}") from None
        names = self.registry.names()
        #: The models served (the first is the default): --model's, comma-separated, else all.
        self.names = [n.strip() for n in config.model.split(",")] if config.model else names
        unknown = [n for n in self.names if n not in names]
        if unknown or not self.names:
            listed = ", ".join(names) or "none"
            raise ConfigError(
                f"--model: the registry's models ({listed}) in {self.registry.root}, not "
                f"{', '.join(unknown) or 'none'}"
            )
        self._lock = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self._retiring: asyncio.Task[None] | None = None
        #: Versions refused, by (name, version): their files when refused, and the answer.
        self._refused: dict[tuple[str, str], tuple[Fingerprint, Reload]] = {}
        #: Versions seen without a signature yet (logged once).
        self._unsigned: set[tuple[str, str]] = set()
        #: What it serves into, what it audits to, and whether a version still has requests
        #: (set by :meth:`start`).
        self.table: ModelTable | None = None
        self._audit: AuditGate | None = None
        self._in_use: Callable[[ServedModel], bool] = lambda _: False
        self.reloads = 0

    # ---------------------------------------------------------------- loading

    def initial(self) -> list[tuple[Engine, VerifiedModel]]:
        """Each model's promoted version, verified, and its engine (not started)."""
        return [self._initial(name) for name in self.names]

    def _initial(self, name: str) -> tuple[Engine, VerifiedModel]:
        version = self.registry.promoted(name)
        if version is None:
            raise ConfigError(f"model {name}: no version in {self.registry.root}")
        try:
            verified = verify(
                self.registry.path(name, version),
                self.trusted,
                expected=(name, version),
            )
        except ModelRefused as exc:
            raise ConfigError(
                f"model {name} {version} refused ({exc.reason}): {exc.message}"
            ) from None
        logger.info(
            "model %s %s verified (key %s, manifest sha256 %s)",
            name,
            version,
            verified.key.id,
            verified.manifest_sha256[:16],
        )
        return self.engine_for(verified), verified

    def engine_for(self, verified: VerifiedModel) -> Engine:
        """An engine over the verified files, with the manifest's engine and options."""
        manifest = verified.manifest
        spec = engine_spec(manifest.engine)
        known = {f.name for f in dataclasses.fields(spec.options)}
        unknown = sorted(set(manifest.engine_options) - known)
        if unknown:
            raise ConfigError(
                f"model {manifest.name} {manifest.version}: engine option(s) {', '.join(unknown)} "
                f"are not {manifest.engine}'s"
            )
        weights = verified.file(".gguf")
        config = dataclasses.replace(
            self.config,
            engine=manifest.engine,
            model=manifest.name,
            model_path=str(weights if weights is not None else verified.path),
            engine_options=spec.options(**manifest.engine_options),
        )
        return create_engine(config)

    def audit(self, name: str, action: Any, version: str, **fields: Any) -> None:
        if self._audit is not None:
            record = audit.ModelEvent(action=action, model=name, version=version, **fields)
            self._audit.submit(lambda: record)

    # ---------------------------------------------------------------- reloading

    async def reload(self) -> list[Reload]:
        """Serve the promoted version, and the canary the registry names (see the module)."""
        async with self._lock:
            done = []
            for name in self.names:
                done += [await self._reload_stable(name), await self._reload_canary(name)]
            return done

    async def _reload_stable(self, name: str) -> Reload:
        table = self.table
        assert table is not None
        current = table[name]
        version = self.registry.promoted(name)
        if version is None or version == current.version:
            return Reload(name, "unchanged", current.version)
        canary = table.canaries.get(name)
        if canary is not None and canary[0].version == version:
            # The canary promoted: it serves everyone now, no load needed.
            table.drop_canary(name)
            table.swap(canary[0])
            logger.info("model %s %s promoted from canary", name, version)
            self.audit(name, "loaded", version, manifest_sha256=canary[0].manifest_sha256)
            self._retire_later(current)
            return Reload(name, "loaded", version)
        if canary is not None:  # never more than two versions: the canary goes first
            table.drop_canary(name)
            self._retire_later(canary[0])
        explicit = (self.registry.root / name / PROMOTED).is_file()
        served = None if explicit else current.version
        loaded = await self._load(name, version, current.version, served)
        if isinstance(loaded, Reload):
            return loaded
        table.swap(loaded)  # from now on, new requests go to it
        logger.info(
            "model %s %s serving (was %s); the old version ends its requests",
            name,
            version,
            current.version,
        )
        self._retire_later(current)
        return Reload(name, "loaded", version)

    async def _reload_canary(self, name: str) -> Reload:
        table = self.table
        assert table is not None
        wanted = self.registry.canary(name)
        loaded = table.canaries.get(name)
        stable = table[name].version
        if wanted is None or wanted[0] == stable:
            if loaded is not None:
                table.drop_canary(name)
                self._retire_later(loaded[0])
            return Reload(name, "unchanged", "", role="canary")
        version, share = wanted
        if loaded is not None and loaded[0].version == version:
            table.set_canary(loaded[0], share)  # a new share only
            return Reload(name, "unchanged", version, role="canary", share=share)
        if loaded is not None:
            table.drop_canary(name)
            self._retire_later(loaded[0])
        model = await self._load(name, version, stable, None, role="canary")
        if isinstance(model, Reload):
            return model
        table.set_canary(model, share)
        logger.info("model %s %s canary for %g of the sessions", name, version, share)
        return Reload(name, "loaded", version, role="canary", share=share)

    async def _load(
        self, name: str, version: str, current: str, served: str | None, role: str = "stable"
    ) -> ServedModel | Reload:
        """Verify, load and warm ``version``; a :class:`Reload` saying why when it is not.
        A version without a signature yet is waited for; one refused before is not checked
        again (nor logged, nor audited) until a file of it changes."""
        path = self.registry.path(name, version)
        if not any((path / signature).exists() for signature in (SIGNATURE, BUNDLE)):
            message = f"{version} has no {SIGNATURE} or {BUNDLE} yet"
            if (name, version) not in self._unsigned:
                self._unsigned.add((name, version))
                logger.info("model %s %s: waiting for its signature", name, version)
            return Reload(name, "waiting", current, "unsigned", message, role)
        files = await asyncio.to_thread(fingerprint, path)
        known = self._refused.get((name, version))
        if known is not None and known[0] == files:
            return dataclasses.replace(known[1], version=current)
        await self._settled()  # the previous old version is gone first: two at most
        check = functools.partial(
            verify, path, self.trusted, served=served, expected=(name, version)
        )
        try:
            verified = await asyncio.to_thread(check)
        except ModelRefused as exc:
            refused = Reload(name, "refused", current, exc.reason, exc.message, role)
            self._refused[(name, version)] = (files, refused)
            logger.warning(
                "model %s %s refused (%s): %s; %s goes on serving",
                name,
                version,
                exc.reason,
                exc.message,
                current,
            )
            self.audit(name, "refused", version, reason=exc.reason)
            return refused
        try:
            engine = await asyncio.to_thread(self.engine_for, verified)
            await engine.start()
            try:
                await warm(engine)
            except BaseException:
                await engine.close()
                raise
        except Exception as exc:
            logger.exception(
                "model %s %s failed to load; %s goes on serving", name, version, current
            )
            self.audit(name, "refused", version, reason="load_failed")
            return Reload(name, "failed", current, "load_failed", str(exc), role)
        from seedance.server.lifecycle.models import ServedModel

        self.reloads += 1
        self.audit(
            name, "loaded", version, key=verified.key.id, manifest_sha256=verified.manifest_sha256
        )
        return ServedModel.of(
            self.config,
            engine,
            verified.version,
            verified.manifest_sha256,
            verified.manifest.limits,
        )

    def _retire_later(self, old: ServedModel) -> None:
        """Retire ``old`` in the background (after the one retiring before it)."""
        previous = self._retiring

        async def retire() -> None:
            if previous is not None:
                await previous
            await self._retire(old)

        self._retiring = asyncio.create_task(retire(), name=f"retire-{old.name}-{old.version}")

    async def _settled(self) -> None:
        """Wait until the versions being retired are gone."""
        if self._retiring is not None:
            await asyncio.shield(self._retiring)

    async def _retire(self, old: ServedModel) -> None:
        """Close ``old`` once no generation uses it (in flight or waiting for admission)."""
        # Polled: generations end from many places, and a retire may wait a tick more.
        while self._in_use(old):  # noqa: ASYNC110
            await asyncio.sleep(RETIRE_POLL_S)
        await old.engine.close()
        logger.info("model %s %s retired", old.name, old.version)
        self.audit(old.name, "retired", old.version)

    # ---------------------------------------------------------------- watching

    def start(
        self, table: ModelTable, audit_gate: AuditGate, in_use: Callable[[ServedModel], bool]
    ) -> None:
        """Serve into ``table`` from now on (its versions audited to ``audit_gate``; one is
        retired once ``in_use`` says no request needs it), and watch the registry."""
        self.table, self._audit, self._in_use = table, audit_gate, in_use
        if self.config.registry.watch_s > 0 and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="model-watch")

    async def stop(self) -> None:
        """No more reloads (the server is stopping)."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None

    async def close(self) -> None:
        """After the server's own close (its generations are over): the old versions go."""
        await self.stop()
        await self._settled()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.registry.watch_s)
            try:
                await self.reload()
            except Exception:  # the next round tries again; never silently
                logger.exception("the model registry's watch failed; it tries again")


async def warm(engine: Engine) -> None:
    """One generation of one token: the model answers before it is swapped in."""
    messages = (ChatMessage("user", "Hello"),)
    request = GenerationRequest(
        request_id=RequestId("warm-up"),
        messages=messages,
        params=SamplingParams(max_tokens=1, temperature=0.0),
        prompt_tokens=engine.prompt_tokens(messages),
    )
    stream = engine.generate(request)
    try:
        async for _ in stream:
            pass
    finally:
        await stream.aclose()


def fingerprint(path: Path) -> Fingerprint:
    """Every entry under ``path`` (symlinks not followed) with its size and mtime."""
    entries = []
    for folder, directories, files in os.walk(path):
        for entry in directories + files:
            full = os.path.join(folder, entry)
            try:
                stat = os.lstat(full)
            except OSError:  # gone since it was listed
                continue
            entries.append((os.path.relpath(full, path), stat.st_size, stat.st_mtime_ns))
    return tuple(sorted(entries))
