"""The sandbox: one wasmtime engine per server, tenant modules compiled once, run under limits.

Every limit is enforced here, each ending the call with its :class:`ModuleFailed` reason:

- **fuel** (``Limits.fuel``, default 50 M): the engine counts instructions
  (``Config.consume_fuel``); each call gets fresh fuel. An endless loop ends as ``fuel``.
- **wall clock** (``Limits.wall_s``, default 2 s): ``Config.epoch_interruption`` and one thread
  per engine that advances the epoch every 10 ms (:data:`TICK_S`); each call sets its deadline
  that many ticks ahead, so wasm code that runs past it traps (``timeout``). Time in a backend
  call counts: a backend call is not started past the deadline, and one that returns past it
  stops the module (as a host function does, below), so it cannot slip out before the epoch
  trap fires.
- **memory** (``Limits.memory_bytes``, default 64 MiB, for the instance's whole life): a call
  after which the module's memory is bigger than the limit fails with ``memory``, however it
  ended (a trap, running out of fuel, or a return). The
  store's limiter refuses a ``memory.grow`` (it returns -1) only past the limit plus
  :func:`memory_slack`, the hard bound. Why not refuse right at the limit: wasmtime-py 50 gives
  no hook when the limiter refuses (``Store.set_limits`` only sets numbers; the C API has no
  limiter callback), and what a module does after a refused grow says nothing reliable: a C
  module whose ``malloc`` returned NULL and then writes through it does not even trap (address
  0 is ordinary memory in wasm32), it returns garbage. Memory that exceeded the limit is an
  unambiguous sign. A module whose initial memory is over the limit is refused at
  instantiation.
- **output** (``Limits.output_bytes``, default 1 MiB per call): past it, ``output_too_large``.
- **log** lines: :data:`MAX_LOG_LINE` bytes each, :data:`MAX_LOG_LINES` per call; the rest is
  dropped and counted in one warning.
- **WASI-NN handles**: see :mod:`seedance.wasm.nn`.

A host function never raises into wasmtime: wasmtime-py hands a Python exception from a host
function back through one module-global slot (``_func.LAST_EXCEPTION``), which two threads
calling wasm at once could swap. A host function that must stop the module instead records
why on its :class:`Instance` and sets the store's fuel to 0, so the module traps at its next
fuel check; the recorded reason wins over the trap's own, and is also checked when the module
returns normally before reaching a check.

Host functions are defined once on a :class:`wasmtime.Linker` (no per-store setup: an
instance is created from a cached :class:`wasmtime.InstancePre` in tens of microseconds). They
find the instance they serve through a thread-local set around each call into wasm: wasm runs
on the calling thread and host functions are called on it.

Threads: an :class:`Instance` owns its store and runs one call at a time (a second concurrent
call is a ``RuntimeError``); different instances run in parallel (ctypes releases the GIL
while wasm runs). :class:`WasmHost` and :class:`CompiledModule` are safe to share; two threads
compiling the same new bytes at once may both compile it (the cache keeps one).
"""

from __future__ import annotations

import codecs
import ctypes
import hashlib
import importlib.metadata
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Final

import wasmtime
from wasmtime import _ffi as ffi  # the i32 fast path (_call_i32): wasmtime is pinned
from wasmtime._func import enter_wasm

from seedance.wasm import abi
from seedance.wasm.cache import LRU, DiskCache
from seedance.wasm.errors import ModuleFailed, ModuleRefused, Reason
from seedance.wasm.nn import Errno, NNBackend, NNError, NNSession, OutOfBounds

log = logging.getLogger("seedance.wasm")

TICK_S: Final = 0.01  # the epoch advances every 10 ms: the wall-clock bound's resolution
MAX_LOG_LINE: Final = 1024
MAX_LOG_LINES: Final = 100
PAGE: Final = 65536
#: The engine settings that change the compiled code (part of the disk cache's file names).
_ENGINE_SETTINGS: Final = "fuel+epoch"


@dataclass(frozen=True, slots=True)
class Limits:
    """What one call into a module may use (a filter's every delta is one call)."""

    fuel: int = 50_000_000  # ~wasm instructions: ~11 ms of a tight loop here (measured)
    wall_s: float = 2.0
    memory_bytes: int = 64 * 1024 * 1024  # the whole instance, not per call
    output_bytes: int = 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("fuel", "wall_s", "memory_bytes", "output_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive")


def memory_slack(limit: int) -> int:
    """How far past ``limit`` the store still lets memory grow, so that a module growing without
    end (an allocator asks for a page or a few at a time) is seen past the limit when its call
    ends. A single request bigger than this that would cross the limit is refused outright."""
    return max(limit // 16, PAGE)


@dataclass(slots=True)
class CacheStats:
    """How :meth:`WasmHost.compile` found its modules (read for metrics and tests)."""

    compiled: int = 0
    loaded_from_disk: int = 0
    hits: int = 0


class _EpochTicker:
    """Advances one engine's epoch every :data:`TICK_S` until stopped."""

    def __init__(self, engine: wasmtime.Engine) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(engine, self._stop), name="seedance-wasm-epoch", daemon=True
        )
        self._thread.start()

    @staticmethod
    def _run(engine: wasmtime.Engine, stop: threading.Event) -> None:
        while not stop.wait(TICK_S):
            engine.increment_epoch()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


def _call_i32(store: wasmtime.Store, func: wasmtime.Func, args: tuple[int, ...]) -> int:
    """``func(*args)`` for a function of i32s returning one i32 (every export of the ABI, its
    types checked when the module was compiled), without what ``Func.__call__`` does on every
    call to be general: it asks the store for the function's type and converts each value
    through it, which was 70% of a filter call (about 60 us, of which this keeps 20)."""
    params = (ffi.wasmtime_val_t * max(1, len(args)))()
    for index, value in enumerate(args):
        params[index] = ffi.wasmtime_val_t(kind=ffi.WASMTIME_I32)
        params[index].of.i32 = value
    results = (ffi.wasmtime_val_t * 1)()
    with enter_wasm(store) as trap:
        error = ffi.wasmtime_func_call(
            store._context(), ctypes.byref(func._func), params, len(args), results, 1, trap
        )
        if error:
            raise wasmtime.WasmtimeError._from_ptr(error)
    return int(results[0].of.i32)


def _engine_fingerprint() -> str:
    version = importlib.metadata.version("wasmtime")
    return hashlib.sha256(f"wasmtime {version} {_ENGINE_SETTINGS}".encode()).hexdigest()[:16]


class WasmHost:
    """One per server: the wasmtime engine, its epoch ticker thread, the compiled-module cache.

    Close it (or use it as a context manager) after the last instance: once closed the epoch
    stops, and only fuel bounds an instance still running.
    """

    def __init__(
        self, cache_dir: Path | None = None, limits: Limits = Limits(), *, max_modules: int = 64
    ) -> None:
        config = wasmtime.Config()
        config.consume_fuel = True
        config.epoch_interruption = True
        self.engine = wasmtime.Engine(config)
        self.limits = limits
        self.stats = CacheStats()
        self._lock = threading.Lock()
        self._modules: LRU[str, CompiledModule] = LRU(max_modules)
        self._disk = DiskCache(cache_dir, _engine_fingerprint()) if cache_dir else None
        self._linkers: dict[frozenset[str], wasmtime.Linker] = {}
        self._closed = False
        ticker = _EpochTicker(self.engine)
        self._stop_ticker = weakref.finalize(self, ticker.stop)

    def compile(self, wasm: bytes) -> CompiledModule:
        """The module, compiled once per content (SHA-256) and cached; ``bad_module`` when the
        bytes are not WebAssembly, ``bad_abi`` or ``forbidden_import`` when it cannot be a
        Seedance module whatever it is granted."""
        sha256 = hashlib.sha256(wasm).hexdigest()
        with self._lock:
            cached = self._modules.get(sha256)
            if cached is not None:
                self.stats.hits += 1
                return cached
        module = self._disk.load(self.engine, sha256) if self._disk else None
        from_disk = module is not None
        if module is None:
            module = self._compile(wasm)
        compiled = CompiledModule(self, sha256, module)
        with self._lock:
            if from_disk:
                self.stats.loaded_from_disk += 1
            else:
                self.stats.compiled += 1
            self._modules.put(sha256, compiled)
        if self._disk and not from_disk:
            self._disk.store(sha256, module)
        return compiled

    def _compile(self, wasm: bytes) -> wasmtime.Module:
        if wasm[:4] != b"\0asm":
            # wasmtime.Module would take text as WAT: a tenant uploads binaries only.
            raise ModuleFailed("bad_module", "not a WebAssembly binary (no \\0asm header)")
        try:
            return wasmtime.Module(self.engine, wasm)
        except wasmtime.WasmtimeError as e:
            raise ModuleFailed("bad_module", _first_line(str(e))) from None

    def linker(self, allow: frozenset[str]) -> wasmtime.Linker:
        """The linker giving the host functions, plus WASI when ``allow`` grants it."""
        with self._lock:
            linker = self._linkers.get(allow)
            if linker is None:
                linker = _make_linker(self.engine, allow)
                self._linkers[allow] = linker
            return linker

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop the epoch ticker thread."""
        self._closed = True
        self._stop_ticker()

    def __enter__(self) -> WasmHost:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "unknown error"


def _sig_of(type_: object) -> abi.Sig | None:
    if isinstance(type_, wasmtime.FuncType):
        return (tuple(str(t) for t in type_.params), tuple(str(t) for t in type_.results))
    return None


def _kind_of(type_: object) -> abi.Sig | str:
    sig = _sig_of(type_)
    if sig is not None:
        return sig
    if isinstance(type_, wasmtime.MemoryType):
        return "memory"
    if isinstance(type_, wasmtime.TableType):
        return "table"
    if isinstance(type_, wasmtime.GlobalType):
        return "global"
    return "other"


class CompiledModule:
    """A compiled tenant module: what it plays (``roles``), what it imports, and instances.

    ``roles`` is a subset of ``{"preprocess", "filter", "postprocess", "run"}``;
    ``imports`` lists ``(module, name)`` as the module declares them.
    """

    def __init__(self, host: WasmHost, sha256: str, module: wasmtime.Module) -> None:
        self.host = host
        self.sha256 = sha256
        self.module = module
        self._import_sigs = [(i.module, i.name or "", _sig_of(i.type)) for i in module.imports]
        self.imports: list[tuple[str, str]] = [(m, n) for m, n, _ in self._import_sigs]
        abi.check_imports(self._import_sigs)
        types = {e.name: e.type for e in module.exports}
        exports = abi.check_exports({name: _kind_of(t) for name, t in types.items()})
        memory_type = types[abi.MEMORY]
        assert isinstance(memory_type, wasmtime.MemoryType)
        if memory_type.is_64:
            raise ModuleFailed("bad_abi", "the module's memory must be 32-bit (i32 pointers)")
        self.roles = exports.roles
        self.has_filter_end = exports.has_filter_end
        self.memory_min_bytes = memory_type.limits.min * PAGE
        self._imported_modules = frozenset(m for m, _ in self.imports)
        self._pres: dict[frozenset[str], wasmtime.InstancePre] = {}
        self._lock = threading.Lock()

    def instantiate(
        self,
        backend: NNBackend | None = None,
        allow: frozenset[str] = frozenset(),
        limits: Limits | None = None,
    ) -> Instance:
        """A fresh instance (its own store and memory); ``backend`` serves its WASI-NN calls.

        ``allow`` grants import modules beyond the host's own (only ``wasi_snapshot_preview1``
        exists); an import from any other module is ``forbidden_import``, naming it.
        """
        abi.check_allow(allow)
        forbidden = abi.forbidden_imports(self._import_sigs, allow)
        if forbidden:
            shown = ", ".join(forbidden[:5]) + (", ..." if len(forbidden) > 5 else "")
            raise ModuleFailed(
                "forbidden_import",
                f"the module imports {shown}: the host gives only "
                f"{' and '.join(sorted(abi.HOST_MODULES))}"
                + (" (wasi_snapshot_preview1 only when granted)" if abi.WASI_P1 in shown else ""),
            )
        if self.host.closed:
            raise RuntimeError("the WasmHost is closed")
        granted = allow & self._imported_modules
        return Instance(self, self._pre(granted), backend, limits or self.host.limits, granted)

    def _pre(self, granted: frozenset[str]) -> wasmtime.InstancePre:
        with self._lock:
            pre = self._pres.get(granted)
        if pre is None:
            try:
                pre = self.host.linker(granted).instantiate_pre(self.module)
            except wasmtime.WasmtimeError as e:
                raise ModuleFailed("bad_abi", _first_line(str(e))) from None
            with self._lock:
                self._pres[granted] = pre
        return pre


# Host functions: defined once per linker, they reach their instance through _running.

_running = threading.local()


def _current() -> Instance | None:
    instance: Instance | None = getattr(_running, "instance", None)
    return instance


def _host_output(caller: wasmtime.Caller, ptr: int, length: int) -> None:
    instance = _current()
    if instance is not None:
        instance._guarded(instance._on_output, caller, ptr, length)


def _host_log(caller: wasmtime.Caller, ptr: int, length: int) -> None:
    instance = _current()
    if instance is not None:
        instance._guarded(instance._on_log, caller, ptr, length)


def _nn_entry(name: str) -> Callable[..., int]:
    def entry(caller: wasmtime.Caller, *args: int) -> int:
        instance = _current()
        if instance is None:
            return int(Errno.RUNTIME_ERROR)
        return instance._on_nn(caller, name, args)

    entry.__name__ = f"wasi_ephemeral_nn.{name}"
    return entry


def _make_linker(engine: wasmtime.Engine, allow: frozenset[str]) -> wasmtime.Linker:
    linker = wasmtime.Linker(engine)
    i32 = wasmtime.ValType.i32()
    for (module, name), (params, results) in abi.HOST_FUNCTIONS.items():
        func_type = wasmtime.FuncType([i32] * len(params), [i32] * len(results))
        if module == abi.SEEDANCE:
            func: Callable[..., Any] = _host_output if name == "output" else _host_log
        else:
            func = _nn_entry(name)
        linker.define_func(module, name, func_type, func, access_caller=True)
    if abi.WASI_P1 in allow:
        linker.define_wasi()
    return linker


class _Memory:
    """A module's memory seen from a host function (:class:`seedance.wasm.nn.GuestMemory`).

    Its address and size are read again for every host call: ``memory.grow`` may move it.
    """

    __slots__ = ("_memory", "_store")

    def __init__(self, memory: wasmtime.Memory, store: wasmtime.Store | wasmtime.Caller) -> None:
        self._memory = memory
        self._store = store

    def size(self) -> int:
        return self._memory.data_len(self._store)

    def _address(self, ptr: int, length: int) -> int:
        if ptr < 0 or length < 0 or ptr + length > self.size():
            raise OutOfBounds
        return ctypes.addressof(self._memory.data_ptr(self._store).contents) + ptr

    def read(self, ptr: int, length: int) -> bytes:
        address = self._address(ptr, length)
        return ctypes.string_at(address, length) if length else b""

    def write(self, ptr: int, data: bytes) -> None:
        address = self._address(ptr, len(data))
        if data:
            ctypes.memmove(address, data, len(data))


_SHORT_TRAPS: Final = {
    wasmtime.TrapCode.OUT_OF_FUEL: "fuel",
    wasmtime.TrapCode.INTERRUPT: "timeout",
}


def _trap_message(error: Exception) -> str:
    """The cause a trap names ("wasm trap: integer divide by zero"), and where, without the
    backtrace wasmtime puts first."""
    if isinstance(error, wasmtime.ExitTrap):
        return f"the module called proc_exit({error.code})"
    text = str(error)
    if "Caused by:" in text:  # "0: memory fault at ...", "1: wasm trap: out of bounds ..."
        causes = text.split("Caused by:", 1)[1].strip().splitlines()
        message = ": ".join(re.sub(r"^\s*\d+: ", "", line).strip() for line in causes if line)
    else:
        message = _first_line(text)
    if isinstance(error, wasmtime.Trap):
        frames = error.frames
        if frames and frames[0].func_name:
            message += f" (in {frames[0].func_name})"
    return message


class Instance:
    """A module instance: its own store, memory, fuel and WASI-NN handles.

    A filter instance lives for a whole reply (:meth:`filter` per delta, then
    :meth:`filter_end`); :meth:`preprocess`, :meth:`postprocess` and :meth:`run` are one call
    each, after which the instance is closed (a fresh one per call: nothing of one request's
    input stays for the next). After a :class:`ModuleFailed` the instance is dead: every later
    call raises the same failure. Synchronous: call it from a worker thread.
    """

    def __init__(
        self,
        compiled: CompiledModule,
        pre: wasmtime.InstancePre,
        backend: NNBackend | None,
        limits: Limits,
        granted: frozenset[str],
    ) -> None:
        self.compiled = compiled
        self.limits = limits
        self._busy = threading.Lock()
        self._dead: ModuleFailed | None = None
        self._closed = False
        self._abort: tuple[Reason, str] | None = None
        self._deadline = 0.0
        self._out: list[bytes] = []
        self._out_size = 0
        self._log_lines = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._nn = NNSession(backend, self._before_backend)
        self._memory: wasmtime.Memory | None = None  # until instantiated: see _guest
        if compiled.memory_min_bytes > limits.memory_bytes:
            raise ModuleFailed(
                "memory",
                f"the module starts with {compiled.memory_min_bytes} bytes of memory, over the "
                f"limit of {limits.memory_bytes}",
            )
        store = wasmtime.Store(compiled.host.engine)
        store.set_limits(
            memory_size=limits.memory_bytes + memory_slack(limits.memory_bytes),
            table_elements=65536,
            instances=1,
            tables=4,
            memories=1,
        )
        if abi.WASI_P1 in granted:
            # Nothing preopened, no environment, no arguments; stdout and stderr discarded.
            store.set_wasi(wasmtime.WasiConfig())
        self._store: wasmtime.Store | None = store
        self._start_call()
        try:
            with self._entered():
                instance = pre.instantiate(store)
        except Exception as e:
            failure = self._failure(e)
            self._release()
            raise failure from None
        exports = instance.exports(store)
        memory, alloc = exports[abi.MEMORY], exports[abi.ALLOC]
        assert isinstance(memory, wasmtime.Memory) and isinstance(alloc, wasmtime.Func)
        self._memory = memory
        self._alloc = alloc
        self._funcs: dict[str, wasmtime.Func] = {}
        for name in (*abi.ROLES.values(), abi.FILTER_END):
            func = exports.get(name)
            if isinstance(func, wasmtime.Func):
                self._funcs[name] = func

    # The roles.

    def preprocess(self, text: str) -> str:
        """The prompt as the module rewrites it."""
        return self._once(abi.ROLES["preprocess"], text.encode()).decode()

    def postprocess(self, text: str) -> str:
        """The whole reply as the module rewrites it."""
        return self._once(abi.ROLES["postprocess"], text.encode()).decode()

    def run(self, data: bytes) -> bytes:
        """A pipeline: bytes in, bytes out, served models reached through WASI-NN."""
        return self._once(abi.ROLES["run"], data, text=False)

    def filter(self, delta: str) -> tuple[str, bool]:
        """One delta of the reply in; the text to send now, and whether to stop the reply."""
        with self._calling():
            code, out = self._invoke(abi.ROLES["filter"], delta.encode())
            stop = code == 1
            if code not in (0, 1):
                raise ModuleRefused(code, out.decode(errors="replace"))
            return self._decode(out, final=stop), stop

    def filter_end(self) -> str:
        """The reply ended: what the filter still held back. Closes the instance."""
        with self._calling(last=True):
            out = b""
            if abi.FILTER_END in self._funcs:
                code, out = self._invoke(abi.FILTER_END, None)
                if code not in (0, 1):
                    raise ModuleRefused(code, out.decode(errors="replace"))
            return self._decode(out, final=True)

    def close(self) -> None:
        """Release the store (its memory) and every WASI-NN handle (open streams are closed).

        Called from another thread while a call runs, it takes effect when that call ends
        (within ``Limits.wall_s``): a store may not be touched from two threads at once, so
        nothing can stop the running call from outside but its own bounds.
        """
        self._closed = True
        if self._busy.acquire(blocking=False):
            try:
                self._release()
            finally:
                self._busy.release()

    def _release(self) -> None:
        self._nn.close()
        self._store = None
        self._memory = None

    def __enter__(self) -> Instance:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # Calling into the module.

    def _once(self, export: str, data: bytes, *, text: bool = True) -> bytes:
        with self._calling(last=True):
            code, out = self._invoke(export, data)
            if code != 0:
                raise ModuleRefused(code, out.decode(errors="replace"))
            if text:
                self._decode(out, final=True)  # bad_output here, not in the caller's decode
            return out

    @contextmanager
    def _calling(self, *, last: bool = False) -> Iterator[None]:
        """One call at a time, never into a dead or closed instance; after a failure, or the
        ``last`` call, or a :meth:`close` from another thread meanwhile, everything is released."""
        if self._dead is not None:
            raise ModuleFailed(
                self._dead.reason, f"the instance failed earlier: {self._dead.message}"
            )
        if self._closed:
            raise RuntimeError("the instance is closed (pre/post/run: one instance per call)")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("an Instance runs one call at a time")
        try:
            yield
        except ModuleFailed as failure:
            self._dead = failure
            raise
        finally:
            if last or self._dead is not None:
                self._closed = True
            if self._closed:
                self._release()
            self._busy.release()

    def _invoke(self, export: str, data: bytes | None) -> tuple[int, bytes]:
        """Input written where ``seedance_alloc`` says, the export called; (code, output)."""
        func = self._funcs.get(export)
        if func is None:
            raise ModuleFailed("bad_abi", f"the module does not export {export}")
        store, memory = self._store, self._memory
        assert store is not None and memory is not None
        self._start_call()
        try:
            args: tuple[int, ...] = ()
            if data is not None:
                ptr = 0
                if data:
                    ptr = self._call(self._alloc, len(data)) & 0xFFFFFFFF
                    if ptr == 0:
                        raise ModuleFailed("bad_abi", f"seedance_alloc({len(data)}) returned 0")
                    try:
                        _Memory(memory, store).write(ptr, data)
                    except OutOfBounds:
                        raise ModuleFailed(
                            "bad_abi", f"seedance_alloc returned {ptr:#x}, outside its memory"
                        ) from None
                args = (ptr, len(data))
            code = self._call(func, *args)
            return code, b"".join(self._out)
        finally:
            self._end_call()

    def _start_call(self) -> None:
        store = self._store
        assert store is not None
        store.set_fuel(self.limits.fuel)
        store.set_epoch_deadline(max(1, math.ceil(self.limits.wall_s / TICK_S)))
        self._deadline = time.monotonic() + self.limits.wall_s
        self._out.clear()
        self._out_size = 0
        self._log_lines = 0

    def _end_call(self) -> None:
        if self._log_lines > MAX_LOG_LINES:
            log.warning(
                "wasm %s: %d log lines dropped (at most %d per call)",
                self.compiled.sha256[:12],
                self._log_lines - MAX_LOG_LINES,
                MAX_LOG_LINES,
            )

    @contextmanager
    def _entered(self) -> Iterator[None]:
        previous = _current()
        _running.instance = self
        try:
            yield
        finally:
            _running.instance = previous

    def _call(self, func: wasmtime.Func, *args: int) -> int:
        store = self._store
        assert store is not None
        try:
            with self._entered():
                result = _call_i32(store, func, args)
        except Exception as e:
            raise self._failure(e) from None
        if self._abort is not None:  # stopped by a host function, returned before a fuel check
            raise ModuleFailed(*self._abort)
        over = self._over_memory()
        if over:
            raise ModuleFailed("memory", over)
        if not isinstance(result, int):
            raise ModuleFailed("bad_abi", f"an export returned {result!r}, not an i32")
        return result

    def _failure(self, error: Exception) -> ModuleFailed:
        """The reason a call into wasm failed with ``error``."""
        if self._abort is not None:
            return ModuleFailed(*self._abort)
        if not isinstance(error, wasmtime.WasmtimeError | wasmtime.Trap):
            log.error("wasm %s: host error", self.compiled.sha256[:12], exc_info=error)
            return ModuleFailed("trap", f"host error: {type(error).__name__}")
        over = self._over_memory()
        if over:  # the cause; what followed (a trap, running out of fuel) is its symptom
            return ModuleFailed("memory", f"{over}, then: {_trap_message(error)}")
        code = error.trap_code if isinstance(error, wasmtime.Trap) else None
        if code is wasmtime.TrapCode.OUT_OF_FUEL:
            return ModuleFailed("fuel", f"ran out of fuel ({self.limits.fuel} per call)")
        if code is wasmtime.TrapCode.INTERRUPT:
            return ModuleFailed(
                "timeout", f"ran past the wall-clock bound of {self.limits.wall_s} s"
            )
        return ModuleFailed("trap", _trap_message(error))

    def _over_memory(self) -> str:
        """Why the module's memory is over the limit, or "" when it is not."""
        if self._memory is None or self._store is None:
            return ""
        size = self._memory.data_len(self._store)
        if size <= self.limits.memory_bytes:
            return ""
        return f"memory grew to {size} bytes, past the limit of {self.limits.memory_bytes}"

    def _stop(self, reason: Reason, message: str) -> None:
        """From a host function: end the call with ``reason``. Fuel 0 makes the module trap at
        its next check; the recorded reason is what the caller sees."""
        if self._abort is None:
            self._abort = (reason, message)
        if self._store is not None:
            self._store.set_fuel(0)

    def _decode(self, out: bytes, *, final: bool) -> str:
        try:
            return self._decoder.decode(out, final)
        except UnicodeDecodeError as e:
            raise ModuleFailed("bad_output", f"the output is not UTF-8: {e.reason}") from None

    # Host functions' side (never raise: see the module docstring).

    def _guarded(
        self,
        handler: Callable[[wasmtime.Caller, int, int], None],
        caller: wasmtime.Caller,
        ptr: int,
        length: int,
    ) -> None:
        """A bug of ours in a host function stops the module instead of raising into wasmtime."""
        try:
            handler(caller, ptr, length)
        except Exception:
            log.exception("wasm %s: host function failed", self.compiled.sha256[:12])
            self._stop("trap", "host error")

    def _on_output(self, caller: wasmtime.Caller, ptr: int, length: int) -> None:
        if self._abort is not None:
            return
        ptr, length = ptr & 0xFFFFFFFF, length & 0xFFFFFFFF
        if self._out_size + length > self.limits.output_bytes:
            self._stop(
                "output_too_large",
                f"more than {self.limits.output_bytes} bytes of output in one call",
            )
            return
        try:
            data = self._guest(caller).read(ptr, length)
        except OutOfBounds:
            self._stop("trap", f"seedance.output({ptr:#x}, {length}): outside the memory")
            return
        self._out.append(data)
        self._out_size += length

    def _on_log(self, caller: wasmtime.Caller, ptr: int, length: int) -> None:
        if self._abort is not None:
            return
        self._log_lines += 1
        if self._log_lines > MAX_LOG_LINES:
            return
        ptr, length = ptr & 0xFFFFFFFF, length & 0xFFFFFFFF
        try:
            data = self._guest(caller).read(ptr, min(length, MAX_LOG_LINE))
        except OutOfBounds:
            self._stop("trap", f"seedance.log({ptr:#x}, {length}): outside the memory")
            return
        line = data.decode(errors="replace").rstrip("\n")
        log.info("wasm %s: %s", self.compiled.sha256[:12], line)

    def _on_nn(self, caller: wasmtime.Caller, name: str, args: tuple[int, ...]) -> int:
        if self._abort is not None:
            return int(Errno.RUNTIME_ERROR)
        method: Callable[..., int] = getattr(self._nn, name)
        try:
            errno = int(method(self._guest(caller), *args))
        except Exception:  # NNSession maps its own errors; this is a bug of ours
            log.exception("wasm %s: wasi_ephemeral_nn.%s", self.compiled.sha256[:12], name)
            errno = Errno.RUNTIME_ERROR
        if time.monotonic() >= self._deadline:
            # A backend call that ran past the deadline: the module stops now, even if it would
            # return before reaching an epoch check.
            self._stop("timeout", f"ran past the wall-clock bound of {self.limits.wall_s} s")
        return int(errno)

    def _guest(self, caller: wasmtime.Caller) -> _Memory:
        """The calling module's memory: the export found once, the caller's store each time."""
        memory = self._memory
        if memory is None:  # a start function, before the instance's exports were read
            found = caller.get(abi.MEMORY)
            if not isinstance(found, wasmtime.Memory):
                raise OutOfBounds
            memory = found
        return _Memory(memory, caller)

    def _before_backend(self) -> None:
        if time.monotonic() >= self._deadline:
            self._stop("timeout", f"ran past the wall-clock bound of {self.limits.wall_s} s")
            raise NNError(Errno.RUNTIME_ERROR, "the module's time is up")
