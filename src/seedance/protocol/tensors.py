"""Tensors on the wire: the datatypes Seedance takes and gives (the Open Inference Protocol's
names, Triton's type codes), and the binary tensor frame of ``/v2/infer``.

Pure: arrays in, bytes out, and back; tested without an event loop.

A tensor frame is a WebSocket binary frame (docs/protocol.md, "Tensor frames"), all of its
header little-endian:

======  =====  ==============================================================================
offset  bytes  field
======  =====  ==============================================================================
0       1      ``10``: a tensor frame
1       1      the datatype's code (Triton's ``TYPE_*`` numbers: FP32 is 11, INT32 8 ...)
2       1      ndim, 0 to 8
3       1      N: the byte length of the tensor's name, 1 to 255
4       2      L: the byte length of the request id (0: none)
6       2      H: where the data begins, a multiple of 8
8       8      ``seq`` (signed; -1: the tensor has none)
16      8 ndim the shape, one unsigned 8-byte size per dimension
16+8n   L      the request id, UTF-8
        N      the name, UTF-8
        ..H    zero bytes up to H
H              the data: every element, row-major, little-endian
======  =====  ==============================================================================

The fixed part and the shape come first so that a reader finds every length at a fixed place;
the data starts on an 8-byte boundary so that a ``Float64Array``, a ``BigInt64Array`` or a
NumPy view lies on it with no copy (a typed array must start at a multiple of its element
size). Little-endian everywhere because every CPU that runs a browser or NumPy today is, so no
client swaps a byte.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

import numpy as np

from seedance.protocol.errors import InvalidRequest

#: The first byte of a tensor frame.
TENSOR: Final = 0x10
#: Dimensions a tensor may have, at most.
MAX_NDIM: Final = 8

_FIXED = struct.Struct("<BBBBHHq")  # type, dtype, ndim, name length, id length, H, seq


@dataclass(frozen=True, slots=True)
class DType:
    """A datatype: its name in the Open Inference Protocol, Triton's code for it, NumPy's
    little-endian type, and the JavaScript typed array it reads into."""

    name: str
    code: int
    numpy: str
    js: str

    @property
    def itemsize(self) -> int:
        return np.dtype(self.numpy).itemsize


DTYPES: Final = {
    d.name: d
    for d in (
        DType("BOOL", 1, "|b1", "Uint8Array"),
        DType("UINT8", 2, "|u1", "Uint8Array"),
        DType("UINT16", 3, "<u2", "Uint16Array"),
        DType("UINT32", 4, "<u4", "Uint32Array"),
        DType("UINT64", 5, "<u8", "BigUint64Array"),
        DType("INT8", 6, "|i1", "Int8Array"),
        DType("INT16", 7, "<i2", "Int16Array"),
        DType("INT32", 8, "<i4", "Int32Array"),
        DType("INT64", 9, "<i8", "BigInt64Array"),
        DType("FP16", 10, "<f2", "Float16Array"),
        DType("FP32", 11, "<f4", "Float32Array"),
        DType("FP64", 12, "<f8", "Float64Array"),
    )
}
_BY_CODE: Final = {d.code: d for d in DTYPES.values()}
_BY_NUMPY: Final = {np.dtype(d.numpy): d for d in DTYPES.values()}


def dtype_of(array: np.ndarray) -> DType:
    """The datatype of ``array`` (its byte order made little-endian first)."""
    found = _BY_NUMPY.get(array.dtype.newbyteorder("<"))
    if found is None:
        raise ValueError(f"no tensor datatype for NumPy's {array.dtype}")
    return found


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor of a request: the request it belongs to, its name, its place in the
    request's stream (``seq``; -1: none), and its values."""

    request_id: str | None
    name: str
    array: np.ndarray
    seq: int = -1


def _pad8(size: int) -> int:
    return (size + 7) & ~7


def encode_tensor(tensor: Tensor) -> bytes:
    """The tensor frame of ``tensor`` (see the module)."""
    array = tensor.array
    dtype = dtype_of(array)
    if array.ndim > MAX_NDIM:
        raise ValueError(f"a tensor has at most {MAX_NDIM} dimensions, not {array.ndim}")
    name = tensor.name.encode()
    rid = (tensor.request_id or "").encode()
    if not 0 < len(name) < 256:
        raise ValueError("a tensor's name is 1 to 255 bytes")
    fixed = _FIXED.size + 8 * array.ndim
    start = _pad8(fixed + len(rid) + len(name))
    head = bytearray(start)
    _FIXED.pack_into(
        head, 0, TENSOR, dtype.code, array.ndim, len(name), len(rid), start, tensor.seq
    )
    struct.pack_into(f"<{array.ndim}Q", head, _FIXED.size, *array.shape)
    head[fixed : fixed + len(rid) + len(name)] = rid + name
    data = np.ascontiguousarray(array, dtype=np.dtype(dtype.numpy))
    return bytes(head) + data.tobytes()


def tensor_meta(frame: bytes) -> tuple[str | None, int | None]:
    """The request id and seq in a tensor frame's header (None: none, or no header), read
    without checking the rest (end-to-end encryption repeats them outside the seal)."""
    if len(frame) < _FIXED.size:
        return None, None
    _, _, ndim, _, rid_len, _, seq = _FIXED.unpack_from(frame)
    start = _FIXED.size + 8 * ndim
    try:
        rid = frame[start : start + rid_len].decode()
    except UnicodeDecodeError:
        return None, None
    return rid or None, None if seq == -1 else seq


def decode_tensor(frame: bytes | memoryview) -> Tensor:
    """A tensor frame's tensor; its array is a read-only view of ``frame``, not a copy.
    A frame that is not a well-formed tensor frame is an :class:`InvalidRequest` saying
    what is wrong."""
    if len(frame) < _FIXED.size or frame[0] != TENSOR:
        raise InvalidRequest("not a tensor frame: it must start with 10 and a 16-byte header")
    _, code, ndim, name_len, rid_len, start, seq = _FIXED.unpack_from(frame)
    dtype = _BY_CODE.get(code)
    if dtype is None:
        raise InvalidRequest(f"tensor frame: unknown datatype code {code}")
    if ndim > MAX_NDIM:
        raise InvalidRequest(f"tensor frame: {ndim} dimensions, at most {MAX_NDIM}")
    fixed = _FIXED.size + 8 * ndim
    if name_len == 0 or start % 8 or start < fixed + rid_len + name_len or start > len(frame):
        raise InvalidRequest("tensor frame: its header's lengths do not fit the frame")
    shape = struct.unpack_from(f"<{ndim}Q", frame, _FIXED.size)
    try:
        rid = bytes(frame[fixed : fixed + rid_len]).decode()
        name = bytes(frame[fixed + rid_len : fixed + rid_len + name_len]).decode()
    except UnicodeDecodeError:
        raise InvalidRequest("tensor frame: its request id or name is not UTF-8") from None
    count = 1
    for size in shape:
        count *= size
    if count * dtype.itemsize != len(frame) - start:
        raise InvalidRequest(
            f"tensor frame {name!r}: shape {list(shape)} of {dtype.name} is "
            f"{count * dtype.itemsize} bytes, the frame carries {len(frame) - start}"
        )
    array = np.frombuffer(frame, dtype=np.dtype(dtype.numpy), count=count, offset=start)
    return Tensor(rid or None, name, array.reshape(shape), seq)


class HeldTensors:
    """The tensor frames a client sent ahead of the JSON frame that uses them (a request's
    inputs), held by request id until it comes; bounded: at most ``max_tensors`` and
    ``max_bytes`` in all, a frame past either refused."""

    def __init__(self, max_tensors: int = 16, max_bytes: int = 16 * 1024 * 1024) -> None:
        self.max_tensors = max_tensors
        self.max_bytes = max_bytes
        self._held: dict[str, dict[str, Tensor]] = {}
        self._count = 0
        self._bytes = 0

    def add(self, tensor: Tensor) -> None:
        if tensor.request_id is None:
            raise InvalidRequest(
                f"tensor frame {tensor.name!r}: a request id is required (the request that "
                "uses it names it)"
            )
        held = self._held.setdefault(tensor.request_id, {})
        if tensor.name in held:
            raise InvalidRequest(
                f"tensor frame {tensor.name!r} of request {tensor.request_id} was sent twice",
                request_id=tensor.request_id,
            )
        if self._count >= self.max_tensors or self._bytes + tensor.array.nbytes > self.max_bytes:
            raise InvalidRequest(
                f"tensor frame {tensor.name!r}: at most {self.max_tensors} tensors and "
                f"{self.max_bytes} bytes wait for their requests on a connection",
                request_id=tensor.request_id,
            )
        held[tensor.name] = tensor
        self._count += 1
        self._bytes += tensor.array.nbytes

    def take(self, request_id: str) -> dict[str, Tensor]:
        """The tensors sent for ``request_id`` (and no longer held)."""
        held = self._held.pop(request_id, {})
        self._count -= len(held)
        self._bytes -= sum(t.array.nbytes for t in held.values())
        return held


def token_rows(tensor: Tensor, field: str) -> list[list[int]]:
    """A tensor of token ids (integers, one row, or a row per input) as lists of ids."""
    array = tensor.array
    if array.dtype.kind not in "iu" or array.ndim not in (1, 2):
        raise InvalidRequest(
            f"{field}: tensor {tensor.name!r} must hold token ids: integers, shape [tokens] or "
            f"[inputs, tokens], not {dtype_of(array).name} {list(array.shape)}"
        )
    rows = array.reshape(1, -1) if array.ndim == 1 else array
    return rows.astype(np.int64).tolist()  # type: ignore[no-any-return]
