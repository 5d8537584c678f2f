"""Several gateway processes on one port and one Redis (docs/architecture.md §13): `rollout-gateway serve --workers N`.

One gateway process is one event loop, so one core. To use N cores the supervisor here binds the port, starts the
embedded Redis once (when `redis.url` is empty) and forks N workers. On Linux each worker gets a listening socket
of its own on that port (SO_REUSEPORT), and the kernel spreads new connections over them by a hash of their
addresses: an even split, whatever each worker is doing when a burst of clients connects. (With one socket shared
by all, whichever worker wakes first takes what is queued; agents keep their connections, so a lopsided start stays
lopsided, as `benchmarks/scaling.py` showed.) Elsewhere the
workers share one socket. Nothing else is shared in memory: placement is rendezvous
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
import sys
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from types import FrameType

from gateway.config import Settings
from gateway.embedded_redis import EmbeddedRedis

logger = logging.getLogger(__name__)

__all__ = ["listening_socket", "listening_sockets", "serve_workers"]

# Only Linux balances connections over the sockets of a SO_REUSEPORT group; BSD and macOS give them all to one.
_REUSEPORT_BALANCES = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound, listening TCP socket the workers inherit (IPPROTO_TCP: asyncio then sets TCP_NODELAY on accepts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def listening_sockets(host: str, port: int, count: int) -> Iterator[list[socket.socket]]:
    """`count` sockets on one port, one per worker, where the kernel balances them (see the module docstring);
    otherwise one socket for all. Port 0 picks a free port for the first; the others join it. Closed on exit."""
    with contextlib.ExitStack() as stack:
        if count == 1 or not _REUSEPORT_BALANCES:
            yield [stack.enter_context(listening_socket(host, port))]
            return
        first = stack.enter_context(listening_socket(host, port, reuse_port=True))
        port = first.getsockname()[1]
        yield [first] + [stack.enter_context(listening_socket(host, port, reuse_port=True)) for _ in range(count - 1)]


def _worker(settings: Settings, socks: Sequence[socket.socket], index: int, log_level: str) -> None:
    import uvicorn

    sock = socks[index % len(socks)]
    for other in socks:  # inherited with the fork: only the supervisor and the owner may hold a socket open
        if other is not sock:
            other.close()
    from gateway.app import create_app
    from gateway.server import uvicorn_config

    config = uvicorn_config(
        create_app(settings, server_process=True),
        settings,
        log_level=log_level,
        in_process=False,
    )
    uvicorn.Server(config).run(sockets=[sock])


@contextlib.contextmanager
def _shared_redis(settings: Settings) -> Iterator[Settings]:
    """`settings` whose Redis every worker shares: the configured one, or one embedded server for all."""
    if settings.redis.url:
        yield settings
        return
    with EmbeddedRedis(data_dir=settings.redis.data_dir) as redis:
        redis_config = settings.redis.model_copy(update={"url": redis.local_url})
        yield settings.model_copy(update={"redis": redis_config})


def serve_workers(
    settings: Settings, workers: int, log_level: str = "info", on_redis: Callable[[str], None] | None = None
) -> int:
    """Run `workers` gateway processes until SIGTERM/SIGINT; returns the exit status for the command line.
    `on_redis` gets the URL of the Redis they share (the embedded server's, once it runs)."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    context = multiprocessing.get_context("fork")  # before any event loop or thread exists in this process
    server = settings.server
    with _shared_redis(settings) as shared, listening_sockets(server.host, server.port, workers) as socks:
        if on_redis is not None:
            on_redis(shared.redis.url)
        processes = [
            context.Process(target=_worker, args=(shared, socks, i, log_level), name=f"gateway-{i}", daemon=False)
            for i in range(workers)
        ]
        for process in processes:
            process.start()
        logger.info(
            "serving on http://%s:%d with %d worker processes (pids %s)",
            shared.server.host,
            socks[0].getsockname()[1],
            workers,
            ", ".join(str(p.pid) for p in processes),
        )
        if len(socks) > 1:
            # Each socket now lives in its worker alone: when one worker ends, its socket leaves the port's group
            # and the kernel stops sending new connections there.
            for sock in socks:
                sock.close()
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
