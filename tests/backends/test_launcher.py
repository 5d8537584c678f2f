"""The engine launcher (`backends/launcher.py`) and `rollout-gateway engine`, without the engines installed.

The command lines and environments are compared with the recipe the engine tiers run. The lifecycle (start,
/health, pinning, stopping the process group, a server that dies or never answers) runs real processes: the
engine's python is `tests/engine_standin.py`, which serves the launcher's command line with the project's engine
simulator and can build vLLM's CPU process tree (an EngineCore with a worker bound to one CPU)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import selectors
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from backends.launcher import (
    ENGINE_KINDS,
    RECEIVED_PROMPT_LOG_IDS,
    SGL_KERNEL_STUB_DIR,
    EngineLaunch,
    child_pids,
    default_python,
    engines_dir,
    free_port,
    pin_engine_core_beside_its_worker,
    pin_process,
    resolve_model,
    start_engine,
    vllm_logging_config,
    vllm_logging_config_text,
)
from gateway.errors import EngineLaunchError, EngineNotInstalled
from tests import REPO
from tests.cli_helpers import cli_child

STANDIN = REPO / "tests" / "engine_standin.py"
TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two CPUs to move between")


@pytest.fixture
def standin(tmp_path: Path) -> Path:
    """An engine "python": a wrapper that execs the stand-in, so the launcher's pid is the server's."""
    python = tmp_path / "engine-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDIN}" "$@"\n')
    python.chmod(0o755)
    return python


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """RG_ENGINE_MODELS with a `dense` model folder in it (only its config.json: the stand-in loads nothing)."""
    folder = tmp_path / "models"
    (folder / "dense").mkdir(parents=True)
    (folder / "dense" / "config.json").write_text("{}")
    monkeypatch.setenv("RG_ENGINE_MODELS", str(folder))
    return folder


def gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether the process has exited (within `timeout_s`): its pidfd turns readable at exit, child or not."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


# -- command lines and environments --------------------------------------------------------------------------------


def test_vllm_command_is_the_cpu_recipe(tmp_path: Path) -> None:
    launch = EngineLaunch("vllm", Path("/venv/bin/python"), Path("/m/dense"), 8123, extra_args=("--max-num-seqs", "4"))
    assert launch.command() == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m/dense",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-model-len",
        "4096",
        "--dtype",
        "float32",
        "--enable-prompt-tokens-details",
        "--enable-scale-out",
        "--stream-interval",
        "8",
        "--seed",
        "0",
        "--max-num-seqs",  # extra arguments last: where a flag repeats, the engine takes the later value
        "4",
    ]
    assert launch.url == "http://127.0.0.1:8123"
    routed = EngineLaunch("vllm", Path("/p"), Path("/m"), 1, dtype="bfloat16", routed_experts=True)
    assert routed.command()[-3:] == ["--seed", "0", "--enable-return-routed-experts"]
    assert routed.command()[routed.command().index("--dtype") + 1] == "bfloat16"


def test_vllm_env(tmp_path: Path) -> None:
    cache, work = tmp_path / "cache", tmp_path / "work"
    launch = EngineLaunch("vllm", Path("/p"), Path("/m"), 1, cache=cache)
    env = launch.env(work, base={"PYTHONPATH": "/project", "VIRTUAL_ENV": "/project/.venv", "HOME": "/home/x"})
    assert "PYTHONPATH" not in env and "VIRTUAL_ENV" not in env  # the project's paths stay out of the engine
    assert env["HOME"] == "/home/x"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # the pause, resume, weight and cache routes
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == str(work)
    short = tmp_path / "s"  # the sockets' own short folder, as `start_engine` makes one
    assert launch.env(work, base={}, sockets=short)["VLLM_RPC_BASE_PATH"] == str(short)
    assert env["VLLM_CACHE_ROOT"] == str(cache / "compile" / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "compile" / "inductor-vllm")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "VLLM_USE_V2_MODEL_RUNNER" not in env and "SGLANG_USE_CPU_ENGINE" not in env
    routed = EngineLaunch("vllm", Path("/p"), Path("/m"), 1, routed_experts=True, cache=cache)
    assert routed.env(work, base={})["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_sglang_command_and_env_with_the_kernel_stand_in(tmp_path: Path) -> None:
    launch = EngineLaunch("sglang", Path("/p"), Path("/m/dense"), 9, max_model_len=2048, cache=tmp_path)
    command = launch.command()
    assert command[:5] == ["/p", "-m", "sglang.launch_server", "--model-path", "/m/dense"]
    for flag, value in [
        ("--device", "cpu"),
        ("--attention-backend", "torch_native"),
        ("--dtype", "float32"),
        ("--context-length", "2048"),
        ("--port", "9"),
        ("--random-seed", "0"),
        ("--stream-interval", "8"),
    ]:
        assert command[command.index(flag) + 1] == value
    assert "--enable-metrics" in command
    env = launch.env(tmp_path / "work", base={"PYTHONPATH": "/project"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert env["PYTHONPATH"] == str(SGL_KERNEL_STUB_DIR)  # only the stand-in, not the project
    assert env["RG_SGL_KERNEL_STUB_LOG"] == str(tmp_path / "work" / "sgl_kernel_stub_calls.log")
    assert not any(name.startswith("VLLM_") for name in env if name not in os.environ)
    stub = SGL_KERNEL_STUB_DIR / "sgl_kernel" / "__init__.py"
    assert "It is not a kernel" in stub.read_text()


def test_logging_received_prompts_is_opt_in(tmp_path: Path) -> None:
    """Off by default (users, the demo); on, vLLM logs requests with its request logger alone at DEBUG (a logging
    config that keeps vLLM's own handler at INFO), SGLang logs them as JSON with up to 2,048 ids of each list."""
    for kind in ENGINE_KINDS:
        plain = EngineLaunch(kind, Path("/p"), Path("/m"), 1)
        assert not {"--enable-log-requests", "--log-requests"} & set(plain.command())
        assert "VLLM_LOGGING_CONFIG_PATH" not in plain.env(tmp_path, base={})
    vllm = EngineLaunch("vllm", Path("/p"), Path("/m"), 1, log_received_prompts=True)
    assert vllm.command()[-3:] == ["--enable-log-requests", "--max-log-len", str(RECEIVED_PROMPT_LOG_IDS)]
    assert vllm.env(tmp_path, base={})["VLLM_LOGGING_CONFIG_PATH"] == str(vllm_logging_config(tmp_path))
    config = json.loads(vllm_logging_config_text())
    assert config["loggers"] == {
        "vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False},
        "vllm.entrypoints.serve.utils.request_logger": {
            "handlers": ["vllm_requests"],
            "level": "DEBUG",
            "propagate": False,
        },
    }
    assert {name: handler["level"] for name, handler in config["handlers"].items()} == {
        "vllm": "INFO",
        "vllm_requests": "DEBUG",
    }
    sglang = EngineLaunch("sglang", Path("/p"), Path("/m"), 1, log_received_prompts=True)
    assert sglang.command()[-5:] == ["--log-requests", "--log-requests-level", "2", "--log-requests-format", "json"]


def test_the_kernel_stand_in_and_the_gloo_plugin_are_package_data() -> None:
    """A non-editable install carries the stand-in and the vLLM gloo plugin: pyproject's package data of `backends`
    names every file of theirs."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["backends"]
    backends_dir = SGL_KERNEL_STUB_DIR.parent
    shipped = {path for pattern in patterns for path in backends_dir.glob(pattern)}
    assert SGL_KERNEL_STUB_DIR / "sgl_kernel" / "__init__.py" in shipped
    plugin = backends_dir / "vllm-gloo-plugin"
    assert {plugin / "pyproject.toml", *plugin.glob("rg_vllm_gloo/*.py")} <= shipped
    assert backends_dir == REPO / "backends"


def test_wildcard_hosts_are_reached_on_loopback() -> None:
    assert EngineLaunch("vllm", Path("/p"), Path("/m"), 5, host="0.0.0.0").url == "http://127.0.0.1:5"
    assert EngineLaunch("vllm", Path("/p"), Path("/m"), 5, host="::").url == "http://[::1]:5"
    assert EngineLaunch("vllm", Path("/p"), Path("/m"), 5, host="10.0.0.2").url == "http://10.0.0.2:5"


# -- where engines and models are found -----------------------------------------------------------------------------


def test_default_python_and_its_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RG_SGLANG_PYTHON", raising=False)
    assert default_python("sglang") == REPO / ".engines" / "sglang-venv" / "bin" / "python"
    assert engines_dir() == REPO / ".engines"
    monkeypatch.setenv("RG_VLLM_PYTHON", "/opt/vllm/bin/python")
    assert default_python("vllm") == Path("/opt/vllm/bin/python")


def test_model_names_resolve_under_the_models_folder(models: Path, tmp_path: Path) -> None:
    assert resolve_model("dense") == (models / "dense").resolve()
    assert resolve_model(models / "dense") == (models / "dense").resolve()  # a folder is taken as it is
    elsewhere = tmp_path / "checkpoints" / "step-3"
    elsewhere.mkdir(parents=True)
    assert resolve_model(str(elsewhere)) == elsewhere.resolve()


def test_a_missing_tiny_model_says_how_to_build_it(models: Path) -> None:
    with pytest.raises(EngineNotInstalled) as caught:
        resolve_model("moe")
    assert "scripts/engines/setup.sh" in str(caught.value) and str(models) in str(caught.value)
    with pytest.raises(EngineLaunchError) as not_there:
        resolve_model("/no/such/model")
    assert not isinstance(not_there.value, EngineNotInstalled)  # a wrong path, not a missing setup


def test_a_missing_venv_says_how_to_install_it(tmp_path: Path) -> None:
    launch = EngineLaunch("vllm", tmp_path / "nowhere" / "bin" / "python", tmp_path, free_port())
    with pytest.raises(EngineNotInstalled) as caught, start_engine(launch, tmp_path / "work"):
        pytest.fail("started without a python")
    message = str(caught.value)
    assert "scripts/engines/setup.sh" in message and str(launch.python) in message and "RG_VLLM_PYTHON" in message


# -- the lifecycle, with real processes ------------------------------------------------------------------------------


def test_start_waits_for_health_and_stops_the_process_group(standin: Path, models: Path, tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    launch = EngineLaunch("vllm", standin, models / "dense", free_port(), extra_args=("--standin-record", str(record)))
    with start_engine(launch, tmp_path / "work", startup_timeout_s=60) as engine:
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
        assert engine.log == tmp_path / "work" / "vllm-server.log" and engine.log.exists()
        assert engine.stub_calls is None
        started = json.loads(record.read_text())
        assert started["argv"] == launch.command()[1:]  # the command line reached the server as built
        assert started["pid"] == started["pgid"] == engine.pid != os.getpgid(0)  # a process group of its own
        assert started["env"]["VLLM_SERVER_DEV_MODE"] == "1" and started["env"]["PYTHONPATH"] is None
        assert started["env"]["TMPDIR"] == str(tmp_path / "work")
        assert started["sgl_kernel"] is None
        assert started["env"]["VLLM_LOGGING_CONFIG_PATH"] is None  # received prompts are logged only when asked
        process = engine.process
    assert process.returncode is not None and gone(process.pid)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{launch.url}/health", timeout=2)


def test_sglang_server_finds_the_kernel_stand_in(standin: Path, models: Path, tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    extra = ("--standin-record", str(record))
    launch = EngineLaunch("sglang", standin, models / "dense", free_port(), extra_args=extra)
    with start_engine(launch, tmp_path / "work", startup_timeout_s=60) as engine:
        assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
        assert engine.stub_calls == tmp_path / "work" / "sgl_kernel_stub_calls.log"
    started = json.loads(record.read_text())
    assert started["sgl_kernel"] == str(SGL_KERNEL_STUB_DIR / "sgl_kernel" / "__init__.py")
    assert started["env"]["SGLANG_USE_CPU_ENGINE"] == "1"


def test_a_vllm_server_that_logs_received_prompts_finds_its_logging_config(
    standin: Path, models: Path, tmp_path: Path
) -> None:
    record, work = tmp_path / "record.json", tmp_path / "work"
    extra = ("--standin-record", str(record))
    launch = EngineLaunch("vllm", standin, models / "dense", free_port(), log_received_prompts=True, extra_args=extra)
    with start_engine(launch, work, startup_timeout_s=60):
        started = json.loads(record.read_text())
    assert started["env"]["VLLM_LOGGING_CONFIG_PATH"] == str(vllm_logging_config(work))
    assert vllm_logging_config(work).read_text() == vllm_logging_config_text()  # written before the server started


@TWO_CPUS
def test_the_engine_core_is_pinned_beside_its_worker(standin: Path, models: Path, tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    extra = ("--standin-tree", "--standin-record", str(record))
    launch = EngineLaunch("vllm", standin, models / "dense", free_port(), extra_args=extra)
    all_cpus = os.sched_getaffinity(0)
    with start_engine(launch, tmp_path / "work", startup_timeout_s=60, pin=False) as engine:
        core, worker = json.loads(record.read_text())["children"]
        assert child_pids(engine.pid) == [core] and child_pids(core) == [worker]
        assert os.sched_getaffinity(worker) == {max(all_cpus)}
        assert os.sched_getaffinity(core) == all_cpus  # as the CPU build leaves it: free to spin on any core
        assert pin_engine_core_beside_its_worker(engine.pid) == [core]
        assert os.sched_getaffinity(core) == {max(all_cpus)}
    assert gone(core) and gone(worker)  # the whole group stopped, not only the API server

    with start_engine(launch, tmp_path / "work-2", startup_timeout_s=60) as engine:  # pin=True, the default
        core, worker = json.loads(record.read_text())["children"]
        assert os.sched_getaffinity(core) == os.sched_getaffinity(worker) == {max(all_cpus)}


@TWO_CPUS
def test_pin_process_moves_a_live_child() -> None:
    """On a real tree: a python parent whose child waits for input."""
    parent_code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'input()'], stdin=subprocess.PIPE)\n"
        "print(child.pid, flush=True)\n"
        "child.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    try:
        child = int(parent.stdout.readline())
        assert child_pids(parent.pid) == [child]
        target = {min(os.sched_getaffinity(0))}
        pin_process(child, target)
        assert os.sched_getaffinity(child) == target
        assert os.sched_getaffinity(parent.pid) == os.sched_getaffinity(0)  # only the one named
        pin_process(child, None)  # None: left alone
        assert os.sched_getaffinity(child) == target
    finally:
        parent.kill()  # the child reads EOF from the closed pipe and exits
        parent.wait()
        parent.stdout.close()
    assert child_pids(parent.pid) == []


def test_exit_during_startup_is_an_error_with_the_log(standin: Path, models: Path, tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    extra = ("--standin-exit", "3", "--standin-record", str(record))
    launch = EngineLaunch("vllm", standin, models / "dense", free_port(), extra_args=extra)
    with pytest.raises(EngineLaunchError) as caught, start_engine(launch, tmp_path / "work", startup_timeout_s=60):
        pytest.fail("an engine that exited was reported healthy")
    message = str(caught.value)
    assert "exited with 3 during startup" in message and "fatal error during startup" in message
    assert caught.value.log == tmp_path / "work" / "vllm-server.log"
    (orphan,) = json.loads(record.read_text())["children"]
    assert gone(orphan)  # the server's leftover child went with its group


def test_no_health_in_time_is_an_error_and_stops_the_server(standin: Path, models: Path, tmp_path: Path) -> None:
    record = tmp_path / "record.json"
    extra = ("--standin-hang", "--standin-record", str(record))
    launch = EngineLaunch("sglang", standin, models / "dense", free_port(), extra_args=extra)
    with (
        pytest.raises(EngineLaunchError, match="not healthy after 2 s"),
        start_engine(launch, tmp_path / "work", startup_timeout_s=2),
    ):
        pytest.fail("an engine that never listened was reported healthy")
    assert gone(json.loads(record.read_text())["pid"])


# -- rollout-gateway engine ------------------------------------------------------------------------------------------


def engine_cli(*args: str, env: dict[str, str]) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    return cli_child("engine", *args, env=env, stdout=subprocess.PIPE)


def ready_url(process: subprocess.Popen[str], timeout_s: float = 60.0) -> str:
    """The URL `rollout-gateway engine` prints on stdout once the engine is healthy."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        while (remaining := deadline - time.monotonic()) > 0:
            if selector.select(remaining):
                line = process.stdout.readline()
                assert line, f"exited with {process.wait()}: {process.stderr.read() if process.stderr else ''}"
                if found := re.search(r"at (http://\S+)", line):
                    return found.group(1)
    raise AssertionError("no URL printed")


def cli_env(models: Path, tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "RG_ENGINE_MODELS": str(models), "RG_ENGINE_CACHE": str(tmp_path / "cache")}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_cli_serves_in_the_foreground_until_a_signal(
    stop: signal.Signals, standin: Path, models: Path, tmp_path: Path
) -> None:
    record = tmp_path / "record.json"
    args = ("vllm", "--model", "dense", "--python", str(standin), "--port", "0", "--", "--standin-tree")
    with engine_cli(*args, "--standin-record", str(record), env=cli_env(models, tmp_path)) as process:
        url = ready_url(process)
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        started = json.loads(record.read_text())
        assert started["argv"][started["argv"].index("--model") + 1] == str(models / "dense")
        port = int(url.rsplit(":", 1)[1])
        assert (tmp_path / "cache" / "logs" / f"vllm-{port}.log").exists()
        process.send_signal(stop)
        assert process.wait(timeout=60) == 0
        assert "vllm stopped" in (process.stderr.read() if process.stderr else "")
    assert all(gone(pid) for pid in [started["pid"], *started["children"]])


def test_cli_without_the_engine_installed(models: Path, tmp_path: Path) -> None:
    env = cli_env(models, tmp_path)
    missing = tmp_path / "no-venv" / "bin" / "python"
    with engine_cli("sglang", "--model", "dense", "--python", str(missing), env=env) as process:
        assert process.wait(timeout=60) == 2
        assert process.stderr is not None and "scripts/engines/setup.sh" in process.stderr.read()
    with engine_cli("vllm", "--model", "moe", "--python", sys.executable, env=env) as process:
        assert process.wait(timeout=60) == 2  # no `moe` in the models folder
        assert process.stderr is not None and "scripts/engines/setup.sh" in process.stderr.read()
    with engine_cli("tgi", "--model", "dense", env=env) as process:
        assert process.wait(timeout=60) == 2


def test_cli_reports_an_engine_that_dies_during_startup(standin: Path, models: Path, tmp_path: Path) -> None:
    args = ("vllm", "--model", "dense", "--python", str(standin), "--port", "0", "--", "--standin-exit", "5")
    with engine_cli(*args, env=cli_env(models, tmp_path)) as process:
        assert process.wait(timeout=60) == 1
        stderr = process.stderr.read() if process.stderr else ""
        assert "exited with 5 during startup" in stderr and "fatal error during startup" in stderr
