"""Run simulator replicas: in this process (an asyncio context manager) or as child processes (for crash tests)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI

from backends.sim.common import SimServerSettings
from backends.sim.engine import SimEngine

logger = logging.getLogger(__name__)


def create_app(settings: SimServerSettings) -> FastAPI:
    """The FastAPI app of one simulated replica in the configured dialect."""
    if settings.dialect == "vllm":
        from backends.sim.vllm_app import create_vllm_app

        return create_vllm_app(settings)
    from backends.sim.sglang_app import create_sglang_app

    return create_sglang_app(settings)


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket; port 0 picks a free one. Reuse is on so a restarted replica can take its port back."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only when the listener says TCP;
    # without it every JSON answer (headers, then body) waits ~40 ms for the peer's delayed ACK.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass
class SimReplica:
    """A simulator replica served in this process."""

    url: str
    app: FastAPI
    server: uvicorn.Server
    dialect: str = "vllm"

    @property
    def engine(self) -> SimEngine:
        engine: SimEngine = self.app.state.dialect.engine
        return engine


def _uvicorn_config(app: FastAPI, log_level: str = "warning") -> uvicorn.Config:
    return uvicorn.Config(
        app,
        loop="none",  # run on the caller's loop
        http="httptools",
        lifespan="on",
        log_level=log_level,
        access_log=False,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=2,
    )


@asynccontextmanager
async def serve_in_process(
    settings: SimServerSettings, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[SimReplica]:
    """Serve one replica on the running event loop until the block exits."""
    sock = bind_socket(host, port)
    app = create_app(settings)
    server = uvicorn.Server(_uvicorn_config(app))
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"sim-{settings.dialect}")
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("simulator server stopped during startup")
            await asyncio.sleep(0.01)  # uvicorn exposes no startup event; bounded by the task finishing
        yield SimReplica(f"http://{host}:{sock.getsockname()[1]}", app, server, settings.dialect)
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()


class SimProcess:
    """A simulator replica in a child process (`python -m backends.sim`): it can be SIGKILLed and restarted."""

    def __init__(
        self, args: Sequence[str] = (), *, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 30.0
    ):
        self.args = list(args)
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self) -> SimProcess:
        command = [sys.executable, "-m", "backends.sim", "--host", self.host, "--port", str(self.port), "--allow-crash"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen([*command, *self.args], stdout=subprocess.PIPE, env=env)
        self.port = self._read_port()
        return self

    def _read_port(self) -> int:
        """Read the child's JSON "listening" line, waiting at most `startup_timeout_s` (readline alone can't)."""
        assert self.process is not None and self.process.stdout is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while (remaining := deadline - time.monotonic()) > 0:
                if not selector.select(remaining):
                    continue
                line = self.process.stdout.readline()
                if not line:
                    code = self.process.wait()
                    self._close_pipe()
                    raise RuntimeError(f"simulator process exited with {code} before listening")
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") == "listening":
                        return int(event["port"])
        self.kill()
        raise TimeoutError(f"simulator process did not listen within {self.startup_timeout_s} s")

    def _close_pipe(self) -> None:
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()

    def kill(self) -> None:
        """SIGKILL: connections reset, nothing is cleaned up (a crashed replica)."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
        self._close_pipe()

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipe()

    def restart(self) -> SimProcess:
        """Start again on the same port (after a kill or a stop)."""
        self.stop()
        return self.start()

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
