"""A stand-in for SGLang's kernel package, put on the path of an SGLang server ONLY by the engine launcher
(`backends/launcher.py`: the sglang test tier, `rollout-gateway engine sglang`) on a CPU machine. It is not a kernel,
and the gateway never imports it.

With `SGLANG_USE_CPU_ENGINE=1`, sglang 0.5.23 imports a few names from `sgl_kernel` at import time (for example
`copy_all_layer_kv_cache_cpu`); those exist only in the CPU build of the kernel package, and no CPU build can be
installed from the package registry (the only published wheels need CUDA). This module makes those imports
succeed and nothing else: it registers no `torch.ops.sgl_kernel` operators, so sglang detects no CPU kernel
support and runs its own pure-torch code paths (native RMSNorm/SiluAndMul/MoE, the torch_native attention
backend). Every name it hands out is a function that records the call in $RG_SGL_KERNEL_STUB_LOG and raises;
the sglang tier asserts that this log stays empty, i.e. that no stand-in function ran.
"""

from __future__ import annotations

import os
from typing import Any, NoReturn

__version__ = "0.0.0+rollout-gateway-stand-in"


def _record(name: str) -> None:
    path = os.environ.get("RG_SGL_KERNEL_STUB_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()} {name}\n")


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def stand_in(*args: Any, **kwargs: Any) -> NoReturn:
        _record(name)
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is not available on this machine")

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in
