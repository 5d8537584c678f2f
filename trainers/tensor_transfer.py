"""The trainer's side of a `tensor` weight transfer (SGLang's `/update_weights_from_tensor`): the tensors go inline in
the update call, no process group, no rendezvous.

Each entry of `serialized_named_tensors` is one tensor-parallel rank's list of `(checkpoint name, tensor)` pairs,
pickled by the standard library and base64-encoded: the tensors' bytes travel in the pickle itself (torch's own
tensor pickling), so the engine reads them whatever process sent them. SGLang's own serializer shares tensors through
file descriptors instead, which only a related process (same machine, same multiprocessing authkey, sender alive) can
open. The engine's unpickler is an allow-list that takes exactly what torch's tensor pickling names. Every call sends
`flush_cache: false` and no `weight_version`: the gateway's commit labels the weights, and a flush, which fails while
a pause keeps requests, is the gateway's to decide.
"""

from __future__ import annotations

import base64
import pickle

import httpx
import orjson

from trainers.group_transfer import NamedTensors


def serialize(named: NamedTensors) -> str:
    """One rank's entry: base64 of the pickled `[(name, tensor), ...]`, each tensor a compact CPU copy (a view would
    otherwise carry its whole base storage)."""
    plain = [(name, tensor.detach().to("cpu").contiguous().clone()) for name, tensor in named]
    return base64.b64encode(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")


async def push(http: httpx.AsyncClient, engine_url: str, named: NamedTensors, tp_size: int = 1) -> None:
    """One chunk into one engine (inside the update session the gateway opened): every tensor-parallel rank gets the
    whole tensors and loads its own shard of them, as from a checkpoint."""
    entry = serialize(named)
    body = orjson.dumps({"serialized_named_tensors": [entry] * tp_size, "flush_cache": False})  # hundreds of MB
    headers = {"content-type": "application/json"}
    answer = await http.post(f"{engine_url}/update_weights_from_tensor", content=body, headers=headers)
    if answer.status_code != 200 or answer.json().get("success") is False:
        route = f"{engine_url}/update_weights_from_tensor"
        raise RuntimeError(f"{route} answered {answer.status_code}: {answer.text[:300]}")
