"""A stand-in for an engine venv's python, for the launcher tests (tests/backends/test_launcher.py).

The launcher runs `PYTHON -m vllm.entrypoints.openai.api_server ARGS` or `PYTHON -m sglang.launch_server ARGS`;
with this script as PYTHON (through a two-line shell wrapper) the server is the project's engine simulator in the
same process, on the host and port the launcher asked for. Only the third-party engine is stood in for: the
launcher, the simulator and the processes are real.

Its own flags (the launch's extra arguments, so they also prove those reach the server):
    --standin-record PATH   write what it was started with (argv, environment, pid, children) as JSON first
    --standin-tree          first build the process tree of a CPU vLLM server: a child named VLLM::EngineCore with a
                            child named VLLM::Worker bound to one CPU
    --standin-exit CODE     start a child, write a fatal line, and exit with CODE without serving
    --standin-hang          never listen
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIALECTS = {"vllm.entrypoints.openai.api_server": "vllm", "sglang.launch_server": "sglang"}
ENV_SEEN = (
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "TMPDIR",
    "HF_HUB_OFFLINE",
    "VLLM_SERVER_DEV_MODE",
    "SGLANG_USE_CPU_ENGINE",
    "VLLM_LOGGING_CONFIG_PATH",
)


def set_process_name(name: str) -> None:
    """What vLLM's processes do (setproctitle): the kernel's name of the process, read from /proc/PID/comm."""
    pr_set_name = 15
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode(), 0, 0, 0)


def child(*role: str) -> tuple[int, str]:
    """A child running this script in `role`: its pid and the line it prints once it is set up."""
    process = subprocess.Popen([sys.executable, __file__, *role], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    return process.pid, process.stdout.readline()


def engine_core() -> None:
    set_process_name("VLLM::EngineCore")
    worker_pid, _ = child("--role", "worker")
    print(f"ready {worker_pid}", flush=True)
    while True:
        signal.pause()


def worker() -> None:
    # The CPU build binds its model worker to one core and leaves the EngineCore unbound.
    os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
    set_process_name("VLLM::Worker_TP0")
    print("ready", flush=True)
    while True:
        signal.pause()


def sgl_kernel_file() -> str | None:
    """Where `import sgl_kernel` finds the package (the launcher's stand-in for SGLang servers), if anywhere."""
    try:
        import sgl_kernel  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(sgl_kernel.__file__)


def main(argv: list[str]) -> None:
    if argv[:2] == ["--role", "core"]:
        return engine_core()
    if argv[:2] == ["--role", "worker"]:
        return worker()
    if argv[0] != "-m" or argv[1] not in DIALECTS:
        sys.exit(f"engine stand-in: not an engine command line: {argv}")
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port")
    parser.add_argument("--standin-record", type=Path)
    parser.add_argument("--standin-tree", action="store_true")
    parser.add_argument("--standin-exit", type=int)
    parser.add_argument("--standin-hang", action="store_true")
    args, _ = parser.parse_known_args(argv[2:])
    children: list[int] = []
    if args.standin_tree:
        core_pid, ready = child("--role", "core")
        children = [core_pid, int(ready.split()[1])]
    if args.standin_exit is not None:
        children.append(subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"]).pid)
    if args.standin_record:
        record = {
            "argv": argv,
            "env": {name: os.environ.get(name) for name in ENV_SEEN},
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "children": children,
            "sgl_kernel": sgl_kernel_file(),
        }
        args.standin_record.write_text(json.dumps(record))
    if args.standin_exit is not None:
        print("engine stand-in: fatal error during startup", file=sys.stderr, flush=True)
        sys.exit(args.standin_exit)
    if args.standin_hang:
        while True:
            signal.pause()
    # The simulator, in this process: the API server's pid stays the one the launcher started.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    dialect = DIALECTS[argv[1]]
    command = [sys.executable, "-m", "backends.sim", "--dialect", dialect, "--host", args.host, "--port", args.port]
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main(sys.argv[1:])
