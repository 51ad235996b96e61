"""The Open Inference Protocol's infer request and response over HTTP (KServe v2, Triton's
HTTP/REST API), with Triton's binary tensor data extension: a body in, a typed request out;
outputs in, a body out.

Pure: no I/O and no event loop. The ``/v2/models/{name}/infer`` endpoint reads the body and
its headers, calls :func:`decompress_body`, :func:`parse_header_length` and
:func:`decode_infer`, runs the model, and writes what :func:`encode_infer` returns (setting
``Inference-Header-Content-Length`` to the length it returns, when there is one). The header's
length counts bytes of the decompressed body, as tritonclient computes it before compressing.

Where the format is specified:

- KServe's "Open Inference Protocol" REST spec (``kserve/open-inference-protocol``,
  ``specification/protocol/inference_rest.md``): the request and response JSON, ``$parameters``
  (string, number or boolean values), and errors as ``{"error": "..."}``.
- Triton's binary data extension (``triton-inference-server/server``,
  ``docs/protocol/extension_binary_data.md``): ``Inference-Header-Content-Length: N`` says the
  body's first N bytes are the JSON and the rest the raw data of the inputs that carry
  ``parameters.binary_data_size``, in the order of ``inputs``, each little-endian and row-major;
  a BYTES tensor is each element as a 4-byte little-endian length, then its bytes. The response
  does the same for the outputs asked for with ``binary_data`` (or, for all of them,
  ``binary_data_output``).

The datatypes are those of :data:`seedance.protocol.tensors.DTYPES`, plus BYTES (a list of
``bytes``, row-major). Refused by name rather than ignored, since a client that asked for one
would otherwise get something other than it asked for: shared memory (``shared_memory_*``
parameters), classification outputs (``classification``) and BF16 (NumPy has no bfloat16).

A decoded input's array is a read-only view of the body, not a copy; the body does not pad, so
the view may be unaligned (NumPy copes; a library that needs alignment must copy).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import numpy as np

from seedance.protocol.errors import InvalidJSON, InvalidRequest, PayloadTooLarge
from seedance.protocol.tensors import DTYPES, DType

#: A ``$parameters`` object: each value a string, a number or a boolean.
Parameters = dict[str, bool | int | float | str]
#: A tensor's values: an array of its datatype, or for BYTES a flat list of ``bytes``.
TensorData = np.ndarray | list[bytes]

#: The one datatype that :data:`DTYPES` lacks: variable-length byte strings.
BYTES: Final = "BYTES"
#: The HTTP header that says how long the JSON at the start of a body is.
HEADER_LENGTH: Final = "Inference-Header-Content-Length"

_U32: Final = struct.Struct("<I")
_INT64_MAX: Final = 2**63 - 1
#: numpy's own limit on dimensions (``NPY_MAXDIMS`` of NumPy 2).
_MAX_NDIM: Final = 64
_ENCODINGS: Final = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_NAMES: Final = ", ".join([*DTYPES, BYTES])


@dataclass(frozen=True, slots=True)
class InferInput:
    """One input of a request. ``data`` is an array of the datatype shaped ``shape`` (a
    read-only view of the body when it came in binary), or for BYTES a flat list of ``bytes``;
    ``parameters`` are the input's own, ``binary_data_size`` taken out."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: TensorData
    parameters: Parameters = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestedOutput:
    """An output the client asked for. ``binary``: its ``binary_data`` (``None`` when not
    given: the request's ``binary_data_output`` decides); ``parameters``: the rest."""

    name: str
    binary: bool | None = None
    parameters: Parameters = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InferRequest:
    """A decoded infer request. ``outputs`` is ``None`` when the client named none (Triton
    then returns every output); ``binary_output`` is ``parameters.binary_data_output`` and
    ``parameters`` the request's other parameters, left for the caller to judge."""

    id: str | None
    inputs: tuple[InferInput, ...]
    outputs: tuple[RequestedOutput, ...] | None = None
    binary_output: bool = False
    parameters: Parameters = field(default_factory=dict)

    def wants_binary(self, output: str) -> bool:
        """Whether ``output`` goes back in binary: its own ``binary_data`` if it was named
        with one, else the request's ``binary_data_output``."""
        for requested in self.outputs or ():
            if requested.name == output and requested.binary is not None:
                return requested.binary
        return self.binary_output


@dataclass(frozen=True, slots=True)
class InferOutput:
    """One output of a response: ``data`` as in :class:`InferInput` (an array is converted to
    the datatype)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: TensorData


# --------------------------------------------------------------------------- request


def parse_header_length(value: str | None) -> int | None:
    """The ``Inference-Header-Content-Length`` header's value as a byte count (``None``: no
    header, the whole body is JSON)."""
    if value is None:
        return None
    text = value.strip()
    if not text.isascii() or not text.isdigit():
        raise InvalidRequest(f"{HEADER_LENGTH}: expected a byte count, got {value!r}")
    return int(text)


def decode_infer(body: bytes, header_length: int | None) -> InferRequest:
    """The infer request in ``body`` (decompressed already), whose first ``header_length``
    bytes are the JSON (``None``: all of it). Every input is checked against its datatype and
    shape, and the binary data must fill the rest of the body exactly. Raises
    :class:`InvalidJSON` or :class:`InvalidRequest`, naming the field."""
    json_end = _json_end(body, header_length)
    request = _decode_json(memoryview(body)[:json_end])
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise InvalidRequest("id: expected a string")
    parameters = _parameters(request.get("parameters"), "parameters")
    binary_output = parameters.pop("binary_data_output", False)
    if not isinstance(binary_output, bool):
        raise InvalidRequest("parameters.binary_data_output: expected true or false")
    specs = _input_specs(request.get("inputs"))
    _check_binary_total(specs, len(body) - json_end, header_length)
    inputs: list[InferInput] = []
    offset = json_end
    for spec in specs:
        if spec.binary_size is None:
            data = _from_json(spec)
        else:
            data = _from_binary(body, offset, spec)
            offset += spec.binary_size
        inputs.append(InferInput(spec.name, spec.dtype, spec.shape, data, spec.parameters))
    return InferRequest(
        request_id,
        tuple(inputs),
        _requested_outputs(request.get("outputs")),
        binary_output,
        parameters,
    )


@dataclass(frozen=True, slots=True)
class _Spec:
    """An input's fields, checked, before its values are read."""

    where: str  # "inputs[0] (X)", to start a message with
    name: str
    dtype: str
    shape: tuple[int, ...]
    count: int
    parameters: Parameters
    values: list[Any] | None  # the JSON ``data``, flattened
    binary_size: int | None


def _json_end(body: bytes, header_length: int | None) -> int:
    if header_length is None:
        return len(body)
    if header_length < 0:
        raise InvalidRequest(f"{HEADER_LENGTH}: expected a byte count >= 0, got {header_length}")
    if header_length > len(body):
        raise InvalidRequest(
            f"{HEADER_LENGTH}: {header_length} is more than the body's {len(body)} bytes"
        )
    return header_length


def _decode_json(data: memoryview) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidJSON(f"the request's JSON is not valid: {reason}") from None
    if not isinstance(obj, dict):
        raise InvalidJSON(f"the request must be a JSON object, got {_json_type(obj)}")
    return obj


def _parameters(value: Any, path: str) -> Parameters:
    """A ``$parameters`` object, copied (its values: strings, numbers or booleans)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"{path}: expected an object")
    for key, item in value.items():
        if key.startswith("shared_memory"):
            raise InvalidRequest(f"{path}.{key}: shared memory is not supported")
        if not isinstance(item, bool | int | float | str):
            raise InvalidRequest(f"{path}.{key}: expected a string, a number or a boolean")
    return dict(value)


def _input_specs(value: Any) -> list[_Spec]:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("inputs: expected a non-empty list of tensors")
    specs: list[_Spec] = []
    seen: set[str] = set()
    for index, item in enumerate(value):
        spec = _input_spec(item, f"inputs[{index}]")
        if spec.name in seen:
            raise InvalidRequest(f"inputs[{index}].name: {spec.name!r} is given twice")
        seen.add(spec.name)
        specs.append(spec)
    return specs


def _input_spec(item: Any, path: str) -> _Spec:
    if not isinstance(item, dict):
        raise InvalidRequest(f"{path}: expected an object")
    name = _name(item.get("name"), path)
    dtype = _datatype(item.get("datatype"), path)
    shape = _shape(item.get("shape"), path)
    where = f"{path} ({name})"
    count = _product(shape)
    parameters = _parameters(item.get("parameters"), f"{path}.parameters")
    size = parameters.pop("binary_data_size", None)
    data = item.get("data")
    if data is not None and size is not None:
        raise InvalidRequest(f"{where}: has both data and parameters.binary_data_size; send one")
    if data is None and size is None:
        raise InvalidRequest(f"{where}: no values: send data or parameters.binary_data_size")
    if size is not None:
        size = _binary_size(size, path, where, dtype, shape)
        return _Spec(where, name, dtype, shape, count, parameters, None, size)
    values = _flatten(data, f"{path}.data")
    if len(values) != count:
        raise InvalidRequest(f"{where}: {len(values)} values for shape {list(shape)}")
    return _Spec(where, name, dtype, shape, count, parameters, values, None)


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{path}.name: expected a non-empty string")
    return value


def _datatype(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{path}.datatype: expected a string such as FP32")
    if value == "BF16":
        raise InvalidRequest(f"{path}.datatype: BF16 is not supported")
    if value != BYTES and value not in DTYPES:
        raise InvalidRequest(f"{path}.datatype: unknown datatype {value!r}; one of {_NAMES}")
    return value


def _shape(value: Any, path: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(_is_int(s) and s >= 0 for s in value):
        raise InvalidRequest(f"{path}.shape: expected a list of sizes >= 0")
    if len(value) > _MAX_NDIM:
        raise InvalidRequest(f"{path}.shape: {len(value)} dimensions, at most {_MAX_NDIM}")
    if _product([s for s in value if s]) * 8 > _INT64_MAX:  # what NumPy can index
        raise InvalidRequest(f"{path}.shape: {value} is too large a tensor")
    return tuple(value)


def _binary_size(value: Any, path: str, where: str, dtype: str, shape: tuple[int, ...]) -> int:
    """An input's ``binary_data_size``: for a fixed-size datatype, exactly what its shape
    takes (BYTES are checked as they are read)."""
    if not _is_int(value) or value < 0:
        raise InvalidRequest(f"{path}.parameters.binary_data_size: expected a byte count >= 0")
    fixed = DTYPES.get(dtype)
    if fixed is not None and value != _product(shape) * fixed.itemsize:
        raise InvalidRequest(
            f"{where}: binary_data_size is {value} bytes; shape {list(shape)} of {dtype} is "
            f"{_product(shape) * fixed.itemsize}"
        )
    size: int = value
    return size


def _flatten(data: Any, path: str) -> list[Any]:
    """``data``'s values, row-major, whether it came flat or as nested lists."""
    if not isinstance(data, list):
        raise InvalidRequest(f"{path}: expected a list of values")
    if not any(isinstance(v, list) for v in data):
        return data
    flat: list[Any] = []
    stack = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            flat.append(value)
        else:
            stack.pop()
    return flat


def _check_binary_total(specs: list[_Spec], given: int, header_length: int | None) -> None:
    expected = sum(s.binary_size for s in specs if s.binary_size is not None)
    if expected == given:
        return
    hint = f" (no {HEADER_LENGTH} header: the whole body was read as JSON)"
    raise InvalidRequest(
        f"binary data: the inputs' binary_data_size add up to {expected} bytes, the body has "
        f"{given} after its JSON{hint if header_length is None else ''}"
    )


def _from_binary(body: bytes, offset: int, spec: _Spec) -> TensorData:
    size = spec.binary_size or 0
    if spec.dtype == BYTES:
        view = memoryview(body)[offset : offset + size]
        return _unpack_bytes(view, spec)
    dtype = DTYPES[spec.dtype]
    array = np.frombuffer(body, dtype=np.dtype(dtype.numpy), count=spec.count, offset=offset)
    if dtype.name == "BOOL" and spec.count and array.view(np.uint8).max() > 1:
        raise InvalidRequest(f"{spec.where}: BOOL values in binary are bytes 0 or 1")
    return array.reshape(spec.shape)


def _unpack_bytes(view: memoryview, spec: _Spec) -> list[bytes]:
    """The BYTES elements of ``view``: each a 4-byte little-endian length, then its bytes."""
    elements: list[bytes] = []
    position, end = 0, len(view)
    while position < end:
        if len(elements) == spec.count:
            raise InvalidRequest(
                f"{spec.where}: binary_data_size holds more than the {spec.count} values of "
                f"shape {list(spec.shape)}"
            )
        if end - position < _U32.size:
            raise InvalidRequest(
                f"{spec.where}: BYTES value {len(elements)}'s 4-byte length runs past "
                "binary_data_size"
            )
        (length,) = _U32.unpack_from(view, position)
        position += _U32.size
        if length > end - position:
            raise InvalidRequest(
                f"{spec.where}: BYTES value {len(elements)} of {length} bytes runs past "
                "binary_data_size"
            )
        elements.append(bytes(view[position : position + length]))
        position += length
    if len(elements) != spec.count:
        raise InvalidRequest(f"{spec.where}: {len(elements)} values for shape {list(spec.shape)}")
    return elements


def _from_json(spec: _Spec) -> TensorData:
    values = spec.values or []
    if spec.dtype == BYTES:
        return _json_bytes(values, spec.where)
    dtype = DTYPES[spec.dtype]
    kind = np.dtype(dtype.numpy).kind
    if kind == "b":
        array = _json_bools(values, spec.where)
    elif kind in "iu":
        array = _json_ints(values, dtype, spec.where)
    else:
        array = _json_floats(values, dtype, spec.where)
    return array.reshape(spec.shape)


def _json_bytes(values: list[Any], where: str) -> list[bytes]:
    bad = _first(values, lambda v: not isinstance(v, str))
    if bad is not None:
        raise InvalidRequest(f"{where}: data[{bad}] is {_show(values[bad])}, expected a string")
    return [v.encode() for v in values]


def _json_bools(values: list[Any], where: str) -> np.ndarray:
    bad = _first(values, lambda v: not isinstance(v, bool))
    if bad is not None:
        raise InvalidRequest(
            f"{where}: data[{bad}] is {_show(values[bad])}, expected true or false for BOOL"
        )
    return np.array(values, dtype=np.bool_)


def _json_ints(values: list[Any], dtype: DType, where: str) -> np.ndarray:
    bad = _first(values, lambda v: not _is_int(v))
    if bad is not None:
        raise InvalidRequest(
            f"{where}: data[{bad}] is {_show(values[bad])}, expected an integer for {dtype.name}"
        )
    info = np.iinfo(np.dtype(dtype.numpy))
    low, high = int(info.min), int(info.max)
    if values and (min(values) < low or max(values) > high):
        bad = _first(values, lambda v: not low <= v <= high)
        raise InvalidRequest(
            f"{where}: data[{bad}] is {values[bad or 0]}, out of range for {dtype.name} "
            f"({low} to {high})"
        )
    return np.array(values, dtype=np.dtype(dtype.numpy))


def _json_floats(values: list[Any], dtype: DType, where: str) -> np.ndarray:
    bad = _first(values, lambda v: isinstance(v, bool) or not isinstance(v, int | float))
    if bad is not None:
        raise InvalidRequest(
            f"{where}: data[{bad}] is {_show(values[bad])}, expected a number for {dtype.name}"
        )
    try:
        with np.errstate(over="ignore"):  # an overflow is found just below, by value
            array = np.array(values, dtype=np.float64).astype(np.dtype(dtype.numpy))
        finite = bool(np.isfinite(array).all())
    except OverflowError:  # an integer beyond float64
        finite = False
    if not finite:
        limit = float(np.finfo(np.dtype(dtype.numpy)).max)
        bad = _first(values, lambda v: abs(v) > limit and not np.isfinite(_to(v, dtype)))
        raise InvalidRequest(
            f"{where}: data[{bad}] is {_show(values[bad or 0])}, out of range for {dtype.name} "
            f"(magnitude up to {limit:g})"
        )
    return array


def _to(value: int | float, dtype: DType) -> float:
    """``value`` as ``dtype`` would hold it (infinite when it overflows)."""
    try:
        with np.errstate(over="ignore"):
            return float(np.array(float(value)).astype(np.dtype(dtype.numpy)))
    except OverflowError:
        return float("inf")


def _requested_outputs(value: Any) -> tuple[RequestedOutput, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise InvalidRequest("outputs: expected a list of outputs")
    outputs: list[RequestedOutput] = []
    seen: set[str] = set()
    for index, item in enumerate(value):
        path = f"outputs[{index}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{path}: expected an object")
        name = _name(item.get("name"), path)
        if name in seen:
            raise InvalidRequest(f"{path}.name: {name!r} is asked for twice")
        seen.add(name)
        parameters = _parameters(item.get("parameters"), f"{path}.parameters")
        if "classification" in parameters:
            raise InvalidRequest(f"{path}.parameters.classification: not supported")
        binary = parameters.pop("binary_data", None)
        if binary is not None and not isinstance(binary, bool):
            raise InvalidRequest(f"{path}.parameters.binary_data: expected true or false")
        outputs.append(RequestedOutput(name, binary, parameters))
    return tuple(outputs) or None  # none named: every output, as Triton does


# --------------------------------------------------------------------------- response


def encode_infer(
    model_name: str,
    outputs: list[tuple[InferOutput, bool]],
    *,
    model_version: str | None = None,
    request_id: str | None = None,
    parameters: Parameters | None = None,
) -> tuple[bytes, int | None]:
    """The response body for ``outputs``, each with whether it goes in binary, and the length
    of its JSON for ``Inference-Header-Content-Length`` (``None`` when no output is binary: the
    body is all JSON). A value JSON cannot carry (BYTES that are not UTF-8, a NaN or an
    infinity) raises :class:`InvalidRequest` telling the client to ask for binary data."""
    tensors: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for index, (output, binary) in enumerate(outputs):
        tensor: dict[str, Any] = {
            "name": output.name,
            "datatype": output.datatype,
            "shape": list(output.shape),
        }
        if binary:
            blob = _pack(output)
            tensor["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            tensor["data"] = _json_values(output, f"outputs[{index}] ({output.name})")
        tensors.append(tensor)
    response: dict[str, Any] = {"model_name": model_name}
    if model_version is not None:
        response["model_version"] = model_version
    if request_id is not None:
        response["id"] = request_id
    if parameters:
        response["parameters"] = parameters
    response["outputs"] = tensors
    head = msgspec.json.encode(response)
    if not blobs:
        return head, None
    return b"".join([head, *blobs]), len(head)


def oip_error(message: str) -> bytes:
    """The body of an error response: ``{"error": message}``."""
    return msgspec.json.encode({"error": message})


def _pack(output: InferOutput) -> bytes:
    if output.datatype == BYTES:
        parts: list[bytes] = []
        for element in _elements(output):
            parts += (_U32.pack(len(element)), element)
        return b"".join(parts)
    return _array(output).tobytes()


def _json_values(output: InferOutput, where: str) -> list[Any]:
    if output.datatype == BYTES:
        try:
            return [element.decode() for element in _elements(output)]
        except UnicodeDecodeError:
            raise InvalidRequest(
                f"{where}: a BYTES value is not UTF-8, so JSON cannot carry it; ask for this "
                "output with parameters.binary_data: true"
            ) from None
    array = _array(output)
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidRequest(
            f"{where}: holds NaN or infinity, which JSON cannot carry; ask for this output "
            "with parameters.binary_data: true"
        )
    values: list[Any] = array.tolist()
    return values


def _array(output: InferOutput) -> np.ndarray:
    """``output``'s values as a flat little-endian array of its datatype."""
    dtype = DTYPES.get(output.datatype)
    if dtype is None:
        raise ValueError(f"output {output.name!r}: no datatype {output.datatype!r}")
    array = np.ascontiguousarray(output.data, dtype=np.dtype(dtype.numpy)).reshape(-1)
    if array.size != _product(output.shape):
        raise ValueError(f"output {output.name!r}: {array.size} values for {output.shape}")
    return array


def _elements(output: InferOutput) -> list[bytes]:
    """A BYTES output's values, flat; a ``str`` (NumPy object arrays often hold them) as
    UTF-8."""
    data = output.data
    values = list(data.reshape(-1)) if isinstance(data, np.ndarray) else list(data)
    if len(values) != _product(output.shape):
        raise ValueError(f"output {output.name!r}: {len(values)} values for {output.shape}")
    return [_element(value, output.name) for value in values]


def _element(value: Any, name: str) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise ValueError(f"output {name!r}: a BYTES value is {type(value).__name__}, not bytes")


# --------------------------------------------------------------------------- compression


def decompress_body(body: bytes, content_encoding: str | None, *, limit: int) -> bytes:
    """``body`` decoded by its ``Content-Encoding`` (``gzip``, ``deflate`` (a zlib stream) or
    ``identity``; tritonclient compresses requests on request). Decompressed a piece at a time
    and refused past ``limit`` bytes (:class:`PayloadTooLarge`), so that a small bomb cannot
    fill memory."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        if len(body) > limit:
            raise PayloadTooLarge(f"the request body is over {limit} bytes")
        return body
    wbits = _ENCODINGS.get(encoding)
    if wbits is None:
        raise InvalidRequest(
            f"Content-Encoding: {content_encoding!r} is not supported; use gzip, deflate or "
            "identity"
        )
    return _inflate(body, wbits, encoding, limit)


def _inflate(data: bytes, wbits: int, encoding: str, limit: int) -> bytes:
    out = bytearray()
    while True:  # gzip allows several members, one after another
        stream = zlib.decompressobj(wbits)
        try:
            out += stream.decompress(data, limit + 1 - len(out))
            while stream.unconsumed_tail and len(out) <= limit:
                out += stream.decompress(stream.unconsumed_tail, limit + 1 - len(out))
        except zlib.error as exc:
            raise InvalidRequest(
                f"Content-Encoding {encoding}: the body is not {encoding} data ({exc})"
            ) from None
        if len(out) > limit:
            raise PayloadTooLarge(f"the request body decompresses to more than {limit} bytes")
        if not stream.eof:
            raise InvalidRequest(f"Content-Encoding {encoding}: the body's data is cut short")
        data = stream.unused_data
        if not data:
            return bytes(out)
        if encoding != "gzip" or not data.startswith(b"\x1f\x8b"):  # not another member
            raise InvalidRequest(f"Content-Encoding {encoding}: bytes after the end of the data")


# --------------------------------------------------------------------------- helpers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _product(sizes: Iterable[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _first(values: list[Any], bad: Callable[[Any], bool]) -> int | None:
    """The index of the first value ``bad`` says is, or ``None``."""
    return next((i for i, v in enumerate(values) if bad(v)), None)


def _show(value: Any) -> str:
    """A value as JSON writes it, cut short to keep a message readable."""
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")
