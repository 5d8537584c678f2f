"""Plumbing shared by the gateway benchmarks: child processes, CPU pinning, a loopback client, SSE, stats, tables.

Both benchmarks run everything on 127.0.0.1. The gateway runs as a child process (`rollout-gateway serve
--config <tmp yaml>`) and the simulator replicas as `SimProcess` children, so the load generator in the parent
never shares an event loop, or a GIL, with what it measures: on a 2-core machine an in-process gateway would
time the client's own scheduling lag as much as the gateway's work.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import uvloop
import yaml
from rich.console import Console
from rich.table import Table

# child_pids and pin_process live with the engine launcher (it pins vLLM's EngineCore); the benchmarks use them too.
from backends.launcher import child_pids, pin_process
from backends.sim.server import SimProcess

ADMIN_TOKEN = "bench-admin-token"
ADMIN_HEADERS = {"authorization": f"Bearer {ADMIN_TOKEN}"}

# httpx writes a POST's headers and body in two sends; with Nagle on, the body would wait for the server's
# delayed ACK (~40 ms on Linux) and both paths would carry the same artificial 40 ms. asyncio's transports set
# TCP_NODELAY themselves today; the load generator sets it explicitly so its numbers do not depend on that.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


class BenchmarkError(RuntimeError):
    """The benchmark could not set up or run (a child process failed, a deadline passed)."""


# -- processes --------------------------------------------------------------------------------------------------


def raise_open_file_limit() -> None:
    """Lift the soft fd limit to the hard one; children inherit it (1,000 streams hold 2,000+ sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (a tiny race with other processes; `GatewayProcess` retries)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system, all threads) of a live process, to the nanosecond where the kernel's per-process CPU
    clock can be read, else from /proc in 10 ms ticks (None where neither is there)."""
    if pid is None:
        return None
    with contextlib.suppress(OSError, OverflowError):
        return time.clock_gettime(process_cpu_clock(pid))
    return _proc_cpu_seconds(pid)


def process_cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU clock, as glibc's `clock_getcpuclockid` makes it (Linux: the pid, inverted
    and shifted, tagged as the scheduler's runtime clock of the whole process); Python does not wrap that call. The
    scheduler counts a process's runtime in nanoseconds, so short runs are no longer rounded to /proc's 10 ms ticks."""
    return ((~pid) << 3) | _CPUCLOCK_SCHED


_CPUCLOCK_SCHED = 2


def _proc_cpu_seconds(pid: int) -> float | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which is in parentheses and may hold spaces: utime and stime are the
    # 14th and 15th fields of the line, so the 12th and 13th after "pid (comm) ".
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def is_redis(pid: int) -> bool:
    """Whether a live process is a redis-server (the embedded Redis a gateway starts)."""
    with contextlib.suppress(OSError):
        return "redis-server" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    return False


def pinned(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that pins a child to `cpus` before it executes, so all its threads start there."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def log_tail(log: Path | None, lines: int = 15) -> str:
    """The last `lines` lines of a child's log file, for an error message."""
    if log is None or not log.exists():
        return "(no log)"
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def terminate(process: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """SIGTERM a child that still runs, SIGKILL after `timeout_s`."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def sim_replicas(
    args_per_replica: Sequence[Sequence[str]], cpus: Sequence[set[int] | None] = ()
) -> Iterator[list[SimProcess]]:
    """One simulator replica per argument list, each a child process, the i-th pinned to `cpus[i]` (where given) once
    it listens; all stopped (SIGTERM, bounded) on exit."""
    with contextlib.ExitStack() as stack:
        replicas = []
        for index, args in enumerate(args_per_replica):
            replica = SimProcess([*args, "--log-level", "warning"])
            stack.enter_context(replica)
            if index < len(cpus) and replica.pid is not None:
                pin_process(replica.pid, cpus[index])
            replicas.append(replica)
        yield replicas


def _gateway_command() -> list[str]:
    script = Path(sys.executable).with_name("rollout-gateway")
    if script.exists():
        return [str(script)]
    found = shutil.which("rollout-gateway")
    if found:
        return [found]
    return [sys.executable, "-c", "from rollout_cli import main; main()"]


@dataclass
class GatewayProcess:
    """`rollout-gateway serve` in a child process, configured by a temporary YAML file.

    `replicas` are `replicas:` entries of config.yaml; `settings` are more top-level sections (merged over the
    benchmark defaults). Redis is the embedded server the gateway starts itself (`redis.url: ""`).
    """

    replicas: list[dict[str, Any]]
    settings: dict[str, Any] = field(default_factory=dict)
    startup_timeout_s: float = 60.0
    cpus: set[int] | None = None  # pin the gateway (and so its embedded Redis) to these CPUs
    workers: int = 1  # `serve --workers N`: a supervisor and N gateway processes (`worker_pids`)
    url: str = ""
    process: subprocess.Popen[bytes] | None = None
    _dir: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def cpu_seconds(self) -> float | None:
        return cpu_seconds(self.pid)

    def worker_pids(self) -> list[int]:
        """The gateway processes: the one `serve` process, or the supervisor's workers with `workers > 1`."""
        if self.pid is None:
            return []
        if self.workers == 1:
            return [self.pid]
        return [pid for pid in child_pids(self.pid) if not is_redis(pid)]

    def _config(self, port: int) -> dict[str, Any]:
        config: dict[str, Any] = {
            "server": {"host": "127.0.0.1", "port": port, "admin_token": ADMIN_TOKEN},
            "redis": {"url": ""},
            "replicas": self.replicas,
        }
        for section, values in self.settings.items():
            config[section] = {**config.get(section, {}), **values}
        return config

    def start(self) -> GatewayProcess:
        self._dir = Path(tempfile.mkdtemp(prefix="rg-bench-"))
        try:
            for _ in range(3):  # the free port can be taken before the gateway binds it: try another
                if self._launch(free_port()):
                    return self
            raise BenchmarkError(f"the gateway did not start:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def _launch(self, port: int) -> bool:
        assert self._dir is not None
        config_file = self._dir / "config.yaml"
        config_file.write_text(yaml.safe_dump(self._config(port)))
        command = [*_gateway_command(), "serve", "--config", str(config_file), "--log-level", "warning"]
        if self.workers > 1:
            command += ["--workers", str(self.workers)]
        with (self._dir / "gateway.log").open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pinned(self.cpus))
        self.url = f"http://127.0.0.1:{port}"
        return self._wait_ready()

    def _wait_ready(self) -> bool:
        # A separate process offers no startup event to wait on: poll its health route, as a load balancer
        # would, until every replica serves (bounded by startup_timeout_s).
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    return False
                with contextlib.suppress(httpx.HTTPError):
                    health = client.get(f"{self.url}/health").json()
                    replicas = health["replicas"]
                    if health["status"] == "ok" and replicas["serving"] == replicas["total"] == len(self.replicas):
                        return True
                time.sleep(0.05)
        raise BenchmarkError(f"the gateway was not ready within {self.startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        return log_tail(self._dir / "gateway.log" if self._dir is not None else None, lines)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (graceful: the gateway drains, then stops its embedded Redis), SIGKILL after `timeout_s`."""
        terminate(self.process, timeout_s)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> GatewayProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def sim_replica_entry(url: str, dialect: str) -> dict[str, Any]:
    return {"url": url, "backend": "sim", "dialect": dialect}


# -- HTTP -------------------------------------------------------------------------------------------------------


def loopback_client(max_connections: int, timeout_s: float, verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    """A pooled client whose pool never makes a request wait for a connection below `max_connections`."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY, verify=verify)
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits, transport=transport)


@contextlib.asynccontextmanager
async def agent_clients(count: int, timeout_s: float) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One single-connection client per simulated agent, closed on exit.

    Not one big shared pool: httpcore 1.0's pool does O(connections) work per request, with a socket poll per
    idle connection (`has_expired`) and an O(idle²) cleanup, so 100 requests started at once over 100 idle
    pooled connections took 3.5 s to all be sent here (0.17 s on fresh connections). A shared pool would time
    the load generator; one connection per agent is also what independent agents do.
    """
    ssl_context = httpx.create_ssl_context()  # loading the CA bundle once, not once per client
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for _ in range(count):
            clients.append(await stack.enter_async_context(loopback_client(1, timeout_s, verify=ssl_context)))
        yield clients


def json_post(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Request:
    return client.build_request("POST", url, content=orjson.dumps(body), headers={"content-type": "application/json"})


async def sse_events(response: httpx.Response) -> AsyncIterator[tuple[float, Any]]:
    """(arrival time, decoded event) for each `data:` event; `[DONE]` is skipped.

    Reads the body to its end rather than stopping at `[DONE]`: the end of a chunked body (its zero-length
    chunk) usually arrives in a later read, and a response closed before it cannot go back to the pool, so
    every request would pay a new TCP connection. Splits the raw bytes itself rather than using `aiter_lines`
    (which decodes text first): at 1,000 streams the client's parsing cost is part of every latency it
    reports, so it is kept small. Every event of one network read carries that read's `time.perf_counter()`.
    """
    buffer = b""
    async for chunk in response.aiter_raw():
        now = time.perf_counter()
        buffer += chunk
        while (end := buffer.find(b"\n\n")) >= 0:
            event, buffer = buffer[:end], buffer[end + 2 :]
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                yield now, orjson.loads(event[6:])


# -- statistics and output --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Percentiles:
    p50: float
    p99: float
    max: float
    count: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        if not values:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        p50, p99 = np.percentile(np.asarray(values, dtype=np.float64), [50, 99])
        return cls(float(p50), float(p99), float(max(values)), len(values))


def ms(seconds: float) -> str:
    return "—" if seconds != seconds else f"{seconds * 1000:,.1f}"  # NaN: nothing measured


def make_console() -> Console:
    """A console for the tables: the terminal's width, or 160 columns when the output goes to a file or pipe
    (rich would otherwise wrap the tables to 80)."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def print_table(
    console: Console, title: str, columns: Sequence[str], rows: Sequence[Sequence[str]], note: str = ""
) -> None:
    """A rich table; the first column is left-aligned (labels), the others right-aligned (numbers)."""
    table = Table(title=title, title_justify="left")
    for index, column in enumerate(columns):
        table.add_column(column, justify="left" if index == 0 else "right", no_wrap=index == 0)
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if note:
        console.print(f"[dim]How to read this:[/] {note}")


# Taken when the benchmark starts, before it runs anything: other work on the machine (the load average counts
# runnable processes, 1-minute mean) makes the absolute numbers of a run worth less than its side-by-side ratios.
_LOAD_BEFORE = os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_line() -> str:
    """The context a reader needs to judge absolute numbers."""
    load = "" if _LOAD_BEFORE is None else f", load average {_LOAD_BEFORE:.1f} before the run"
    return f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, loopback only{load}"


def run_benchmark(main_async: Callable[[Any, Console], Awaitable[bool]], options: Any, timeout_s: float) -> int:
    """The shared `main` of the gateway benchmarks: raise the file limit, run, map failures to exit status 1."""
    raise_open_file_limit()
    console = make_console()
    try:
        ok = uvloop.run(main_async(options, console))
    except TimeoutError:
        console.print(f"[red]stopped: the run passed its deadline of {timeout_s:g} s (--timeout)[/]")
        return 1
    except BenchmarkError as exc:
        console.print(f"[red]{exc}[/]")
        return 1
    return 0 if ok else 1
