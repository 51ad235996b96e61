"""The Open Inference Protocol codec (``seedance.protocol.oip``) against the unchanged clients
people use: tritonclient's HTTP request builder and response parser, and KServe's own
``InferRequest``/``InferResponse``. Pure and fast: no server, no event loop."""

from __future__ import annotations

import gzip
import json
import struct
import zlib
from typing import Any

import msgspec
import numpy as np
import pytest
import tritonclient.http as httpclient

from seedance.protocol.errors import InvalidJSON, InvalidRequest, PayloadTooLarge
from seedance.protocol.oip import (
    InferOutput,
    RequestedOutput,
    decode_infer,
    decompress_body,
    encode_infer,
    oip_error,
    parse_header_length,
)

DATATYPES = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]


def sample(datatype: str, shape: tuple[int, ...] = (2, 3)) -> np.ndarray:
    """Values of ``datatype`` that reach its extremes, where it has room for them."""
    count = int(np.prod(shape))
    if datatype == "BOOL":
        return (np.arange(count) % 2 == 0).reshape(shape)
    if datatype == "BYTES":
        words = [b"", b"caf\xc3\xa9", b"a b", b"\x00nul", b"z" * 300, b"{}"]
        return np.array((words * count)[:count], dtype=np.object_).reshape(shape)
    dtype = np.dtype(datatype.replace("FP", "float").replace("UINT", "uint").lower())
    if dtype.kind == "f":
        values = [0.5, -1.25, 3.140625, 1e-3, -0.0, 65504.0] * count
    else:
        info = np.iinfo(dtype)
        values = [int(info.min), int(info.max), 0, 1, int(info.max) - 1, 7] * count
    return np.array(values[:count], dtype=dtype).reshape(shape)


def as_list(data: Any) -> list[Any]:
    """BYTES values, from whatever a decoder returned, as a flat list of bytes."""
    return [bytes(v) for v in np.asarray(data, dtype=np.object_).reshape(-1)]


def assert_same(datatype: str, got: Any, expected: np.ndarray) -> None:
    if datatype == "BYTES":
        assert as_list(got) == as_list(expected)
    else:
        assert isinstance(got, np.ndarray)
        assert got.dtype == expected.dtype.newbyteorder("<")
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def triton_body(
    arrays: dict[str, tuple[np.ndarray, bool]], **kwargs: Any
) -> tuple[bytes, int | None]:
    """A request body as tritonclient's HTTP client builds it (``binary`` per input)."""
    inputs = []
    for name, (array, binary) in arrays.items():
        datatype = "BYTES" if array.dtype == np.object_ else dtype_name(array)
        tensor = httpclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    body, json_size = httpclient.InferenceServerClient.generate_request_body(inputs, **kwargs)
    return bytes(body), json_size


def dtype_name(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    name: str = np_to_triton_dtype(array.dtype)
    return name


def oip(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


# --------------------------------------------------------------------------- requests


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
def test_decodes_every_datatype_from_tritonclient(datatype: str, binary: bool) -> None:
    array = sample(datatype)
    body, json_size = triton_body({"X": (array, binary)})
    assert (json_size is not None) == binary

    request = decode_infer(body, json_size)

    (got,) = request.inputs
    assert (got.name, got.datatype, got.shape) == ("X", datatype, (2, 3))
    assert "binary_data_size" not in got.parameters
    assert_same(datatype, got.data, array)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
def test_decodes_empty_tensors(datatype: str, binary: bool) -> None:
    array = sample(datatype, (0, 3))
    body, json_size = triton_body({"X": (array, binary)})

    (got,) = decode_infer(body, json_size).inputs

    assert got.shape == (0, 3)
    assert len(got.data) == 0
    if datatype != "BYTES":
        assert isinstance(got.data, np.ndarray) and got.data.shape == (0, 3)


def test_decodes_several_inputs_mixed_with_outputs_id_and_parameters() -> None:
    arrays = {
        "A": (sample("FP32", (4,)), True),
        "B": (sample("BYTES", (2, 2)), False),
        "C": (sample("INT64", (1, 3)), True),
        "D": (sample("BOOL", (5,)), False),
        "E": (sample("BYTES", (3,)), True),
        "F": (sample("FP16", (2, 1, 2)), True),
    }
    outputs = [
        httpclient.InferRequestedOutput("Y", binary_data=True),
        httpclient.InferRequestedOutput("Z", binary_data=False),
    ]
    body, json_size = triton_body(
        arrays,
        outputs=outputs,
        request_id="req-7",
        sequence_id=42,
        sequence_start=True,
        priority=2,
        timeout=1000,
        parameters={"temperature": 0.5, "mode": "fast"},
    )

    request = decode_infer(body, json_size)

    assert request.id == "req-7"
    assert [i.name for i in request.inputs] == list(arrays)
    for got in request.inputs:
        assert_same(got.datatype, got.data, arrays[got.name][0])
    assert request.outputs == (RequestedOutput("Y", True), RequestedOutput("Z", False))
    assert request.binary_output is False
    assert request.wants_binary("Y") and not request.wants_binary("Z")
    # Everything else the client put in parameters is left for the endpoint to judge.
    assert request.parameters == {
        "sequence_id": 42,
        "sequence_start": True,
        "sequence_end": False,
        "priority": 2,
        "timeout": 1000,
        "temperature": 0.5,
        "mode": "fast",
    }


def test_tritonclient_without_outputs_asks_for_every_output_in_binary() -> None:
    body, json_size = triton_body({"X": (sample("FP32"), False)})

    request = decode_infer(body, json_size)

    assert json_size is None  # no binary input: the whole body is JSON
    assert request.id is None
    assert request.outputs is None
    assert request.binary_output is True
    assert request.parameters == {}
    assert request.wants_binary("anything")


def test_an_output_s_binary_data_overrides_binary_data_output() -> None:
    body = oip(
        {
            "parameters": {"binary_data_output": True},
            "inputs": [{"name": "X", "shape": [1], "datatype": "INT32", "data": [1]}],
            "outputs": [{"name": "Y", "parameters": {"binary_data": False}}, {"name": "Z"}],
        }
    )

    request = decode_infer(body, None)

    assert not request.wants_binary("Y")
    assert request.wants_binary("Z")
    assert request.outputs == (RequestedOutput("Y", False), RequestedOutput("Z", None))


def test_an_empty_outputs_list_means_every_output() -> None:
    body = oip(
        {"inputs": [{"name": "X", "shape": [1], "datatype": "INT8", "data": [1]}], "outputs": []}
    )
    assert decode_infer(body, None).outputs is None


def test_binary_inputs_are_views_of_the_body_not_copies() -> None:
    array = sample("FP64", (3, 4))
    body, json_size = triton_body({"X": (array, True)})

    (got,) = decode_infer(body, json_size).inputs

    assert isinstance(got.data, np.ndarray)
    assert np.shares_memory(got.data, np.frombuffer(body, dtype=np.uint8))
    assert not got.data.flags.writeable


def test_json_data_may_be_nested_row_major() -> None:
    body = oip(
        {
            "inputs": [
                {"name": "X", "shape": [2, 3], "datatype": "FP32", "data": [[1, 2, 3], [4, 5, 6]]},
                {"name": "S", "shape": [2, 1], "datatype": "BYTES", "data": [["a"], ["é"]]},
                {"name": "B", "shape": [1, 2], "datatype": "BOOL", "data": [[[True], [False]]]},
                {"name": "K", "shape": [], "datatype": "UINT64", "data": [2**64 - 1]},
            ]
        }
    )

    x, s, b, k = decode_infer(body, None).inputs

    np.testing.assert_array_equal(x.data, np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    assert s.data == [b"a", "é".encode()]
    np.testing.assert_array_equal(b.data, [[True, False]])
    assert isinstance(k.data, np.ndarray) and k.data.shape == () and int(k.data) == 2**64 - 1


def test_input_parameters_other_than_binary_data_size_are_kept() -> None:
    body = oip(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [1],
                    "datatype": "FP64",
                    "data": [1.5],
                    "parameters": {"content_type": "np"},
                }
            ]
        }
    )
    assert decode_infer(body, None).inputs[0].parameters == {"content_type": "np"}


def test_decodes_a_kserve_binary_request() -> None:
    kserve = pytest.importorskip("kserve")
    from kserve.protocol.infer_type import RequestedOutput as KServeOutput

    fp32, text = sample("FP32"), sample("BYTES", (3,))
    inputs = [
        kserve.InferInput("X", [2, 3], "FP32"),
        kserve.InferInput("S", [3], "BYTES"),
        kserve.InferInput("N", [2], "INT64", data=[5, -6]),  # stays JSON
    ]
    inputs[0].set_data_from_numpy(fp32, binary_data=True)
    inputs[1].set_data_from_numpy(text, binary_data=True)
    request = kserve.InferRequest(
        "m",
        inputs,
        request_id="k-1",
        parameters={"binary_data_output": True, "seed": 3},
        request_outputs=[KServeOutput("Y", parameters={"binary_data": False})],
    )
    body, json_length = request.to_rest()
    assert isinstance(body, bytes)

    got = decode_infer(body, json_length)

    assert got.id == "k-1"
    x, s, n = got.inputs
    assert_same("FP32", x.data, fp32)
    assert s.data == as_list(text)
    np.testing.assert_array_equal(n.data, np.array([5, -6], dtype=np.int64))
    assert got.binary_output and not got.wants_binary("Y")
    assert got.parameters == {"seed": 3}


# --------------------------------------------------------------------------- responses


def triton_parse(body: bytes, header_length: int | None) -> Any:
    return httpclient.InferenceServerClient.parse_response_body(body, header_length=header_length)


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("datatype", DATATYPES)
def test_tritonclient_reads_every_datatype(datatype: str, binary: bool) -> None:
    array = sample(datatype)
    data = as_list(array) if datatype == "BYTES" else array
    output = InferOutput("Y", datatype, (2, 3), data)

    body, header_length = encode_infer("m", [(output, binary)])

    assert (header_length is not None) == binary
    got = triton_parse(body, header_length).as_numpy("Y")
    assert got.shape == (2, 3)
    if datatype == "BYTES" and not binary:
        # From JSON, tritonclient hands BYTES back as str, not bytes.
        assert list(got.reshape(-1)) == [v.decode() for v in as_list(array)]
    else:
        assert_same(datatype, got, array)


@pytest.mark.parametrize("datatype", DATATYPES)
def test_tritonclient_reads_empty_outputs(datatype: str) -> None:
    data = [] if datatype == "BYTES" else sample(datatype, (0, 2))
    outputs = [
        (InferOutput("B", datatype, (0, 2), data), True),
        (InferOutput("J", datatype, (0, 2), data), False),
    ]

    body, header_length = encode_infer("m", outputs)

    result = triton_parse(body, header_length)
    assert result.as_numpy("B").shape == (0, 2)
    assert result.as_numpy("J").shape == (0, 2)


def test_a_response_mixing_binary_and_json_outputs() -> None:
    fp32, i8, text = sample("FP32"), sample("INT8", (6,)), sample("BYTES", (2,))
    outputs = [
        (InferOutput("A", "FP32", (2, 3), fp32), True),
        (InferOutput("B", "INT8", (6,), i8), False),
        (InferOutput("C", "BYTES", (2,), as_list(text)), True),
    ]

    body, header_length = encode_infer(
        "m", outputs, model_version="3", request_id="r-1", parameters={"sequence_id": 9}
    )

    assert header_length is not None
    head = json.loads(body[:header_length])
    assert head["model_name"] == "m" and head["model_version"] == "3" and head["id"] == "r-1"
    assert head["parameters"] == {"sequence_id": 9}
    assert head["outputs"][0] == {
        "name": "A",
        "datatype": "FP32",
        "shape": [2, 3],
        "parameters": {"binary_data_size": 24},
    }
    assert "parameters" not in head["outputs"][1] and len(head["outputs"][1]["data"]) == 6
    result = triton_parse(body, header_length)
    assert result.get_response()["id"] == "r-1"
    assert_same("FP32", result.as_numpy("A"), fp32)
    assert_same("INT8", result.as_numpy("B"), i8)
    assert_same("BYTES", result.as_numpy("C"), text)


def test_a_response_without_a_request_id_has_no_id() -> None:
    body, header_length = encode_infer(
        "m", [(InferOutput("Y", "INT32", (1,), [np.int32(4)]), False)]
    )
    assert header_length is None
    assert json.loads(body) == {
        "model_name": "m",
        "outputs": [{"name": "Y", "datatype": "INT32", "shape": [1], "data": [4]}],
    }


def test_json_output_data_is_flat_and_converted_to_the_datatype() -> None:
    big_endian = np.arange(6, dtype=">f8").reshape(3, 2)
    body, _ = encode_infer("m", [(InferOutput("Y", "FP32", (3, 2), big_endian), False)])
    assert json.loads(body)["outputs"][0]["data"] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_kserve_reads_a_response(binary: bool) -> None:
    pytest.importorskip("kserve")
    from kserve import InferResponse

    fp32, text = sample("FP32"), sample("BYTES", (3,))
    outputs = [
        (InferOutput("A", "FP32", (2, 3), fp32), binary),
        (InferOutput("S", "BYTES", (3,), as_list(text)), binary),
    ]
    body, header_length = encode_infer("m", outputs, request_id="k-2")

    response = InferResponse.from_bytes(body, header_length or len(body))

    assert response.id == "k-2" and response.model_name == "m"
    a, s = response.outputs
    np.testing.assert_array_equal(a.as_numpy(), fp32)
    # KServe turns every output into JSON values, so BYTES come back as str.
    assert s.data == [v.decode() for v in as_list(text)]


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_bytes_outputs_may_hold_str(binary: bool) -> None:
    words = np.array([["é", b"b"]], dtype=np.object_)
    body, header_length = encode_infer("m", [(InferOutput("Y", "BYTES", (1, 2), words), binary)])
    got = triton_parse(body, header_length).as_numpy("Y")
    assert got.tolist() == ([["é".encode(), b"b"]] if binary else [["é", "b"]])


def test_an_output_whose_values_do_not_fit_is_a_server_bug() -> None:
    with pytest.raises(ValueError, match="output 'Y': 5 values for"):
        encode_infer("m", [(InferOutput("Y", "FP32", (2, 3), np.zeros(5)), True)])
    with pytest.raises(ValueError, match="a BYTES value is int"):
        encode_infer("m", [(InferOutput("Y", "BYTES", (1,), np.array([3], np.object_)), True)])


def test_bytes_that_are_not_utf8_cannot_go_in_json() -> None:
    output = InferOutput("Y", "BYTES", (1,), [b"\xff\xfe"])

    with pytest.raises(InvalidRequest, match=r"outputs\[0\] \(Y\).*binary_data"):
        encode_infer("m", [(output, False)])
    body, header_length = encode_infer("m", [(output, True)])
    assert list(triton_parse(body, header_length).as_numpy("Y")) == [b"\xff\xfe"]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_nan_and_infinity_cannot_go_in_json(value: float) -> None:
    output = InferOutput("Y", "FP32", (2,), np.array([1.0, value], dtype=np.float32))

    with pytest.raises(InvalidRequest, match=r"outputs\[1\] \(Y\).*binary_data"):
        encode_infer(
            "m", [(InferOutput("X", "INT8", (0,), np.zeros(0, np.int8)), False), (output, False)]
        )
    body, header_length = encode_infer("m", [(output, True)])
    np.testing.assert_array_equal(triton_parse(body, header_length).as_numpy("Y"), output.data)


def test_oip_error() -> None:
    assert json.loads(oip_error('inputs[0].shape: "x"')) == {"error": 'inputs[0].shape: "x"'}


# --------------------------------------------------------------------------- refusals


def one(**fields: Any) -> dict[str, Any]:
    """A request of one input, ``fields`` replacing (or, as None, removing) its own."""
    tensor = {"name": "X", "shape": [2], "datatype": "INT32", "data": [1, 2]} | fields
    return {"inputs": [{k: v for k, v in tensor.items() if v is not None}]}


REFUSED_JSON = {
    "inputs missing": ({}, "inputs: expected a non-empty list"),
    "inputs empty": ({"inputs": []}, "inputs: expected a non-empty list"),
    "inputs not a list": ({"inputs": {"name": "X"}}, "inputs: expected a non-empty list"),
    "input not an object": ({"inputs": [3]}, "inputs[0]: expected an object"),
    "no name": (one(name=None), "inputs[0].name: expected a non-empty string"),
    "empty name": (one(name=""), "inputs[0].name: expected a non-empty string"),
    "name not a string": (one(name=5), "inputs[0].name: expected a non-empty string"),
    "names twice": (
        {"inputs": one()["inputs"] * 2},
        "inputs[1].name: 'X' is given twice",
    ),
    "no datatype": (one(datatype=None), "inputs[0].datatype: expected a string"),
    "unknown datatype": (one(datatype="FLOAT"), "inputs[0].datatype: unknown datatype 'FLOAT'"),
    "BF16": (one(datatype="BF16"), "inputs[0].datatype: BF16 is not supported"),
    "no shape": (one(shape=None), "inputs[0].shape: expected a list of sizes >= 0"),
    "negative size": (one(shape=[-1, 2]), "inputs[0].shape: expected a list of sizes >= 0"),
    "float size": (one(shape=[2.0]), "inputs[0].shape: expected a list of sizes >= 0"),
    "bool size": (one(shape=[True]), "inputs[0].shape: expected a list of sizes >= 0"),
    "shape not a list": (one(shape=2), "inputs[0].shape: expected a list of sizes >= 0"),
    "too many dimensions": (one(shape=[1] * 65), "inputs[0].shape: 65 dimensions"),
    "too large": (one(shape=[0, 2**40, 2**40]), "inputs[0].shape: [0, "),
    "count": (
        one(shape=[2, 2], data=[1, 2, 3, 4, 5, 6]),
        "inputs[0] (X): 6 values for shape [2, 2]",
    ),
    "nested count": (one(data=[[1], [2, 3]]), "inputs[0] (X): 3 values for shape [2]"),
    "data not a list": (one(shape=[], data=3), "inputs[0].data: expected a list"),
    "no data": (
        one(data=None),
        "inputs[0] (X): no values: send data or parameters.binary_data_size",
    ),
    "both": (
        one(parameters={"binary_data_size": 8}),
        "inputs[0] (X): has both data and parameters.binary_data_size",
    ),
    "300 for UINT8": (
        one(datatype="UINT8", data=[1, 300]),
        "inputs[0] (X): data[1] is 300, out of range for UINT8 (0 to 255)",
    ),
    "-1 for UINT64": (
        one(datatype="UINT64", data=[-1, 0]),
        "data[0] is -1, out of range for UINT64",
    ),
    "2**63 for INT64": (one(datatype="INT64", data=[0, 2**63]), "data[1] is 9223372036854775808"),
    "float for INT32": (one(data=[1, 2.5]), "inputs[0] (X): data[1] is 2.5, expected an integer"),
    "bool for INT32": (one(data=[True, 2]), "inputs[0] (X): data[0] is true, expected an integer"),
    "string for FP32": (
        one(datatype="FP32", data=["1", 2]),
        'inputs[0] (X): data[0] is "1", expected a number for FP32',
    ),
    "null for FP64": (one(datatype="FP64", data=[1, None]), "data[1] is null, expected a number"),
    "70000 for FP16": (
        one(datatype="FP16", data=[1, 70000]),
        "inputs[0] (X): data[1] is 70000, out of range for FP16",
    ),
    "1e39 for FP32": (
        one(datatype="FP32", data=[1e39, 0]),
        "data[0] is 1e39, out of range for FP32",
    ),
    "10**400 for FP64": (one(datatype="FP64", data=[0, 10**400]), "data[1] is 1000"),
    "number for BOOL": (one(datatype="BOOL", data=[1, 0]), "data[0] is 1, expected true or false"),
    "number for BYTES": (one(datatype="BYTES", data=["a", 1]), "data[1] is 1, expected a string"),
    "input shared memory": (
        one(parameters={"shared_memory_region": "r", "shared_memory_byte_size": 8}),
        "inputs[0].parameters.shared_memory_region: shared memory is not supported",
    ),
    "input parameters not an object": (
        one(parameters=[1]),
        "inputs[0].parameters: expected an object",
    ),
    "input parameter value a list": (
        one(parameters={"x": [1]}),
        "inputs[0].parameters.x: expected a string, a number or a boolean",
    ),
    "negative binary_data_size": (
        one(data=None, parameters={"binary_data_size": -8}),
        "inputs[0].parameters.binary_data_size: expected a byte count >= 0",
    ),
    "string binary_data_size": (
        one(data=None, parameters={"binary_data_size": "8"}),
        "inputs[0].parameters.binary_data_size: expected a byte count >= 0",
    ),
    "id not a string": ({"id": 5, **one()}, "id: expected a string"),
    "parameters not an object": ({"parameters": "x", **one()}, "parameters: expected an object"),
    "binary_data_output not a bool": (
        {"parameters": {"binary_data_output": 1}, **one()},
        "parameters.binary_data_output: expected true or false",
    ),
    "outputs not a list": ({"outputs": {"name": "Y"}, **one()}, "outputs: expected a list"),
    "output not an object": ({"outputs": ["Y"], **one()}, "outputs[0]: expected an object"),
    "output without a name": ({"outputs": [{}], **one()}, "outputs[0].name: expected a non-empty"),
    "output twice": (
        {"outputs": [{"name": "Y"}, {"name": "Y"}], **one()},
        "outputs[1].name: 'Y' is asked for twice",
    ),
    "classification": (
        {"outputs": [{"name": "Y", "parameters": {"classification": 3}}], **one()},
        "outputs[0].parameters.classification: not supported",
    ),
    "output shared memory": (
        {"outputs": [{"name": "Y", "parameters": {"shared_memory_region": "r"}}], **one()},
        "outputs[0].parameters.shared_memory_region: shared memory is not supported",
    ),
    "binary_data not a bool": (
        {"outputs": [{"name": "Y", "parameters": {"binary_data": "yes"}}], **one()},
        "outputs[0].parameters.binary_data: expected true or false",
    ),
    "binary data without the header": (
        one(data=None, parameters={"binary_data_size": 8}),
        "add up to 8 bytes, the body has 0 after its JSON (no Inference-Header-Content-Length",
    ),
}


@pytest.mark.parametrize(("request_", "message"), REFUSED_JSON.values(), ids=REFUSED_JSON.keys())
def test_refuses_naming_the_field(request_: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_infer(oip(request_), None)
    assert message in caught.value.message
    assert caught.value.http_status == 400


def binary_request(inputs: list[dict[str, Any]], data: bytes) -> tuple[bytes, int]:
    head = oip({"inputs": inputs})
    return head + data, len(head)


def binary_input(datatype: str, shape: list[int], size: int, name: str = "X") -> dict[str, Any]:
    return {
        "name": name,
        "datatype": datatype,
        "shape": shape,
        "parameters": {"binary_data_size": size},
    }


def packed(*elements: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


REFUSED_BINARY = {
    "size for the datatype": (
        [binary_input("FP32", [2, 3], 20)],
        bytes(20),
        "inputs[0] (X): binary_data_size is 20 bytes; shape [2, 3] of FP32 is 24",
    ),
    "fewer bytes than the sizes": (
        [binary_input("FP32", [2], 8), binary_input("INT8", [4], 4, "Y")],
        bytes(10),
        "binary data: the inputs' binary_data_size add up to 12 bytes, the body has 10",
    ),
    "more bytes than the sizes": (
        [binary_input("FP32", [2], 8)],
        bytes(9),
        "add up to 8 bytes, the body has 9 after its JSON",
    ),
    "BYTES: too few values": (
        [binary_input("BYTES", [3], len(packed(b"a", b"b")))],
        packed(b"a", b"b"),
        "inputs[0] (X): 2 values for shape [3]",
    ),
    "BYTES: too many values": (
        [binary_input("BYTES", [1], len(packed(b"a", b"b")))],
        packed(b"a", b"b"),
        "inputs[0] (X): binary_data_size holds more than the 1 values of shape [1]",
    ),
    "BYTES: a length past the end": (
        [binary_input("BYTES", [1], 6)],
        struct.pack("<I", 5) + b"ab",
        "inputs[0] (X): BYTES value 0 of 5 bytes runs past binary_data_size",
    ),
    "BYTES: a length cut off": (
        [binary_input("BYTES", [2], 7)],
        packed(b"a") + b"\x01\x00",
        "inputs[0] (X): BYTES value 1's 4-byte length runs past binary_data_size",
    ),
    "BOOL bytes other than 0 and 1": (
        [binary_input("BOOL", [3], 3)],
        b"\x00\x01\x02",
        "inputs[0] (X): BOOL values in binary are bytes 0 or 1",
    ),
}


@pytest.mark.parametrize(
    ("inputs", "data", "message"), REFUSED_BINARY.values(), ids=REFUSED_BINARY.keys()
)
def test_refuses_binary_data_that_does_not_fit(
    inputs: list[dict[str, Any]], data: bytes, message: str
) -> None:
    body, header_length = binary_request(inputs, data)
    with pytest.raises(InvalidRequest) as caught:
        decode_infer(body, header_length)
    assert message in caught.value.message


def test_reads_binary_bytes_values_exactly() -> None:
    data = packed(b"", b"\xff\x00", b"xyz")
    body, header_length = binary_request([binary_input("BYTES", [3, 1], len(data))], data)
    (got,) = decode_infer(body, header_length).inputs
    assert got.data == [b"", b"\xff\x00", b"xyz"] and got.shape == (3, 1)


def test_refuses_a_header_length_past_the_body() -> None:
    body, _ = triton_body({"X": (sample("FP32"), True)})
    with pytest.raises(InvalidRequest, match=r"Inference-Header-Content-Length: \d+ is more than"):
        decode_infer(body, len(body) + 1)
    with pytest.raises(InvalidRequest, match="Inference-Header-Content-Length"):
        decode_infer(body, -1)


def test_a_wrong_header_length_is_a_json_error() -> None:
    body, json_size = triton_body({"X": (sample("FP32"), True)})
    assert json_size is not None
    with pytest.raises(InvalidJSON, match="the request's JSON is not valid"):
        decode_infer(body, json_size - 1)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "the request's JSON is not valid"),
        (b"\xff", "the request's JSON is not valid"),
        (b"[" * 100_000, "the request's JSON is not valid"),
        (b"[1]", "the request must be a JSON object, got a list"),
        (b"null", "the request must be a JSON object, got null"),
    ],
)
def test_refuses_what_is_not_a_json_object(body: bytes, message: str) -> None:
    with pytest.raises(InvalidJSON, match=message):
        decode_infer(body, None)


def test_ignores_unknown_request_fields() -> None:
    # KServe's client sends model_name in the body.
    body = oip({"model_name": "m", "extra": {"x": 1}, **one()})
    assert decode_infer(body, None).inputs[0].name == "X"


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("0", 0), (" 123 ", 123)])
def test_parse_header_length(value: str | None, expected: int | None) -> None:
    assert parse_header_length(value) == expected


@pytest.mark.parametrize("value", ["", "-1", "1.5", "abc", "١٢"])
def test_parse_header_length_refuses_what_is_not_a_count(value: str) -> None:
    with pytest.raises(InvalidRequest, match="Inference-Header-Content-Length: expected a byte"):
        parse_header_length(value)


# --------------------------------------------------------------------------- compression


@pytest.mark.parametrize(
    ("encoding", "compress"),
    [("gzip", gzip.compress), ("deflate", zlib.compress), ("GZip ", gzip.compress)],
)
def test_decompresses_what_tritonclient_sends(encoding: str, compress: Any) -> None:
    body, json_size = triton_body({"X": (sample("INT16"), True), "S": (sample("BYTES"), True)})

    plain = decompress_body(compress(body), encoding, limit=len(body))

    assert plain == body
    x, s = decode_infer(plain, json_size).inputs
    assert_same("INT16", x.data, sample("INT16"))
    assert_same("BYTES", s.data, sample("BYTES"))


@pytest.mark.parametrize("encoding", [None, "identity"])
def test_identity_is_the_body_itself(encoding: str | None) -> None:
    assert decompress_body(b"abc", encoding, limit=3) == b"abc"
    with pytest.raises(PayloadTooLarge, match="over 2 bytes"):
        decompress_body(b"abc", encoding, limit=2)


def test_gzip_members_one_after_another() -> None:
    assert decompress_body(gzip.compress(b"ab") + gzip.compress(b"cd"), "gzip", limit=4) == b"abcd"


@pytest.mark.parametrize(
    ("encoding", "compress"), [("gzip", gzip.compress), ("deflate", zlib.compress)]
)
def test_a_bomb_is_refused_without_inflating_it(encoding: str, compress: Any) -> None:
    bomb = compress(bytes(50_000_000), 9)  # 50 MB of zeros in about 50 kB
    assert len(bomb) < 100_000

    assert len(decompress_body(compress(bytes(1000)), encoding, limit=1000)) == 1000
    with pytest.raises(PayloadTooLarge, match="decompresses to more than 999 bytes"):
        decompress_body(compress(bytes(1000)), encoding, limit=999)
    with pytest.raises(PayloadTooLarge, match="more than 1048576 bytes"):
        decompress_body(bomb, encoding, limit=1 << 20)


@pytest.mark.parametrize(
    ("body", "encoding", "message"),
    [
        (b"abc", "br", "Content-Encoding: 'br' is not supported; use gzip, deflate or identity"),
        (b"abc", "gzip, identity", "Content-Encoding: 'gzip, identity' is not supported"),
        (b"not gzip", "gzip", "Content-Encoding gzip: the body is not gzip data"),
        (zlib.compress(b"x"), "gzip", "Content-Encoding gzip: the body is not gzip data"),
        (gzip.compress(b"x"), "deflate", "Content-Encoding deflate: the body is not deflate"),
        (gzip.compress(b"hello")[:-4], "gzip", "Content-Encoding gzip: the body's data is cut"),
        (zlib.compress(b"hello")[:-2], "deflate", "Content-Encoding deflate: the body's data is"),
        (zlib.compress(b"x") + b"!", "deflate", "deflate: bytes after the end of the data"),
        (gzip.compress(b"x") + b"!", "gzip", "gzip: bytes after the end of the data"),
    ],
    ids=[
        "br",
        "two encodings",
        "not gzip",
        "zlib as gzip",
        "gzip as deflate",
        "gzip cut short",
        "deflate cut short",
        "deflate trailing bytes",
        "gzip trailing bytes",
    ],
)
def test_refuses_what_does_not_decompress(body: bytes, encoding: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decompress_body(body, encoding, limit=1 << 20)
    assert message in caught.value.message


def test_round_trip_through_msgspec_is_plain_json() -> None:
    # The response's JSON is what any JSON parser reads, msgspec or not.
    output = InferOutput("Y", "FP16", (2,), np.array([0.1, 65504], dtype=np.float16))
    body, _ = encode_infer("m", [(output, False)])
    assert msgspec.json.decode(body) == json.loads(body)
    np.testing.assert_array_equal(
        np.array(json.loads(body)["outputs"][0]["data"], dtype=np.float16), output.data
    )
