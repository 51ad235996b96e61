"""Tenants' WebAssembly modules as the server serves them (docs/modules.md): the registry's
promoted versions, verified and compiled at start (:class:`ModuleTable`), and the ones a
request runs through (:class:`RequestModules`). The served models they reach through WASI-NN
are :mod:`seedance.server.wasi_nn`'s; the sandbox itself is :mod:`seedance.wasm`.

A module version is a directory of the module registry (``--module-registry ROOT``:
``NAME/VERSION/`` holding one ``.wasm`` file), signed as a model version is, with ``seedance
models sign DIR --engine wasm`` and these options in its signed manifest:

=========================  ======================================================================
``tenant``                 the one tenant that may use it (absent: every tenant)
``imports``                import modules it needs beyond Seedance's own, comma-separated (only
                           ``wasi_snapshot_preview1``); the tenant's ``wasm_imports`` must allow
                           each
``models``                 the served models it may load through WASI-NN, comma-separated
                           (absent: those its tenant may use)
``fuel``, ``memory_mb``,   lower limits than the server's (``--module-fuel``, ...)
``wall_ms``
=========================  ======================================================================

Its roles are the ``seedance_*`` functions it exports. A request runs through its tenant's
``modules`` (every request of the tenant) and the ones it names (``modules`` in ``generate``):
pre-processors over each user turn of the request, stream filters over the reply's deltas,
post-processors over a whole reply (``stream: false`` only: a streamed reply cannot be taken
back). A pipeline (``seedance_run``) is an Open Inference Protocol model of its own. Every call
runs in a thread of the module pool, never on the event loop; a module that fails ends its
request with ``module_error`` (its ``reason``: ``trap``, ``fuel``, ``timeout``, ...), counted in
``seedance_module_calls_total`` and audited with the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, TypeVar

from msgspec import UNSET, structs

from seedance.config import ConfigError
from seedance.engines.base import TokenDelta
from seedance.observability.audit.kinds import ModuleEvent
from seedance.protocol.errors import (
    Forbidden,
    InvalidRequest,
    ModuleError,
    SeedanceError,
)
from seedance.protocol.messages import ChatMessage, Generate, TokenLogprob
from seedance.sessions.session import Turn
from seedance.wasm import (
    CompiledModule,
    Instance,
    Limits,
    ModuleFailed,
    ModuleRefused,
    WasmError,
    WasmHost,
    abi,
)

if TYPE_CHECKING:
    from seedance.config import ModulesConfig, ServerConfig
    from seedance.observability.metrics import Metrics
    from seedance.server.lifecycle.models import ServedModel
    from seedance.server.lifecycle.request import Prompt
    from seedance.tenants.auth import Principal

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Threads that run module calls (each call is bounded by its wall-clock limit).
POOL_THREADS: Final = 8


@dataclass(frozen=True, slots=True)
class ServedModule:
    """A module version served: verified, compiled, and what its manifest allows."""

    name: str
    version: str
    module: CompiledModule
    limits: Limits
    tenant: str | None = None
    imports: frozenset[str] = frozenset()
    models: tuple[str, ...] | None = None
    manifest_sha256: str = ""
    key: str = ""  # the id of the key that signed it

    @property
    def label(self) -> str:
        return f"{self.name}@{self.version}"

    def has(self, role: str) -> bool:
        return role in self.module.roles

    def usable_by(self, tenant: str) -> bool:
        """Whether ``tenant`` may use it: its own tenant's, or every tenant's."""
        return self.tenant is None or self.tenant == tenant


def load_modules(config: ServerConfig, metrics: Metrics) -> ModuleTable:
    """The module registry ``config`` names, loaded for serving: one wasmtime host for the
    server (its compiled modules cached on disk beside the server's other caches)."""
    from seedance.engines.llamacpp.cpu import cache_dir

    host = WasmHost(cache_dir() / "wasm")
    table = ModuleTable.load(config.modules, host)
    table.metrics = metrics
    return table


class ModuleLoadRefused(Exception):
    """A module version that cannot be served; ``reason`` names the rule (the model
    registry's refusals, ``bad_manifest``, ``bad_module``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ModuleTable:
    """Every module of the registry, by name (its promoted version), and the pool its calls
    run in."""

    def __init__(
        self,
        modules: dict[str, ServedModule],
        host: WasmHost | None = None,
        metrics: Metrics | None = None,
        config: ModulesConfig | None = None,
    ) -> None:
        self.modules = modules
        self.host = host
        self.metrics = metrics
        self.config = config
        #: Where a reload's events are audited (the audit gate's submit; None: not audited).
        self.audit: Callable[[Callable[[], ModuleEvent]], Any] | None = None
        self._refused: dict[str, str] = {}  # the version of each name last refused
        self._reloading = threading.Lock()  # the watcher's and an admin's, one at a time
        self._watcher: asyncio.Task[None] | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(POOL_THREADS, "wasm")

    @classmethod
    def load(cls, config: ModulesConfig, host: WasmHost) -> ModuleTable:
        """The registry's promoted versions, each verified then compiled; any that fails stops
        the server from starting, saying which and why."""
        table = cls({}, host, config=config)
        for name, version in table._promoted():
            try:
                table.modules[name] = table._verified(name, version)
            except ModuleLoadRefused as exc:
                raise ConfigError(
                    f"module {name} {version} refused ({exc.reason}): {exc}"
                ) from None
        return table

    def _promoted(self) -> list[tuple[str, str]]:
        from seedance.models.registry import Registry

        assert self.config is not None and self.config.path is not None
        registry = Registry(Path(self.config.path))
        found = ((name, registry.promoted(name)) for name in registry.names())
        return [(name, version) for name, version in found if version is not None]

    def _verified(self, name: str, version: str) -> ServedModule:
        """Version ``version`` of module ``name``, verified then compiled
        (:class:`ModuleLoadRefused`, with the reason, when it cannot be served)."""
        from seedance.models.registry import ModelRefused, Registry, verify
        from seedance.models.signing import load_trusted

        config, host = self.config, self.host
        assert config is not None and config.path is not None and host is not None
        trusted = load_trusted([Path(p) for p in config.trust])
        if not trusted:
            raise ConfigError("--module-registry needs the keys it trusts: --module-trust")
        folder = Registry(Path(config.path)).path(name, version)
        try:
            verified = verify(folder, trusted, expected=(name, version))
        except ModelRefused as exc:
            raise ModuleLoadRefused(exc.reason, exc.message) from None
        manifest = verified.manifest
        if manifest.engine != "wasm":
            raise ModuleLoadRefused("bad_manifest", f"signed for engine {manifest.engine}")
        files = [s.name for s in verified.files if s.name.endswith(".wasm")]
        if len(files) != 1:
            raise ModuleLoadRefused("bad_manifest", f"one .wasm file, found {len(files)}")
        try:
            compiled = host.compile((verified.path / files[0]).read_bytes())
            module = served_module(name, version, compiled, manifest.engine_options, config)
        except (WasmError, ConfigError) as exc:
            raise ModuleLoadRefused("bad_module", str(exc)) from None
        logger.info("module %s %s: roles %s", name, version, ", ".join(sorted(compiled.roles)))
        return replace(module, manifest_sha256=verified.manifest_sha256, key=verified.key.id)

    def reload(self) -> list[ModuleEvent]:
        """Serve the registry's promoted versions now (``POST /admin/modules/reload``): a
        changed one verified and compiled, then swapped in (requests that began keep the one
        they run through), one that is refused left as it was served, one gone from the
        registry no longer served. Blocking (compiling): call it off the event loop."""
        events = []
        modules = dict(self.modules)
        promoted = dict(self._promoted())
        for name, version in promoted.items():
            served = modules.get(name)
            if served is not None and served.version == version:
                continue
            if self._refused.get(name) == version:  # refused once: not again every round
                continue
            try:
                modules[name] = module = self._verified(name, version)
            except ModuleLoadRefused as exc:
                self._refused[name] = version
                logger.warning("module %s %s refused (%s): %s", name, version, exc.reason, exc)
                events.append(
                    ModuleEvent(action="refused", module=name, version=version, reason=exc.reason)
                )
                continue
            events.append(
                ModuleEvent(
                    action="loaded", module=name, version=version, key=module.key or UNSET,
                    manifest_sha256=module.manifest_sha256 or UNSET,
                )
            )  # fmt: skip
        for name in sorted(set(modules) - set(promoted)):
            gone = modules.pop(name).version
            events.append(ModuleEvent(action="removed", module=name, version=gone))
        self.modules = modules
        if self.audit is not None:
            for event in events:
                self.audit(functools.partial(_same, event))
        return events

    def start(self) -> None:
        """Watch the registry every ``--module-watch-s`` seconds (0: no watch)."""
        if self.config is not None and self.config.watch_s > 0 and self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(), name="module-watch")

    async def _watch(self) -> None:
        assert self.config is not None
        while True:
            await asyncio.sleep(self.config.watch_s)
            try:
                await asyncio.to_thread(self.reload)
            except Exception:  # the next round tries again; never silently
                logger.exception("the module registry's watch failed; it tries again")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.host is not None:
            self.host.close()

    def get(
        self,
        principal: Principal,
        name: str,
        missing: type[SeedanceError] = InvalidRequest,
    ) -> ServedModule:
        """The module ``name`` as ``principal`` may use it; one of another tenant is as
        unknown as one that does not exist (no probing), refused with ``missing``."""
        module = self.modules.get(name)
        if module is None or not module.usable_by(principal.name):
            known = sorted(n for n, m in self.modules.items() if m.usable_by(principal.name))
            raise missing(
                f"modules: {name!r} is not served here"
                + (f"; modules of yours: {', '.join(known)}" if known else "")
            )
        refused = sorted(module.imports - set(principal.tenant.wasm_imports))
        if refused:
            raise Forbidden(
                f"module {name} asks for {', '.join(refused)}, which tenant {principal.name}'s "
                "wasm_imports do not allow"
            )
        return module

    def for_request(
        self, principal: Principal, named: Sequence[str], *, stream: bool
    ) -> RequestModules | None:
        """The modules a request runs through: its tenant's, then those it names (None:
        none); refused before any token when one cannot serve it."""
        names = list(dict.fromkeys([*principal.tenant.modules, *named]))
        if not names:
            return None
        chosen = [self.get(principal, name) for name in names]
        for module in chosen:
            if not module.module.roles & {"preprocess", "filter", "postprocess"}:
                raise InvalidRequest(
                    f"modules: {module.name} is a pipeline (seedance_run), not a pre-processor, "
                    "filter or post-processor: call it at /v2/models/{name}/infer"
                )
            if stream and module.has("postprocess") and not module.has("filter"):
                raise InvalidRequest(
                    f"modules: {module.name} post-processes whole replies; this one streams "
                    "(stream: false, or a stream filter)"
                )
        return RequestModules(self, principal, chosen, stream=stream)

    async def call(self, module: ServedModule, role: str, work: Callable[[], T]) -> T:
        """``work`` (a call into ``module``) in the pool; a module's failure becomes the
        request's :class:`ModuleError`."""
        try:
            return await self.run(work)
        except WasmError as exc:
            raise self.failure(module, role, exc) from None

    async def run(self, work: Callable[[], T]) -> T:
        """``work`` in the module pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    def failure(self, module: ServedModule, role: str, exc: WasmError) -> ModuleError:
        """The request's error for ``module``'s failure (counted)."""
        if isinstance(exc, ModuleRefused):
            reason, what = "refused", f"refused (code {exc.code}): {exc.message}"
        elif isinstance(exc, ModuleFailed):
            reason, what = exc.reason, f"failed: {exc.reason}: {exc.message}"
        else:
            reason, what = "trap", str(exc)
        self._count(module, role, reason)
        return ModuleError(reason, f"module {module.label} ({role}) {what}")

    def _count(self, module: ServedModule, role: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.module_calls.labels(module.name, role, outcome).inc()

    def ok(self, module: ServedModule, role: str) -> None:
        self._count(module, role, "ok")


def modules_for(
    table: ModuleTable | None, principal: Principal, message: Generate
) -> RequestModules | None:
    """The modules a request runs through (its tenant's and those it names; None: none),
    the same wherever it starts: admitted here, or taken over from a node that died."""
    named = message.modules or ()
    if not named and not principal.tenant.modules:
        return None
    if table is None:
        raise InvalidRequest("modules: this server runs no WebAssembly modules (--module-registry)")
    return table.for_request(principal, named, stream=message.stream)


def _names(options: dict[str, Any], key: str) -> tuple[str, ...] | None:
    value = options.get(key)
    if value is None:
        return None
    return tuple(part.strip() for part in str(value).split(",") if part.strip())


def served_module(
    name: str,
    version: str,
    compiled: CompiledModule,
    options: dict[str, Any],
    config: ModulesConfig,
) -> ServedModule:
    """A module version as its manifest's options ask, held to the server's limits."""
    known = {"tenant", "imports", "models", "fuel", "memory_mb", "wall_ms"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"module {name} {version}: unknown manifest option(s) {unknown}")
    imports = frozenset(_names(options, "imports") or ())
    if imports - abi.ALLOWABLE:
        raise ConfigError(
            f"module {name} {version}: imports {sorted(imports - abi.ALLOWABLE)} cannot be given "
            f"(only {', '.join(sorted(abi.ALLOWABLE))})"
        )
    undeclared = sorted({m for m, _ in compiled.imports} - abi.HOST_MODULES - imports)
    if undeclared:
        raise ConfigError(
            f"module {name} {version} imports {', '.join(undeclared)} without asking for it in "
            "its manifest (imports=...)"
        )

    def limit(key: str, server: int) -> int:
        asked = options.get(key)
        return server if asked is None else min(int(asked), server)

    limits = Limits(
        fuel=limit("fuel", config.fuel),
        memory_bytes=limit("memory_mb", config.memory_mb) * 1024 * 1024,
        wall_s=limit("wall_ms", config.wall_ms) / 1000,
    )
    tenant = options.get("tenant")
    return ServedModule(
        name, version, compiled, limits, str(tenant) if tenant else None, imports,
        _names(options, "models"),
    )  # fmt: skip


class RequestModules:
    """The modules one request runs through, in order (see the module)."""

    def __init__(
        self,
        table: ModuleTable,
        principal: Principal,
        modules: list[ServedModule],
        *,
        stream: bool,
    ) -> None:
        self.table = table
        self.principal = principal
        self.pre = [m for m in modules if m.has("preprocess")]
        self.filters = [m for m in modules if m.has("filter")]
        self.post = [] if stream else [m for m in modules if m.has("postprocess")]
        self.labels = [m.label for m in modules]

    def new_instance(self, module: ServedModule) -> Instance:
        return module.module.instantiate(allow=module.imports, limits=module.limits)

    async def _through(self, modules: list[ServedModule], role: str, text: str) -> str:
        for module in modules:

            def work(module: ServedModule = module, text: str = text) -> str:
                instance = self.new_instance(module)
                try:
                    out: str = getattr(instance, role)(text)
                    return out
                finally:
                    instance.close()

            text = await self.table.call(module, role, work)
            self.table.ok(module, role)
        return text

    async def preprocess(self, prompt: Prompt, model: ServedModel) -> Prompt:
        """``prompt`` with each of the request's user turns through the pre-processors (the
        session keeps them so), counted again; one that no longer fits is refused."""
        from seedance.server.lifecycle.request import check_fits

        if not self.pre:
            return prompt
        engine = model.engine
        new = {id(t.message) for t in prompt.new_turns} if prompt.new_turns else None
        changed: dict[int, ChatMessage] = {}
        delta = 0
        for message in prompt.messages:
            if message.role != "user" or (new is not None and id(message) not in new):
                continue
            text = await self._through(self.pre, "preprocess", message.content)
            if text != message.content:
                after = structs.replace(message, content=text)
                delta += engine.count_message_tokens(after) - engine.count_message_tokens(message)
                changed[id(message)] = after
        if not changed:
            return prompt
        messages = tuple(changed.get(id(m), m) for m in prompt.messages)
        turns = [
            Turn(changed[id(t.message)], engine.count_message_tokens(changed[id(t.message)]),
                 t.model) if id(t.message) in changed else t
            for t in prompt.new_turns
        ]  # fmt: skip
        tokens = prompt.tokens + delta
        check_fits(model, tokens)
        return replace(prompt, messages=messages, tokens=tokens, new_turns=turns)

    async def postprocess(self, text: str) -> str:
        return await self._through(self.post, "postprocess", text)

    async def filter(
        self, stream: AsyncGenerator[TokenDelta, None]
    ) -> AsyncGenerator[TokenDelta, None]:
        """The engine's deltas through the stream filters, in order: text a filter holds back
        waits (its tokens counted with the text that carries it out), and a filter that says
        stop ends the reply there (``stop``; the engine is closed).

        Every token frame carries at least one token, so what a filter flushes at the reply's
        end (``seedance_filter_end``) needs one: while such a filter runs, the last token seen
        is kept back to carry it (the reply shows one token later than it was made).

        The engine is read ahead while a filter call runs (:class:`_Ahead`): the next call
        takes every delta that came meanwhile, so under load a call covers many tokens."""
        table = self.table
        chain = _Filters(self)
        held = _Held()
        reserve = int(any(m.module.has_filter_end for m in self.filters))
        ready = ""  # filtered text waiting for a token to carry it
        ahead = _Ahead(stream)
        try:
            while (delta := await ahead.take()) is not None:
                held.add(delta)
                stop = False
                if delta.text or delta.finish_reason is not None:
                    last = delta.finish_reason is not None
                    text, stop = await table.run(functools.partial(chain.step, delta.text, last))
                    ready += text
                finish = "stop" if stop else delta.finish_reason
                if finish is not None:
                    yield held.take(ready, finish)
                    return
                if ready and held.tokens > reserve:
                    yield held.take(ready, None, keep=reserve)
                    ready = ""
            text, _ = await table.run(functools.partial(chain.step, "", True))
            ready += text
            if ready or held.tokens:
                yield held.take(ready, "stop")
        finally:
            await ahead.aclose()
            chain.close()


class _Filters:
    """A reply's stream filters, each instantiated on first use. :meth:`step` runs in the
    module pool: one call there takes a piece of the reply through every filter in turn (and,
    at the reply's end, their flushes), so a reply costs a thread hop per piece, not one per
    filter and per step."""

    def __init__(self, owner: RequestModules) -> None:
        self.owner = owner
        self.instances: list[Instance] = []
        self.failed = False

    def step(self, text: str, last: bool) -> tuple[str, bool]:
        """``text`` through every filter (``last``: the reply ends: their flushes too); the
        text out and whether one said stop (the filters after it then flush)."""
        stop = False
        for index, module in enumerate(self.owner.filters):
            try:
                if index == len(self.instances):
                    self.instances.append(self.owner.new_instance(module))
                instance = self.instances[index]
                if text:
                    text, stopped = instance.filter(text)
                    stop = stop or stopped
                if last or stop:
                    text += instance.filter_end()
            except WasmError as exc:
                self.failed = True
                raise self.owner.table.failure(module, "filter", exc) from None
        return text, stop

    def close(self) -> None:
        for instance in self.instances:
            instance.close()
        if not self.failed:
            for module in self.owner.filters[: len(self.instances)]:
                self.owner.table.ok(module, "filter")


def _same(event: ModuleEvent) -> ModuleEvent:
    return event


class _Ahead:
    """Reads a stream of deltas ahead of its reader, at most ``limit`` of them waiting (then
    the engine waits: backpressure), so that a reader slower than the engine (a filter call in
    a thread) takes everything that came meanwhile as one delta."""

    def __init__(self, stream: AsyncGenerator[TokenDelta, None], limit: int = 256) -> None:
        self._stream = stream
        self._limit = limit
        self._waiting: list[TokenDelta] = []
        self._ready = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._ended = False
        self._error: BaseException | None = None
        self._task = asyncio.ensure_future(self._pump())

    async def _pump(self) -> None:
        try:
            async for delta in self._stream:
                self._waiting.append(delta)
                self._ready.set()
                if delta.finish_reason is not None:
                    return
                if len(self._waiting) >= self._limit:
                    self._room.clear()
                    await self._room.wait()
        except Exception as exc:  # the engine's failure: the reader raises it
            self._error = exc
        finally:
            self._ended = True
            self._ready.set()

    async def take(self) -> TokenDelta | None:
        """Every delta read since the last take, as one (None: the stream is over)."""
        while not self._waiting:
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._ready.clear()
            await self._ready.wait()
        batch, self._waiting = self._waiting, []
        self._room.set()
        if len(batch) == 1:
            return batch[0]
        logprobs = [e for d in batch for e in d.logprobs or ()]
        ids = [i for d in batch for i in d.ids or ()]
        asked = any(d.logprobs is not None for d in batch), any(d.ids is not None for d in batch)
        return TokenDelta(
            "".join(d.text for d in batch),
            sum(d.tokens for d in batch),
            batch[-1].finish_reason,
            logprobs if asked[0] else None,
            ids if asked[1] else None,
        )

    async def aclose(self) -> None:
        """Stop reading, and close the stream (which stops the engine)."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._stream.aclose()


class _Held:
    """The tokens whose text a filter holds back: counted, with their log probabilities and
    ids, into the delta that carries text out."""

    def __init__(self) -> None:
        self.tokens = 0
        self.logprobs: list[TokenLogprob] | None = None
        self.ids: list[int] | None = None

    def add(self, delta: TokenDelta) -> None:
        self.tokens += delta.tokens
        if delta.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *delta.logprobs]
        if delta.ids is not None:
            self.ids = [*(self.ids or []), *delta.ids]

    def take(self, text: str, finish: Any, keep: int = 0) -> TokenDelta:
        """A delta of ``text`` with the tokens held but the last ``keep``."""
        count = self.tokens - keep
        logprobs, ids = self.logprobs, self.ids
        out = TokenDelta(
            text,
            count,
            finish,
            None if logprobs is None else logprobs[:count],
            None if ids is None else ids[:count],
        )
        self.tokens = keep
        self.logprobs = None if logprobs is None else logprobs[count:] or None
        self.ids = None if ids is None else ids[count:] or None
        return out
