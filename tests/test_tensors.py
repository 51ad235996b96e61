"""The binary tensor frame of ``/v2/infer`` (:mod:`seedance.protocol.tensors`): every datatype
round-trips, the data lies on an 8-byte boundary and is read without a copy, and every
malformed frame is refused saying what is wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from seedance.protocol.errors import InvalidRequest
from seedance.protocol.tensors import (
    DTYPES,
    HeldTensors,
    Tensor,
    decode_tensor,
    encode_tensor,
    tensor_meta,
    token_rows,
)


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (1, 2, 1, 3)])
def test_every_datatype_round_trips(name: str, shape: tuple[int, ...]) -> None:
    dtype = np.dtype(DTYPES[name].numpy)
    values = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    array = (values % 2 == 1) if dtype.kind == "b" else values.astype(dtype)
    frame = encode_tensor(Tensor("r-1", "embedding", array, seq=41))
    assert frame[0] == 0x10 and frame[1] == DTYPES[name].code
    start = struct.unpack_from("<H", frame, 6)[0]
    assert start % 8 == 0 and len(frame) - start == array.nbytes
    back = decode_tensor(frame)
    assert (back.request_id, back.name, back.seq) == ("r-1", "embedding", 41)
    assert back.array.dtype == dtype and back.array.shape == shape
    assert np.array_equal(back.array, array)
    assert tensor_meta(frame) == ("r-1", 41)


def test_the_layout_is_the_documented_one() -> None:
    frame = encode_tensor(Tensor("e1", "x", np.array([[1.5, -2.0]], dtype="<f4")))
    assert frame[:8] == bytes([0x10, 11, 2, 1, 2, 0, 40, 0])  # FP32, 2-D, name 1, id 2, H 40
    assert struct.unpack_from("<q2Q", frame, 8) == (-1, 1, 2)  # seq none, shape [1, 2]
    assert frame[32:35] == b"e1x" and frame[35:40] == bytes(5)
    assert frame[40:] == struct.pack("<2f", 1.5, -2.0)
    assert tensor_meta(frame) == ("e1", None)


def test_decoding_does_not_copy_and_big_endian_input_is_written_little_endian() -> None:
    frame = encode_tensor(Tensor(None, "v", np.arange(4, dtype=">i4")))
    array = decode_tensor(frame).array
    assert array.base is not None and not array.flags.writeable
    assert array.tolist() == [0, 1, 2, 3] and array.dtype == np.dtype("<i4")
    with pytest.raises(ValueError, match="no tensor datatype"):
        encode_tensor(Tensor(None, "c", np.array([1j])))


def _frame(**change: int) -> bytearray:
    frame = bytearray(encode_tensor(Tensor("r", "t", np.zeros(3, dtype="<f4"))))
    offsets = {"dtype": 1, "ndim": 2, "name": 3, "start": 6}
    for field, value in change.items():
        frame[offsets[field]] = value
    return frame


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"\x10\x0b", "16-byte header"),
        (b"\x01\x00" + bytes(14), "must start with 10"),
        (_frame(dtype=13), "unknown datatype code 13"),
        (_frame(dtype=0), "unknown datatype code 0"),
        (_frame(ndim=9), "9 dimensions, at most 8"),
        (_frame(name=0), "lengths do not fit"),
        (_frame(start=12), "lengths do not fit"),
        (_frame(start=200), "lengths do not fit"),
        (_frame()[:-1], "is 12 bytes, the frame carries 11"),
        (_frame() + b"\x00" * 4, "is 12 bytes, the frame carries 16"),
    ],
)
def test_malformed_frames_are_refused(frame: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        decode_tensor(bytes(frame))


def test_held_tensors_wait_for_their_request_within_bounds() -> None:
    held = HeldTensors(max_tensors=2, max_bytes=64)
    ids = Tensor("e1", "input_ids", np.array([[1, 2, 3]], dtype="<i4"))
    held.add(ids)
    with pytest.raises(InvalidRequest, match="sent twice"):
        held.add(ids)
    with pytest.raises(InvalidRequest, match="a request id is required"):
        held.add(Tensor(None, "x", np.zeros(1)))
    with pytest.raises(InvalidRequest, match="at most 2 tensors and 64 bytes"):
        held.add(Tensor("e2", "big", np.zeros(16, dtype="<f8")))
    held.add(Tensor("e2", "small", np.zeros(1, dtype="<f8")))
    with pytest.raises(InvalidRequest, match="at most 2 tensors"):
        held.add(Tensor("e3", "one", np.zeros(1, dtype="<f8")))
    assert set(held.take("e1")) == {"input_ids"} and held.take("e1") == {}
    held.add(Tensor("e3", "one", np.zeros(1, dtype="<f8")))  # room again


def test_token_rows_take_integer_tensors_of_one_or_two_dimensions() -> None:
    assert token_rows(Tensor("r", "ids", np.array([5, 6], dtype="<u2")), "f") == [[5, 6]]
    assert token_rows(Tensor("r", "ids", np.array([[1], [2]], dtype="<i8")), "f") == [[1], [2]]
    with pytest.raises(InvalidRequest, match=r"must hold token ids: integers.*FP32 \[2\]"):
        token_rows(Tensor("r", "ids", np.zeros(2, dtype="<f4")), "input_tensor")
    with pytest.raises(InvalidRequest, match=r"INT32 \[1, 1, 1\]"):
        token_rows(Tensor("r", "ids", np.zeros((1, 1, 1), dtype="<i4")), "input_tensor")
