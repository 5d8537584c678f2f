"""Property tests of the routed-experts wire encodings (vLLM `.npy` base64, SGLang raw int32 base64)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from backends.routed_experts import (
    RoutedExpertsFormatError,
    decode_int32_b64,
    decode_npy_b64,
    encode_int32_b64,
    encode_npy_b64,
    smallest_unsigned,
)

B64_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=")


def expected_dtype(array: npt.NDArray[np.integer]) -> np.dtype[np.unsignedinteger]:
    top = int(array.max()) if array.size else 0
    return np.dtype(np.uint8 if top < 256 else np.uint16 if top < 65536 else np.uint32)


@st.composite
def expert_arrays(draw: st.DrawFn, max_id: int = 2**31 - 1) -> npt.NDArray[np.integer]:
    """(tokens, layers, top_k) arrays of non-negative ids, 0 tokens included, in the dtypes engines send."""
    shape = (draw(st.integers(0, 24)), draw(st.integers(1, 6)), draw(st.integers(1, 4)))
    dtypes: list[type[np.integer[Any]]] = [np.uint8, np.uint16, np.int32, np.int64, np.uint32]
    dtype = draw(st.sampled_from(dtypes))
    top = min(max_id, int(np.iinfo(dtype).max))
    # Ids cluster near the dtype boundaries so the smallest-dtype choice is exercised on both sides.
    ceiling = draw(st.sampled_from([v for v in (7, 255, 256, 65535, 65536, top) if v <= top]))
    return draw(hnp.arrays(dtype, shape, elements=st.integers(0, ceiling)))


# -- vLLM: base64 .npy ------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(expert_arrays(max_id=2**32 - 1))
def test_npy_round_trip(array: npt.NDArray[np.integer]) -> None:
    decoded = decode_npy_b64(encode_npy_b64(array))
    assert decoded.shape == array.shape
    assert decoded.dtype == expected_dtype(array)
    assert np.array_equal(decoded.astype(np.int64), array.astype(np.int64))


def test_npy_keeps_big_endian_and_fortran_order_values() -> None:
    array = np.arange(24, dtype=">i4").reshape(2, 3, 4)
    assert np.array_equal(decode_npy_b64(encode_npy_b64(array)), array)
    fortran = np.asfortranarray(np.arange(300, 324, dtype=np.int64).reshape(2, 3, 4))
    decoded = decode_npy_b64(encode_npy_b64(fortran))
    assert decoded.dtype == np.uint16 and np.array_equal(decoded, fortran)


@pytest.mark.parametrize("shape", [(), (5,), (4, 2), (1, 2, 2, 1)])
def test_npy_wrong_rank_is_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(RoutedExpertsFormatError, match="3-D"):
        decode_npy_b64(encode_npy_b64(np.zeros(shape, dtype=np.int32)))


def test_npy_negative_id_is_rejected() -> None:
    array = np.zeros((3, 2, 2), dtype=np.int32)
    array[2, 1, 0] = -1
    with pytest.raises(RoutedExpertsFormatError, match="negative"):
        decode_npy_b64(encode_npy_b64(array))


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=300))
def test_npy_garbage_bytes_are_rejected(raw: bytes) -> None:
    assume(not raw.startswith(b"PK"))
    with pytest.raises(RoutedExpertsFormatError):
        decode_npy_b64(base64.b64encode(raw).decode("ascii"))


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_npy_garbage_base64_is_rejected(text: str) -> None:
    assume(not set(text) <= B64_ALPHABET)
    with pytest.raises(RoutedExpertsFormatError, match="base64"):
        decode_npy_b64(text)


def test_npy_truncated_payload_is_rejected() -> None:
    raw = base64.b64decode(encode_npy_b64(np.zeros((3, 2, 2), dtype=np.uint8)))
    for cut in (6, 20, len(raw) - 3):
        with pytest.raises(RoutedExpertsFormatError):
            decode_npy_b64(base64.b64encode(raw[:cut]).decode("ascii"))


def test_npy_pickled_object_array_is_rejected() -> None:
    buffer = io.BytesIO()
    np.save(buffer, np.array([[[object()]]], dtype=object), allow_pickle=True)
    with pytest.raises(RoutedExpertsFormatError):
        decode_npy_b64(base64.b64encode(buffer.getvalue()).decode("ascii"))


def test_npy_empty_payload_is_rejected() -> None:
    with pytest.raises(RoutedExpertsFormatError):
        decode_npy_b64("")


def test_npy_npz_archive_is_rejected() -> None:
    buffer = io.BytesIO()
    np.savez(buffer, experts=np.zeros((1, 2, 2), dtype=np.uint8))
    with pytest.raises(RoutedExpertsFormatError):
        decode_npy_b64(base64.b64encode(buffer.getvalue()).decode("ascii"))


@pytest.mark.parametrize("array", [np.full((1, 2, 2), 1.5), np.full((1, 2, 2), np.nan), np.ones((1, 2, 2), bool)])
def test_npy_non_integer_dtype_is_rejected(array: npt.NDArray[Any]) -> None:
    with pytest.raises(RoutedExpertsFormatError):
        decode_npy_b64(encode_npy_b64(array))


def test_npy_ids_beyond_uint32_are_rejected() -> None:
    with pytest.raises(RoutedExpertsFormatError):
        decode_npy_b64(encode_npy_b64(np.full((1, 1, 1), 2**32, dtype=np.uint64)))


# -- SGLang: base64 raw little-endian int32 ---------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(expert_arrays())
def test_int32_round_trip(array: npt.NDArray[np.integer]) -> None:
    tokens, layers, top_k = array.shape
    payload = encode_int32_b64(array)
    assert len(base64.b64decode(payload)) == 4 * array.size  # raw int32: no header, no shape
    decoded = decode_int32_b64(payload, layers, top_k)
    assert decoded.shape == (tokens, layers, top_k)
    assert decoded.dtype == expected_dtype(array)
    assert np.array_equal(decoded.astype(np.int64), array.astype(np.int64))


def test_int32_is_little_endian() -> None:
    payload = encode_int32_b64(np.array([[[1, 256]]], dtype=np.int64))
    assert base64.b64decode(payload) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert decode_int32_b64(base64.b64encode(b"\x07\x00\x00\x00").decode(), 1, 1).tolist() == [[[7]]]


def test_int32_encode_rejects_ids_beyond_int32() -> None:
    with pytest.raises(RoutedExpertsFormatError):
        encode_int32_b64(np.full((1, 1, 1), 2**33, dtype=np.int64))


def test_int32_zero_tokens() -> None:
    decoded = decode_int32_b64("", 3, 2)
    assert decoded.shape == (0, 3, 2) and decoded.dtype == np.uint8


@settings(max_examples=100, deadline=None)
@given(
    layers=st.integers(1, 6),
    top_k=st.integers(1, 4),
    tokens=st.integers(0, 10),
    extra=st.integers(1, 23),
)
def test_int32_count_not_divisible_is_rejected(layers: int, top_k: int, tokens: int, extra: int) -> None:
    per_token = layers * top_k
    assume(extra % per_token)
    payload = encode_int32_b64(np.zeros(tokens * per_token + extra, dtype=np.int32))
    with pytest.raises(RoutedExpertsFormatError, match="reshape"):
        decode_int32_b64(payload, layers, top_k)


@pytest.mark.parametrize(
    ("layers", "top_k"),
    [
        (0, 2),
        (2, 0),
        pytest.param(
            -1,
            -2,
        ),
    ],
)
def test_int32_nonpositive_geometry_is_rejected(layers: int, top_k: int) -> None:
    with pytest.raises(RoutedExpertsFormatError):
        decode_int32_b64(encode_int32_b64(np.zeros(4, dtype=np.int32)), layers, top_k)


@pytest.mark.parametrize("raw", [b"\x01", b"\x01\x02\x03", b"\x01\x02\x03\x04\x05"])
def test_int32_partial_value_is_rejected(raw: bytes) -> None:
    with pytest.raises(RoutedExpertsFormatError):
        decode_int32_b64(base64.b64encode(raw).decode("ascii"), 1, 1)


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_int32_garbage_base64_is_rejected(text: str) -> None:
    assume(not set(text) <= B64_ALPHABET)
    with pytest.raises(RoutedExpertsFormatError, match="base64"):
        decode_int32_b64(text, 2, 2)


@settings(max_examples=100, deadline=None)
@given(expert_arrays(max_id=1000), st.data())
def test_int32_negative_id_is_rejected(array: npt.NDArray[np.integer], data: st.DataObject) -> None:
    assume(array.size)
    signed = array.astype(np.int32)
    index = data.draw(st.integers(0, signed.size - 1), label="index")
    signed.flat[index] = data.draw(st.integers(-(2**31), -1), label="value")
    _, layers, top_k = signed.shape
    payload = base64.b64encode(signed.astype("<i4").tobytes()).decode()  # what a broken engine might send
    with pytest.raises(RoutedExpertsFormatError, match="negative"):
        decode_int32_b64(payload, layers, top_k)
    with pytest.raises(RoutedExpertsFormatError):
        encode_int32_b64(signed)  # and we never produce it
    with pytest.raises(RoutedExpertsFormatError, match="negative"):
        decode_npy_b64(encode_npy_b64(signed))


# -- smallest_unsigned ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("top", "dtype"),
    [(0, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.uint32), (2**32 - 1, np.uint32)],
)
def test_smallest_unsigned_boundaries(top: int, dtype: type[np.unsignedinteger]) -> None:
    array = np.array([[[0, top]]], dtype=np.int64)
    out = smallest_unsigned(array)
    assert out.dtype == dtype and out.tolist() == [[[0, top]]]


def test_smallest_unsigned_empty_is_uint8() -> None:
    assert smallest_unsigned(np.zeros((0, 2, 2), dtype=np.int64)).dtype == np.uint8
