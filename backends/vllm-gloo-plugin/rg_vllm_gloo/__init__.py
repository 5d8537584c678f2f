"""The gloo weight transfer for vLLM on CPU, registered from vLLM's `vllm.general_plugins` entry point.

vLLM loads general plugins in every one of its processes (API server, engine core, each worker) before a worker
loads its model, so `register` runs several times a server and must be cheap and idempotent: it names the engine
class by module path (imported only where a worker creates the engine) and lets a second registration pass.
"""

from __future__ import annotations

BACKEND = "gloo"


def register() -> None:
    """Register `GlooWeightTransferEngine` as the weight-transfer backend "gloo" (once per process)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "rg_vllm_gloo.engine", "GlooWeightTransferEngine")
    except ValueError:  # registered already in this process
        pass
