"""Wire encodings of MoE routed experts (R3), shared by the engine adapters and the simulator.

- vLLM: base64 of `.npy` bytes (`np.save`), dtype and shape in the header, shape `(tokens, layers, top_k)`.
- SGLang: base64 of raw little-endian int32 with no shape; the reader reshapes with the model's (layers, top_k).

Both cover prompt + output minus the last sampled token (that token was never run through the model).
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np
import numpy.typing as npt

ExpertArray = npt.NDArray[np.unsignedinteger]


class RoutedExpertsFormatError(ValueError):
    """The payload does not decode to a (tokens, layers, top_k) array."""


def smallest_unsigned(array: npt.NDArray[np.integer]) -> ExpertArray:
    """The same values in the smallest unsigned dtype that holds them (expert ids are never negative)."""
    if array.dtype.kind not in "iu":
        raise RoutedExpertsFormatError(f"routed experts must be integers, got dtype {array.dtype}")
    if array.size and int(array.min()) < 0:
        raise RoutedExpertsFormatError("routed experts contain a negative expert id")
    top = int(array.max()) if array.size else 0
    if top > 0xFFFFFFFF:
        raise RoutedExpertsFormatError(f"expert id {top} does not fit 32 bits")
    dtype = np.uint8 if top < 256 else np.uint16 if top < 65536 else np.uint32
    return array.astype(dtype, copy=False)


def encode_npy_b64(experts: npt.NDArray[np.integer]) -> str:
    """vLLM's encoding: base64 of the array saved as .npy."""
    buffer = io.BytesIO()
    np.save(buffer, experts, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_npy_b64(payload: str) -> ExpertArray:
    """Decode vLLM's base64 `.npy` into a (tokens, layers, top_k) unsigned array."""
    try:
        # read_array accepts exactly one .npy (np.load would also open .npz archives) and never unpickles.
        array = np.lib.format.read_array(io.BytesIO(base64.b64decode(payload, validate=True)), allow_pickle=False)
    except (binascii.Error, ValueError, OSError, EOFError) as exc:
        raise RoutedExpertsFormatError(f"routed experts are not a base64 .npy: {exc}") from exc
    if array.ndim != 3:
        raise RoutedExpertsFormatError(f"routed experts must be 3-D (tokens, layers, top_k), got shape {array.shape}")
    return smallest_unsigned(array)


def encode_int32_b64(experts: npt.NDArray[np.integer]) -> str:
    """SGLang's encoding: base64 of raw little-endian int32, shape not sent."""
    if experts.size and (int(experts.min()) < 0 or int(experts.max()) > 0x7FFFFFFF):
        raise RoutedExpertsFormatError("expert ids must be in [0, 2**31) for the int32 encoding")
    return base64.b64encode(np.ascontiguousarray(experts, dtype="<i4").tobytes()).decode("ascii")


def decode_int32_b64(payload: str, num_layers: int, top_k: int) -> ExpertArray:
    """Decode SGLang's raw int32 payload and reshape with the model's (layers, top_k)."""
    try:
        flat = np.frombuffer(base64.b64decode(payload, validate=True), dtype="<i4")
    except (binascii.Error, ValueError) as exc:
        raise RoutedExpertsFormatError(f"routed experts are not base64 int32: {exc}") from exc
    per_token = num_layers * top_k
    if num_layers <= 0 or top_k <= 0 or flat.size % per_token:
        raise RoutedExpertsFormatError(f"{flat.size} int32 values do not reshape to (tokens, {num_layers}, {top_k})")
    return smallest_unsigned(flat.reshape(-1, num_layers, top_k))
