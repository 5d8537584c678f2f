"""Several gateway processes on one port and one Redis (DESIGN §13): `rollout-gateway serve --workers N`.

One gateway process is one event loop, so one core. To use N cores the supervisor here binds the listening socket
once, starts the embedded Redis once (when `redis.url` is empty) and forks N workers that all accept on that
socket; the kernel spreads connections over them. Nothing else is shared in memory: placement is rendezvous
hashing, sessions and trajectories live in Redis, and weight updates are coordinated through Redis (one process
takes the update lock, the others follow), exactly as for gateways on separate hosts.

SIGTERM or SIGINT to the supervisor is passed on to every worker (each shuts down gracefully, as a single
`serve` does); the supervisor waits for them, then stops the embedded Redis. A worker that dies is not restarted:
the supervisor stops the others and exits non-zero, so the process manager in charge (systemd, Kubernetes)
sees the failure.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from types import FrameType

from gateway.config import Settings
from gateway.embedded_redis import EmbeddedRedis

logger = logging.getLogger(__name__)

__all__ = ["listening_socket", "serve_workers"]


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket the workers inherit (IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _worker(settings: Settings, sock: socket.socket, log_level: str) -> None:
    import uvicorn

    from gateway.app import create_app
    from gateway.server import uvicorn_config

    config = uvicorn_config(
        create_app(settings, server_process=True),
        log_level=log_level,
        in_process=False,
        shutdown_timeout_s=settings.server.shutdown_timeout_s,
    )
    uvicorn.Server(config).run(sockets=[sock])


@contextlib.contextmanager
def _shared_redis(settings: Settings) -> Iterator[Settings]:
    """`settings` whose Redis every worker shares: the configured one, or one embedded server for all."""
    if settings.redis.url:
        yield settings
        return
    with EmbeddedRedis(data_dir=settings.redis.data_dir) as redis:
        redis_config = settings.redis.model_copy(update={"url": redis.url})
        yield settings.model_copy(update={"redis": redis_config})


def serve_workers(settings: Settings, workers: int, log_level: str = "info") -> int:
    """Run `workers` gateway processes until SIGTERM/SIGINT; returns the exit status for the command line."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    context = multiprocessing.get_context("fork")  # before any event loop or thread exists in this process
    with _shared_redis(settings) as shared, listening_socket(shared.server.host, shared.server.port) as sock:
        processes = [
            context.Process(target=_worker, args=(shared, sock, log_level), name=f"gateway-{i}", daemon=False)
            for i in range(workers)
        ]
        for process in processes:
            process.start()
        logger.info(
            "serving on http://%s:%d with %d worker processes (pids %s)",
            shared.server.host,
            shared.server.port,
            workers,
            ", ".join(str(p.pid) for p in processes),
        )
        stopping = False

        def stop(signum: int, _: FrameType | None) -> None:
            nonlocal stopping
            stopping = True
            for process in processes:
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGTERM)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            failed = _supervise(processes, lambda: stopping)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 1 if failed else 0


def _supervise(processes: Sequence[multiprocessing.process.BaseProcess], stopping: Callable[[], bool]) -> bool:
    """Wait until every worker exits; if one dies on its own, stop the rest. True if a worker failed."""
    failed = False
    while any(p.is_alive() for p in processes):
        wait([p.sentinel for p in processes if p.is_alive()], timeout=1.0)
        dead = [p for p in processes if not p.is_alive() and p.exitcode != 0]
        if dead and not stopping() and not failed:
            failed = True
            logger.error("worker %s exited with %s; stopping the others", dead[0].name, dead[0].exitcode)
            for process in processes:
                if process.is_alive() and process.pid is not None:
                    os.kill(process.pid, signal.SIGTERM)
    for process in processes:
        process.join()
    # uvicorn re-raises the signal it shut down on, so a worker we stopped ends with -SIGTERM.
    return failed or any(p.exitcode not in (0, -signal.SIGTERM) for p in processes)
