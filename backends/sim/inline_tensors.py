"""SGLang's inline tensors (`/update_weights_from_tensor`), read as the engine reads them: each entry of
`serialized_named_tensors` is one tensor-parallel rank's base64 pickle of `[(name, tensor), ...]`, and a rank reads
its own entry only (the simulator is one rank: entry 0).

The pickle is opened with an allow-list, as SGLang's does: the names torch's own tensor pickling uses (the tensor's
rebuild, its storage as `torch.save` bytes, read back with `torch.load(weights_only=True)`) and nothing else, so a
body cannot run code here. torch is imported when such a call comes (the project's `trainer` extra); a simulator
without it refuses the call, saying so.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Sequence
from typing import Any

from backends.sim.transfer import PARAMETER, TransferError, check_names

_ALLOWED = {("torch._utils", "_rebuild_tensor_v2"), ("collections", "OrderedDict")}
_STORAGE = ("torch.storage", "_load_from_bytes")  # a storage as torch.save bytes: read with torch.load


class _TensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _STORAGE:
            return _storage
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is no part of a pickled tensor")


def _storage(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def decode_inline(serialized: Sequence[str]) -> str | None:
    """The identity rank 0's entry carries (its `weights` tensor: uint8, the identity's UTF-8); None where it names
    no tensor."""
    if not serialized:
        raise TransferError("serialized_named_tensors is empty: it needs an entry per tensor-parallel rank")
    try:
        import torch
    except ImportError as exc:
        raise TransferError("the simulator reads inline tensors with torch (the project's `trainer` extra)") from exc
    try:
        named = _TensorUnpickler(io.BytesIO(base64.b64decode(serialized[0], validate=True))).load()
    except (binascii.Error, pickle.UnpicklingError, EOFError, ValueError, TypeError, RuntimeError) as exc:
        raise TransferError(f"serialized_named_tensors[0] is no base64 pickle of named tensors ({exc})") from exc
    if not isinstance(named, list) or not all(
        isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], torch.Tensor)
        for pair in named
    ):
        raise TransferError("serialized_named_tensors[0] must hold a list of (name, tensor) pairs")
    check_names([name for name, _ in named])
    identity: str | None = None
    for _, tensor in named:
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise TransferError(f"the simulated {PARAMETER!r} is a 1-D uint8 tensor, not {tensor.dtype} {tensor.shape}")
        identity = bytes(tensor.tolist()).decode("utf-8", "replace")
    return identity
