"""Many simulator replicas in a few processes: `SimFleet` starts `hosts` child processes, each serving `per_host`
replicas on its one event loop (`backends.sim.server.serve_in_process`, what the tests use in-process).

A replica is an engine the gateway routes to: its own port, engine, prefix cache, weights and pause state. One
process per replica (`SimProcess`) costs an interpreter each (~60 MiB, and a core's share of idle wake-ups); 64 of
them would crowd a small machine before the gateway is loaded. Sixteen replicas on one loop cost one interpreter,
and with a token delay each replica's decode steps are timer wake-ups, so a host serves many light replicas.

    python -m benchmarks.sim_fleet --count 16 -- --dialect vllm --token-delay 0.01   # prints {"urls": [...]}
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import uvloop

from backends.sim.cli import build_parser as sim_parser
from backends.sim.cli import settings_from_args
from backends.sim.common import SimServerSettings
from backends.sim.server import serve_in_process

REPO_ROOT = Path(__file__).resolve().parents[1]


async def serve(settings: SimServerSettings, count: int) -> None:
    """Serve `count` replicas until killed; print one JSON line with their URLs once all listen."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [(await stack.enter_async_context(serve_in_process(settings))).url for _ in range(count)]
        print(json.dumps({"event": "listening", "urls": urls}), flush=True)
        await asyncio.Event().wait()  # until SIGKILL: the replicas hold no state worth a graceful stop


class SimFleet:
    """`hosts` × `per_host` simulator replicas, each host a child process (`python -m benchmarks.sim_fleet`).

    `urls` lists every replica, `pids` every host process (a host's CPU is its replicas' together). Stopped with
    SIGKILL on exit: a simulator keeps nothing, and its replicas' servers would each catch SIGTERM.
    """

    def __init__(self, hosts: int, per_host: int, sim_args: Sequence[str], startup_timeout_s: float = 60.0) -> None:
        if hosts < 1 or per_host < 1:
            raise ValueError("a fleet needs at least one host and one replica per host")
        self.hosts = hosts
        self.per_host = per_host
        self.sim_args = list(sim_args)
        self.startup_timeout_s = startup_timeout_s
        self.processes: list[subprocess.Popen[bytes]] = []
        self.urls: list[str] = []

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def start(self) -> Self:
        command = [sys.executable, "-m", "benchmarks.sim_fleet", "--count", str(self.per_host), "--", *self.sim_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        try:
            for _ in range(self.hosts):  # all start at once; their imports overlap
                self.processes.append(subprocess.Popen(command, stdout=subprocess.PIPE, cwd=REPO_ROOT, env=env))
            for process in self.processes:
                self.urls += self._read_urls(process)
        except BaseException:
            self.stop()
            raise
        return self

    def _read_urls(self, process: subprocess.Popen[bytes]) -> list[str]:
        assert process.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while (remaining := deadline - time.monotonic()) > 0:
                if not selector.select(remaining):
                    continue
                line = process.stdout.readline()
                if not line:
                    raise RuntimeError(f"a simulator host exited with {process.wait()} before listening")
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == "listening":
                        return list(event["urls"])
        raise TimeoutError(f"a simulator host did not listen within {self.startup_timeout_s:g} s")

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()
        self.processes = []

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sim_fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=16, help="replicas in this process (16)")
    parser.add_argument("sim_args", nargs=argparse.REMAINDER, help="after --: `rollout-gateway sim` options")
    args = parser.parse_args(argv)
    sim_args = args.sim_args[1:] if args.sim_args[:1] == ["--"] else args.sim_args
    if any(arg == "--port" or arg.startswith("--port=") for arg in sim_args):
        parser.error("every replica takes a free port of its own: no --port")
    settings = settings_from_args(sim_parser().parse_args(sim_args))
    uvloop.run(serve(settings, args.count))
    return 0


if __name__ == "__main__":
    sys.exit(main())
