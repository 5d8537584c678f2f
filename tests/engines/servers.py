"""Start (or find) one real engine server for a test session: vLLM or SGLang, started by the engine launcher
(`backends/launcher.py`) from the venvs and tiny models that scripts/engines/setup.sh prepared (.engines/), or an
already running server named by environment variables. What is pytest's here: skipping or failing when the setup
is missing, and the fixture's shape.

Environment (all optional):
    RG_ENGINE_CACHE        the machine-local cache setup.sh uses (compile caches go under compile/)
    RG_VLLM_PYTHON         the python of the vLLM venv      (default .engines/vllm-venv/bin/python)
    RG_SGLANG_PYTHON       the python of the SGLang venv    (default .engines/sglang-venv/bin/python)
    RG_ENGINE_MODELS       the folder with dense/, dense_v2/, moe/, moe_v2/ (default .engines/models)
    RG_VLLM_URL, RG_SGLANG_URL   use this running server instead of starting one (GPU recipe); it must serve
                           RG_ENGINE_MODEL (default dense) and read RG_ENGINE_MODELS from the same filesystem
    RG_VLLM_WEIGHT_TRANSFER      the --weight-transfer-config backend of that running vLLM server (nccl on a GPU)
    RG_ENGINE_MODEL        which model the tier serves (dense | moe; default dense)
    RG_ENGINE_ROUTED_EXPERTS=1   the server captures routed experts (GPU recipe; not possible on CPU)
    RG_ENGINE_STARTUP_TIMEOUT_S  how long a started server has to answer /health (default 240)
    CI / RG_ENGINES_REQUIRED  when set, a missing engine setup fails the tier instead of skipping it
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from backends.launcher import (
    STARTUP_TIMEOUT_S,
    EngineKind,
    EngineLaunch,
    default_python,
    free_port,
    models_dir,
    start_engine,
)

STARTUP_TIMEOUT = float(os.environ.get("RG_ENGINE_STARTUP_TIMEOUT_S", STARTUP_TIMEOUT_S))


@dataclass(frozen=True)
class EngineServer:
    """A running engine: where it listens, what it serves, where its log is (None for an external server), and
    whether that log has the prompt ids of every request received (`tests.engines.received`)."""

    kind: EngineKind
    url: str
    models: Path
    model: str
    routed_experts: bool
    log: Path | None
    stub_calls: Path | None = None
    logs_received_prompts: bool = False
    weight_transfer: str | None = None  # vLLM: its --weight-transfer-config backend (the tier starts it with gloo)
    process_group: int | None = None  # a server started here: its process group (the launcher starts it in its own)

    @property
    def model_path(self) -> Path:
        return self.models / self.model

    @property
    def second_checkpoint(self) -> str:
        """The served architecture with other weights (`dense_v2` or `moe_v2`), for weight updates."""
        return str(self.models / f"{self.model}_v2")


def _required() -> bool:
    return any(os.environ.get(name, "").lower() not in ("", "0", "false") for name in ("CI", "RG_ENGINES_REQUIRED"))


def unavailable(why: str) -> None:
    """Skip the tier (a developer without the engines), or fail it where the setup is required (CI)."""
    message = f"{why} (run scripts/engines/setup.sh; see docs/engines.md)"
    if _required():
        pytest.fail(f"engine tier required here (CI or RG_ENGINES_REQUIRED) but: {message}", pytrace=False)
    pytest.skip(message)


def served_model() -> str:
    return os.environ.get("RG_ENGINE_MODEL", "dense")


@contextlib.contextmanager
def engine_server(kind: EngineKind, tmp: Path, port: int | None = None, max_loras: int = 0) -> Iterator[EngineServer]:
    """The session's engine server: an external one (RG_<KIND>_URL), or one started here (on `port`, or a free
    one) and stopped at the end; `max_loras`: with LoRA adapters loaded at run time (an external one: as started)."""
    models, model = models_dir(), served_model()
    routed = os.environ.get("RG_ENGINE_ROUTED_EXPERTS", "") == "1"
    external = os.environ.get(f"RG_{kind.upper()}_URL")
    if external:
        # Its --weight-transfer-config backend, where it has one (scripts/gpu_check.sh starts vLLM with nccl).
        transfer = os.environ.get(f"RG_{kind.upper()}_WEIGHT_TRANSFER") or None
        yield EngineServer(kind, external.rstrip("/"), models, model, routed, None, weight_transfer=transfer)
        return
    python = default_python(kind)
    if not python.exists():
        unavailable(f"no {kind} venv at {python}")
    if not (models / model / "config.json").exists() or not (models / f"{model}_v2" / "config.json").exists():
        unavailable(f"no tiny models in {models}")
    # Routed-expert capture is not asked of a server started here: the CPU builds cannot (docs/engines.md).
    # vLLM takes in-memory weight transfers over gloo (the project's plugin, which setup.sh installs in its venv).
    transfer = "gloo" if kind == "vllm" else None
    extra = ("--weight-transfer-config", orjson.dumps({"backend": transfer}).decode()) if transfer else ()
    launch = EngineLaunch(
        kind,
        python,
        models / model,
        port or free_port(),
        log_received_prompts=True,
        max_loras=max_loras,
        extra_args=extra,
    )
    started = time.monotonic()
    with start_engine(launch, tmp, startup_timeout_s=STARTUP_TIMEOUT) as engine:
        print(f"\n{kind} server up in {time.monotonic() - started:.1f} s ({engine.url}, log {engine.log})")
        yield EngineServer(
            kind, engine.url, models, model, routed, engine.log, engine.stub_calls, True, transfer, engine.process.pid
        )
