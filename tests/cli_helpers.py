"""Helpers for tests that run the `rollout-gateway` command as child processes."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

CLI = [sys.executable, "-c", "from rollout_cli import main; main()"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_health(process: subprocess.Popen[str], url: str, timeout_s: float = 120) -> httpx.Response:
    """Poll a `serve` child until /health answers (bounded; the process gives no other signal)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return httpx.get(f"{url}/health", timeout=1)
        except httpx.TransportError:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "serve did not come up"
            time.sleep(0.1)


@contextlib.contextmanager
def cli_child(
    *args: str, env: dict[str, str] | None = None, stdout: int | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`rollout-gateway ARGS` as a child process (stderr piped, stdout as asked), killed if the test leaves it
    running."""
    process = subprocess.Popen([*CLI, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, env=env)
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pipe in (process.stdout, process.stderr):
            if pipe:
                pipe.close()


def serving(*args: str, env: dict[str, str] | None = None) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """`rollout-gateway serve ARGS` as a child process (stderr piped)."""
    return cli_child("serve", *args, env=env)
