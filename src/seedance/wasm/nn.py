"""WASI-NN for tenant modules: the ``wasi_ephemeral_nn`` functions over a backend of served models.

The ABI is the WASI-NN "ephemeral" witx one, with WasmEdge's names and numbers for what lies
beyond it (``load_by_name``, ``load_by_name_with_config``, token streaming with
``compute_single`` / ``get_output_single`` / ``fini_single``, errno 100-103), so a module
written for WasmEdge's wasi-nn plugin (LlamaEdge's, say) links here too.

:class:`NNSession` is one instance's view: its graph and context handles, which no other
instance can name. It reads and writes the module's memory only through :class:`GuestMemory`,
checking every pointer and length against the memory's size, and turns every failure into an
errno: a module gets ``invalid_argument`` for a bad pointer, never a Python exception, and a
backend's :class:`NNError` becomes its errno (any other exception: ``runtime_error``, logged).
It is plain Python over bytes: the tests drive it with a bytearray for a memory.

Choices where WASI-NN leaves room:

- ``load`` (model bytes from the module) is not offered: ``unsupported_operation``.
- Without a backend every load is ``unsupported_operation``.
- A model the module may not use is ``model_not_found`` (103), exactly like one that does not
  exist: a module cannot probe which models the server has. (The backend decides; the server's
  backend raises ``NNError(Errno.MODEL_NOT_FOUND)`` for both.)
- At most :data:`MAX_HANDLES` graphs and as many contexts at once per instance: ``busy``.
- ``set_input`` and ``compute`` on a context whose token stream is open: ``busy`` (end it with
  ``fini_single``, or read it to ``end_of_sequence``).
- After ``end_of_sequence`` the stream is closed; the next ``compute_single`` starts a new one.
- ``get_output_single`` ignores its index (one stream per context), as WasmEdge does.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, ParamSpec, Protocol

import numpy as np
import numpy.typing as npt

log = logging.getLogger("seedance.wasm")

MAX_HANDLES: Final = 16  # graphs, and contexts, one instance may hold at once
MAX_TENSORS: Final = 16  # input indexes 0..15
MAX_DIMS: Final = 8
MAX_NAME: Final = 256  # bytes of a model name
MAX_CONFIG: Final = 64 * 1024  # bytes of a load_by_name_with_config JSON
TENSOR_STRUCT: Final = struct.Struct("<IIB3xII")  # dims_ptr, dims_len, type, data_ptr, data_len
_U32: Final = struct.Struct("<I")


class Errno(enum.IntEnum):
    """What every ``wasi_ephemeral_nn`` function returns."""

    SUCCESS = 0
    INVALID_ARGUMENT = 1
    INVALID_ENCODING = 2
    MISSING_MEMORY = 3
    BUSY = 4
    RUNTIME_ERROR = 5
    UNSUPPORTED_OPERATION = 6
    TOO_LARGE = 7
    NOT_FOUND = 8
    END_OF_SEQUENCE = 100  # WasmEdge: compute_single after the last token
    CONTEXT_FULL = 101
    PROMPT_TOO_LONG = 102
    MODEL_NOT_FOUND = 103


class TensorType(enum.IntEnum):
    """The tensor struct's ``type`` byte; the arrays a backend sees have the matching dtype."""

    F16 = 0
    F32 = 1
    F64 = 2
    U8 = 3
    I32 = 4
    I64 = 5


DTYPES: Final[dict[TensorType, np.dtype[Any]]] = {
    TensorType.F16: np.dtype("<f2"),
    TensorType.F32: np.dtype("<f4"),
    TensorType.F64: np.dtype("<f8"),
    TensorType.U8: np.dtype("u1"),
    TensorType.I32: np.dtype("<i4"),
    TensorType.I64: np.dtype("<i8"),
}


class NNError(Exception):
    """A backend's refusal, with the errno the module sees."""

    def __init__(self, errno: Errno, message: str = "") -> None:
        super().__init__(f"{errno.name.lower()}: {message}" if message else errno.name.lower())
        self.errno = errno
        self.message = message


class TokenStream(Protocol):
    """Token texts of one generation; ``close()`` cancels it (a generator is one)."""

    def __next__(self) -> bytes: ...

    def close(self) -> None: ...


class NNGraph(Protocol):
    """A loaded model. Calls block the thread running the module; time spent counts against
    the module's wall-clock bound."""

    def compute(self, inputs: dict[int, npt.NDArray[Any]]) -> dict[int, npt.NDArray[Any]]:
        """Outputs by index; text is a u8 array."""
        ...

    def stream(self, inputs: dict[int, npt.NDArray[Any]]) -> TokenStream:
        """The reply token by token (each item one token's text)."""
        ...


class NNBackend(Protocol):
    """The served models a module may reach, by name (implemented by the server over its
    engines; one per tenant, so it decides what that tenant may use)."""

    def load(self, name: str, config: dict[str, Any] | None) -> NNGraph:
        """The model ``name``; ``NNError(Errno.MODEL_NOT_FOUND)`` when it does not exist or this
        tenant may not use it."""
        ...


class OutOfBounds(Exception):
    """A pointer and length that leave the module's memory: ``invalid_argument``."""


class GuestMemory(Protocol):
    """A module's linear memory, bounds-checked: ``read`` and ``write`` raise
    :class:`OutOfBounds`."""

    def size(self) -> int: ...

    def read(self, ptr: int, length: int) -> bytes: ...

    def write(self, ptr: int, data: bytes) -> None: ...


def u32(value: int) -> int:
    """A wasm i32 argument (Python sees it signed) as the u32 the ABI means."""
    return value & 0xFFFFFFFF


def parse_tensor(raw: bytes) -> tuple[int, int, int, int, int]:
    """The 20-byte tensor struct: (dims_ptr, dims_len, type, data_ptr, data_len)."""
    dims_ptr, dims_len, type_, data_ptr, data_len = TENSOR_STRUCT.unpack(raw)
    return dims_ptr, dims_len, type_, data_ptr, data_len


def read_tensor(mem: GuestMemory, tensor_ptr: int) -> npt.NDArray[Any]:
    """The tensor at ``tensor_ptr`` as an array; ``NNError(INVALID_ARGUMENT)`` unless its type
    is known and its data is exactly the product of its dims times the type's size."""
    dims_ptr, dims_len, type_, data_ptr, data_len = parse_tensor(
        mem.read(tensor_ptr, TENSOR_STRUCT.size)
    )
    if dims_len > MAX_DIMS:
        raise NNError(Errno.INVALID_ARGUMENT, f"a tensor has at most {MAX_DIMS} dims")
    if type_ not in DTYPES:
        raise NNError(Errno.INVALID_ARGUMENT, f"unknown tensor type {type_}")
    dtype = DTYPES[TensorType(type_)]
    dims = struct.unpack(f"<{dims_len}I", mem.read(dims_ptr, 4 * dims_len))
    if data_len != int(np.prod(dims, dtype=object)) * dtype.itemsize:
        raise NNError(Errno.INVALID_ARGUMENT, "data_len is not the product of dims times size")
    data = mem.read(data_ptr, data_len)
    return np.frombuffer(data, dtype=dtype).reshape(dims)


_P = ParamSpec("_P")


def _errno(method: Callable[_P, int]) -> Callable[_P, int]:
    """Every exit is an errno: bad pointers, backend refusals, and bugs behind the backend."""

    @functools.wraps(method)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> int:
        try:
            return method(*args, **kwargs)
        except OutOfBounds:
            return Errno.INVALID_ARGUMENT
        except NNError as e:
            return e.errno
        except Exception:
            log.warning("wasi-nn %s failed", method.__name__, exc_info=True)
            return Errno.RUNTIME_ERROR

    return wrapper


@dataclass(slots=True)
class _Context:
    graph: NNGraph
    inputs: dict[int, npt.NDArray[Any]] = field(default_factory=dict)
    outputs: dict[int, bytes] | None = None
    stream: TokenStream | None = None
    token: bytes | None = None

    def end_stream(self) -> None:
        stream, self.stream, self.token = self.stream, None, None
        if stream is not None:
            stream.close()


class NNSession:
    """One instance's WASI-NN handles and calls (see the module docstring for the rules).

    ``before_backend`` runs before every backend call: the host's wall-clock check, which
    raises :class:`NNError` once the module's time is up.
    """

    def __init__(
        self, backend: NNBackend | None, before_backend: Callable[[], None] = lambda: None
    ) -> None:
        self._backend = backend
        self._before_backend = before_backend
        self._graphs: dict[int, NNGraph] = {}
        self._contexts: dict[int, _Context] = {}
        self._next_handle = 0

    def close(self) -> None:
        """Release every handle; an open token stream is closed, which cancels its generation."""
        contexts, self._contexts, self._graphs = self._contexts, {}, {}
        for context in contexts.values():
            try:
                context.end_stream()
            except Exception:
                log.warning("closing a wasi-nn token stream failed", exc_info=True)

    def _handle(self) -> int:
        self._next_handle = (self._next_handle + 1) & 0xFFFFFFFF
        return self._next_handle

    def _context(self, ctx: int) -> _Context:
        context = self._contexts.get(u32(ctx))
        if context is None:
            raise NNError(Errno.INVALID_ARGUMENT, "no such execution context")
        return context

    @staticmethod
    def _check_out(mem: GuestMemory, ptr: int, length: int) -> None:
        """Fail before the backend is asked, or before anything is written, when a result
        could not be written back whole."""
        if ptr + length > mem.size():
            raise OutOfBounds

    def _load(self, mem: GuestMemory, name: bytes, config: dict[str, Any] | None, out: int) -> int:
        self._check_out(mem, out, 4)
        if self._backend is None:
            raise NNError(Errno.UNSUPPORTED_OPERATION, "no models are offered to this module")
        if len(self._graphs) >= MAX_HANDLES:
            raise NNError(Errno.BUSY, f"at most {MAX_HANDLES} graphs at once")
        try:
            model = name.decode()
        except UnicodeDecodeError:
            raise NNError(Errno.INVALID_ARGUMENT, "a model name is UTF-8") from None
        self._before_backend()
        graph = self._backend.load(model, config)
        handle = self._handle()
        self._graphs[handle] = graph
        mem.write(out, _U32.pack(handle))
        return Errno.SUCCESS

    # The wasi_ephemeral_nn functions: arguments as wasm gives them (i32, maybe negative).

    @_errno
    def load(
        self,
        mem: GuestMemory,
        builder: int,
        builder_len: int,
        encoding: int,
        target: int,
        graph_out: int,
    ) -> int:
        return Errno.UNSUPPORTED_OPERATION

    @_errno
    def load_by_name(self, mem: GuestMemory, name: int, name_len: int, graph_out: int) -> int:
        if u32(name_len) > MAX_NAME:
            return Errno.INVALID_ARGUMENT
        return self._load(mem, mem.read(u32(name), u32(name_len)), None, u32(graph_out))

    @_errno
    def load_by_name_with_config(
        self,
        mem: GuestMemory,
        name: int,
        name_len: int,
        config: int,
        config_len: int,
        graph_out: int,
    ) -> int:
        if u32(name_len) > MAX_NAME or u32(config_len) > MAX_CONFIG:
            return Errno.INVALID_ARGUMENT
        raw_name = mem.read(u32(name), u32(name_len))
        try:
            parsed = json.loads(mem.read(u32(config), u32(config_len)) or b"{}")
        except ValueError:
            return Errno.INVALID_ARGUMENT
        if not isinstance(parsed, dict):
            return Errno.INVALID_ARGUMENT
        return self._load(mem, raw_name, parsed, u32(graph_out))

    @_errno
    def init_execution_context(self, mem: GuestMemory, graph: int, ctx_out: int) -> int:
        self._check_out(mem, u32(ctx_out), 4)
        found = self._graphs.get(u32(graph))
        if found is None:
            return Errno.INVALID_ARGUMENT
        if len(self._contexts) >= MAX_HANDLES:
            return Errno.BUSY
        handle = self._handle()
        self._contexts[handle] = _Context(found)
        mem.write(u32(ctx_out), _U32.pack(handle))
        return Errno.SUCCESS

    @_errno
    def set_input(self, mem: GuestMemory, ctx: int, index: int, tensor: int) -> int:
        context = self._context(ctx)
        if u32(index) >= MAX_TENSORS:
            return Errno.INVALID_ARGUMENT
        if context.stream is not None:
            return Errno.BUSY
        context.inputs[u32(index)] = read_tensor(mem, u32(tensor))
        return Errno.SUCCESS

    @_errno
    def compute(self, mem: GuestMemory, ctx: int) -> int:
        context = self._context(ctx)
        if context.stream is not None:
            return Errno.BUSY
        self._before_backend()
        outputs = context.graph.compute(dict(context.inputs))
        context.outputs = {int(i): np.ascontiguousarray(a).tobytes() for i, a in outputs.items()}
        return Errno.SUCCESS

    def _give(self, mem: GuestMemory, data: bytes, out: int, out_max: int, written: int) -> int:
        out, out_max, written = u32(out), u32(out_max), u32(written)
        self._check_out(mem, written, 4)
        self._check_out(mem, out, out_max)
        if len(data) > out_max:
            mem.write(written, _U32.pack(len(data)))
            return Errno.TOO_LARGE
        mem.write(out, data)
        mem.write(written, _U32.pack(len(data)))
        return Errno.SUCCESS

    @_errno
    def get_output(
        self, mem: GuestMemory, ctx: int, index: int, out: int, out_max: int, written: int
    ) -> int:
        context = self._context(ctx)
        data = None if context.outputs is None else context.outputs.get(u32(index))
        if data is None:
            return Errno.INVALID_ARGUMENT
        return self._give(mem, data, out, out_max, written)

    @_errno
    def compute_single(self, mem: GuestMemory, ctx: int) -> int:
        context = self._context(ctx)
        self._before_backend()
        try:
            if context.stream is None:
                context.stream = context.graph.stream(dict(context.inputs))
            context.token = next(context.stream)
        except StopIteration:
            context.end_stream()
            return Errno.END_OF_SEQUENCE
        except BaseException:
            context.end_stream()
            raise
        return Errno.SUCCESS

    @_errno
    def get_output_single(
        self, mem: GuestMemory, ctx: int, index: int, out: int, out_max: int, written: int
    ) -> int:
        context = self._context(ctx)
        if context.token is None:
            return Errno.INVALID_ARGUMENT
        return self._give(mem, context.token, out, out_max, written)

    @_errno
    def fini_single(self, mem: GuestMemory, ctx: int) -> int:
        self._context(ctx).end_stream()
        return Errno.SUCCESS

    @_errno
    def unload(self, mem: GuestMemory, graph: int) -> int:
        if self._graphs.pop(u32(graph), None) is None:
            return Errno.INVALID_ARGUMENT
        return Errno.SUCCESS

    @_errno
    def finalize_execution_context(self, mem: GuestMemory, ctx: int) -> int:
        context = self._contexts.pop(u32(ctx), None)
        if context is None:
            return Errno.INVALID_ARGUMENT
        context.end_stream()
        return Errno.SUCCESS
