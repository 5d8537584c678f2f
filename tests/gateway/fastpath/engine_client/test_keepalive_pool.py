"""`gateway.fastpath.engine_client.KeepAlivePool` over real sockets: raw servers on 127.0.0.1 that answer with exactly
the bytes a test needs (framings, interim answers, cut answers, silence), and the engine simulator through the
adapters."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.base import ReplicaSpec, SamplingParams, Timeouts
from backends.errors import BackendProtocolError, BackendRejected, BackendTimeout, BackendUnavailable
from backends.http_client import ReplicaClient, decode_latest, post_for_whole_answer, request, sse_batches
from backends.vllm import VllmBackend
from gateway.fastpath.engine_client import KeepAlivePool
from tests.conftest import SimFactory
from tests.scripted_server import Answer, Seen, scripted_server, sse_body
from tests.sim_helpers import wait_for

OK = b'{"ok": true}'


@dataclass
class Request:
    target: bytes
    headers: dict[bytes, bytes]
    body: bytes


@dataclass
class RawServer:
    """Each connection runs `serve(connection)`; `requests` and `connections` record what came in."""

    url: str = ""
    connections: int = 0
    requests: list[Request] = field(default_factory=list)
    closed_by_client: asyncio.Event = field(default_factory=asyncio.Event)


class Connection:
    def __init__(self, server: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.reader = reader
        self.writer = writer

    async def read_request(self) -> Request | None:
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return None
        line, *lines = head[:-4].split(b"\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in lines)}
        body = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        request = Request(line.split(b" ")[1], headers, body)
        self.server.requests.append(request)
        return request

    async def answer(self, raw: bytes) -> None:
        self.writer.write(raw)
        await self.writer.drain()

    async def wait_for_close(self) -> None:
        if await self.reader.read() == b"":
            self.server.closed_by_client.set()


def ok(body: bytes = OK, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


async def silent(connection: Connection) -> None:
    """Read one request and never answer it: the connection stays open until the client closes it."""
    await connection.read_request()
    await connection.wait_for_close()


async def answer_each(connection: Connection) -> None:
    while await connection.read_request() is not None:
        await connection.answer(ok())


@contextlib.asynccontextmanager
async def raw_server(
    serve: Callable[[Connection], Awaitable[None]], tls: ssl.SSLContext | None = None
) -> AsyncIterator[RawServer]:
    state = RawServer()
    handlers: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await serve(Connection(state, reader, writer))
        finally:
            handlers.discard(task)
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls is not None else "http"
    state.url = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield state
    finally:
        for task in list(handlers):
            task.cancel()
        server.close()
        await server.wait_closed()


def pool_for(url: str, limit: int = 8, read_timeout_s: float = 10.0, **kwargs: Any) -> KeepAlivePool:
    return KeepAlivePool(url, limit, connect_timeout_s=5.0, pool_timeout_s=5.0, read_timeout_s=read_timeout_s, **kwargs)


async def test_sequential_calls_share_one_connection_and_send_a_well_formed_request() -> None:
    async with raw_server(answer_each) as server:
        pool = pool_for(server.url)
        for i in range(20):
            assert await pool.post("/generate", b'{"i": %d}' % i) == (200, OK)
        await pool.aclose()
    assert pool.opened == 1 and server.connections == 1
    assert [orjson.loads(r.body)["i"] for r in server.requests] == list(range(20))
    first = server.requests[0]
    assert first.target == b"/generate"
    assert first.headers[b"content-type"] == b"application/json"
    assert first.headers[b"host"] == server.url.removeprefix("http://").encode()


async def test_a_path_in_the_url_prefixes_every_request() -> None:
    async with raw_server(answer_each) as server:
        pool = pool_for(server.url + "/engine/")
        await pool.post("/v1/completions", b"{}")
        await pool.aclose()
    assert server.requests[0].target == b"/engine/v1/completions"


async def test_chunked_and_interim_answers_are_read_whole() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
        await connection.answer(b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n4\r\n{"a"\r\n')
        await connection.answer(b"4\r\n: 1}\r\n0\r\n\r\n")
        await answer_each(connection)

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        assert await pool.post("/x", b"{}") == (200, b'{"a": 1}')
        assert await pool.post("/x", b"{}") == (200, OK)  # the connection stayed usable
        await pool.aclose()
    assert server.connections == 1


async def test_an_answer_ended_by_the_close_is_read_and_its_connection_not_reused() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + OK)

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        assert await pool.post("/x", b"{}") == (200, OK)
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert pool.opened == 2 and server.connections == 2


async def test_connection_close_in_the_answer_is_honoured() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(ok(extra=b"connection: close\r\n"))
        await connection.wait_for_close()

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        await pool.post("/x", b"{}")
        await pool.post("/x", b"{}")
        await pool.aclose()
    assert pool.opened == 2


async def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(ok())  # kept alive as far as the head says, then closed (the server's idle timeout)

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        await pool.post("/x", b"{}")
        await wait_for(lambda: all(c.lost for c in pool._idle), what="the close noticed")
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert pool.opened == 2


async def test_connections_idle_past_the_expiry_are_not_reused() -> None:
    async with raw_server(answer_each) as server:
        pool = pool_for(server.url, idle_expiry_s=0.0)
        for _ in range(3):
            await pool.post("/x", b"{}")
        assert pool.open_connections == 0  # each one closed when it came back
        await pool.aclose()
    assert pool.opened == 3


async def test_a_cut_answer_fails_and_the_next_call_gets_a_fresh_connection() -> None:
    calls = 0

    async def serve(connection: Connection) -> None:
        nonlocal calls
        while await connection.read_request() is not None:
            calls += 1
            if calls == 1:
                await connection.answer(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"partial')
                return
            await connection.answer(ok())

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        with pytest.raises(ConnectionResetError, match="before its answer ended"):
            await pool.post("/x", b"{}")
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert server.connections == 2


async def test_an_answer_that_is_not_http_fails_as_a_value_error() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await connection.wait_for_close()

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        with pytest.raises(ValueError, match="not valid HTTP"):
            await pool.post("/x", b"{}")
        await asyncio.wait_for(server.closed_by_client.wait(), 10)
        assert pool.open_connections == 0
        await pool.aclose()


async def test_a_second_answer_nobody_asked_for_retires_the_connection() -> None:
    async def serve(connection: Connection) -> None:
        while await connection.read_request() is not None:
            await connection.answer(ok() + ok())

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        assert await pool.post("/x", b"{}") == (200, OK)
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert server.connections == 2


async def test_no_answer_within_the_read_timeout_fails_and_closes_the_connection() -> None:
    async with raw_server(silent) as server:
        pool = pool_for(server.url, read_timeout_s=0.2)
        with pytest.raises(TimeoutError, match="read timeout"):
            await pool.post("/x", b"{}")
        await asyncio.wait_for(server.closed_by_client.wait(), 10)  # the engine sees its client leave
        assert pool.open_connections == 0
        await pool.aclose()


async def test_the_read_timeout_counts_from_each_request_on_a_reused_connection() -> None:
    """The connection's one timer was armed by the first request; a later one gets its own full read timeout."""
    answered = 0

    async def serve(connection: Connection) -> None:
        nonlocal answered
        while await connection.read_request() is not None:
            if answered:
                await asyncio.sleep(0.25)  # past the first request's deadline, within this one's
            answered += 1
            await connection.answer(ok())

    async with raw_server(serve) as server:
        pool = pool_for(server.url, read_timeout_s=0.4)
        await pool.post("/x", b"{}")
        await asyncio.sleep(0.3)
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert server.connections == 1


async def test_a_deadline_sooner_than_the_armed_timer_is_kept_on_a_reused_connection() -> None:
    """The first request armed the connection's timer for its read timeout (10 s); the next one brings a deadline
    of its own 0.3 s away (the request's deadline, `post(..., deadline)`), which must not wait for that timer."""
    answered = 0

    async def serve(connection: Connection) -> None:
        nonlocal answered
        while await connection.read_request() is not None:
            answered += 1
            if answered == 1:
                await connection.answer(ok())
            # the second request gets no answer

    async with raw_server(serve) as server:
        pool = pool_for(server.url, read_timeout_s=10.0)
        assert await pool.post("/x", b"{}") == (200, OK)
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.post("/x", b"{}", deadline=started + 0.3), 5)
        assert loop.time() - started < 3  # at its own deadline, not the 10 s the first request armed
        await pool.aclose()
    assert server.connections == 1


async def test_a_cancelled_caller_closes_its_connection() -> None:
    async with raw_server(silent) as server:
        pool = pool_for(server.url)
        task = asyncio.create_task(pool.post("/x", b"{}"))
        await wait_for(lambda: len(server.requests) == 1, what="the request sent")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.closed_by_client.wait(), 10)
        assert pool.open_connections == 0
        await pool.aclose()


async def test_callers_beyond_the_limit_wait_for_a_connection() -> None:
    release = asyncio.Event()

    async def serve(connection: Connection) -> None:
        while await connection.read_request() is not None:
            await release.wait()
            await connection.answer(ok())

    async with raw_server(serve) as server:
        pool = pool_for(server.url, limit=2)
        tasks = [asyncio.create_task(pool.post("/x", b"{}")) for _ in range(6)]
        await wait_for(lambda: len(server.requests) == 2, what="two requests in flight")
        await asyncio.sleep(0.05)  # room for a third, were the limit not kept
        assert len(server.requests) == 2 and pool.open_connections == 2
        release.set()
        assert await asyncio.gather(*tasks) == [(200, OK)] * 6
        await pool.aclose()
    assert pool.opened == 2 and server.connections == 2


async def test_the_limit_holds_against_callers_that_ask_again_at_once() -> None:
    """A caller whose request ended asks again in the same pass of the loop: the connection it gave back went to the
    caller waiting first, so the new request waits instead of taking it (and the one let in opening another)."""
    async with raw_server(answer_each) as server:
        pool = pool_for(server.url, limit=2)

        async def caller() -> None:
            for _ in range(5):
                assert await pool.post("/x", b"{}") == (200, OK)
                assert pool.open_connections <= 2

        await asyncio.gather(*(caller() for _ in range(20)))
        await pool.aclose()
    assert len(server.requests) == 100
    assert pool.opened == 2 and server.connections == 2


@pytest.mark.parametrize("reusable", [True, False])
async def test_a_caller_cancelled_once_let_in_gives_its_turn_back(reusable: bool) -> None:
    """Let in (a connection handed over, or room for a new one) and cancelled before it ran: what it got goes back,
    and nothing is counted twice."""
    async with raw_server(answer_each) as server:
        pool = pool_for(server.url, limit=1)
        first = await pool.acquire()
        waiting = asyncio.create_task(pool.acquire())
        await wait_for(lambda: len(pool._waiters) == 1, what="a caller waiting")
        if not reusable:
            first._close()
        pool.release(first)  # lets the waiting caller in...
        waiting.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.open_connections == (1 if reusable else 0)
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert pool.opened == (1 if reusable else 2)


async def test_a_caller_waiting_past_the_pool_timeout_fails() -> None:
    async with raw_server(silent) as server:
        pool = KeepAlivePool(server.url, 1, connect_timeout_s=5, pool_timeout_s=0.1, read_timeout_s=10)
        first = asyncio.create_task(pool.post("/x", b"{}"))
        await wait_for(lambda: len(server.requests) == 1, what="the first request in flight")
        with pytest.raises(TimeoutError, match="no connection free"):
            await pool.post("/x", b"{}")
        await pool.aclose()
        with pytest.raises(ConnectionResetError, match="pool was closed"):
            await first


async def test_closing_fails_waiting_and_later_calls() -> None:
    async with raw_server(silent) as server:
        pool = pool_for(server.url, limit=1)
        in_flight = asyncio.create_task(pool.post("/x", b"{}"))
        await wait_for(lambda: len(server.requests) == 1, what="the request in flight")
        queued = asyncio.create_task(pool.post("/x", b"{}"))
        await wait_for(lambda: len(pool._waiters) == 1, what="a caller queued")
        await pool.aclose()
        with pytest.raises(ConnectionResetError):
            await in_flight
        with pytest.raises(ConnectionError, match="closed"):
            await queued
        with pytest.raises(ConnectionError, match="closed"):
            await pool.post("/x", b"{}")
        await asyncio.wait_for(server.closed_by_client.wait(), 10)


async def test_a_refused_connection_is_a_connection_error() -> None:
    async with raw_server(answer_each) as server:
        url = server.url
    pool = pool_for(url)
    with pytest.raises(ConnectionError):
        await pool.post("/x", b"{}")
    assert pool.open_connections == 0


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (made with the openssl command) and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed: no certificate to serve https with")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        + ["-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_an_https_replica_is_served_over_a_verified_connection(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))

    async def serve(connection: Connection) -> None:
        while (request := await connection.read_request()) is not None:
            streamed = request.headers.get(b"accept") == b"text/event-stream"
            await connection.answer(chunked_head() + chunk(b"data: 1\n\n") + b"0\r\n\r\n" if streamed else ok())

    async with raw_server(serve, tls=serving) as server:
        pool = pool_for(server.url, tls=trusting)
        assert await pool.post("/x", b"{}") == (200, OK)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read_all() == b"data: 1\n\n"
        await pool.aclose()
        assert pool.opened == 1

        untrusting = pool_for(server.url)  # the system's certificates: a self-signed one is refused
        with pytest.raises(ssl.SSLCertVerificationError):
            await untrusting.post("/x", b"{}")
        await untrusting.aclose()


# -- through the adapters: the errors they raise, and the simulator ---------------------------------------------


def spec_for(url: str, **timeouts: float) -> ReplicaSpec:
    return ReplicaSpec(id="r0", url=url, timeouts=Timeouts(**timeouts))


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (Answer(400, b'{"error": {"message": "bad prompt"}}'), BackendRejected, "bad prompt"),
        (Answer(503, b"busy"), BackendUnavailable, "503"),
        (Answer(200, b"{not json"), BackendProtocolError, "unexpected response"),
    ],
)
async def test_generation_pool_raise_the_backend_errors(answer: Answer, error: type[Exception], match: str) -> None:
    async with scripted_server(lambda _: answer) as server:
        client = ReplicaClient(spec_for(server.url))
        with pytest.raises(error, match=match):
            await post_for_whole_answer(client, "r0", "/generate", b"{}")
        await client.aclose()


async def test_whole_answer_failures_are_backend_errors() -> None:
    async with raw_server(silent) as server:
        client = ReplicaClient(spec_for(server.url, read=0.2))
        with pytest.raises(BackendTimeout, match="r0"):
            await post_for_whole_answer(client, "r0", "/generate", b"{}")
        await client.aclose()
        with pytest.raises(BackendUnavailable, match="closed"):
            await post_for_whole_answer(client, "r0", "/generate", b"{}")
    client = ReplicaClient(spec_for(server.url))
    with pytest.raises(BackendUnavailable, match="r0"):  # nothing listens there any more
        await post_for_whole_answer(client, "r0", "/generate", b"{}")
    await client.aclose()


@pytest.mark.parametrize(("keepalive", "connections"), [(0.1, 4), (30.0, 2)])
async def test_both_clients_give_up_connections_idle_past_the_keepalive_setting(
    keepalive: float, connections: int
) -> None:
    """`Timeouts.keepalive` bounds reuse for generation requests and control calls alike: after a longer pause each
    opens a connection of its own; within it each reuses its own."""
    async with raw_server(answer_each) as server:
        client = ReplicaClient(spec_for(server.url, keepalive=keepalive))
        for _ in range(2):
            assert await post_for_whole_answer(client, "r0", "/generate", b"{}") == {"ok": True}
            assert (await request(client, "r0", "GET", "/health")).status == 200
            await asyncio.sleep(0.3)
        await client.aclose()
    assert server.connections == connections


async def test_streams_and_calls_of_aiohttp_take_the_path_prefix_too() -> None:
    def answer(seen: Seen) -> Answer:
        return Answer(200, sse_body({"x": 1}) if seen.path.endswith("stream") else OK)

    async with scripted_server(answer) as server:
        client = ReplicaClient(spec_for(server.url + "/engine"))
        await request(client, "r0", "GET", "/health")
        await post_for_whole_answer(client, "r0", "/whole", b"{}")
        async with contextlib.aclosing(sse_batches(client, "r0", "/stream", b"{}")) as batches:
            assert [event async for batch in batches for event in batch] == [{"x": 1}]
        await client.aclose()
    assert [seen.path for seen in server.seen] == ["/engine/health", "/engine/whole", "/engine/stream"]


async def test_the_simulator_serves_generation_pool_on_one_kept_alive_connection(make_sim: SimFactory) -> None:
    sim = await make_sim("vllm")
    backend = VllmBackend(ReplicaSpec(id="r0", url=sim.url, generation_transport=KeepAlivePool))
    try:
        for i in range(10):
            sampling = SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True)
            chunks = [c async for c in backend.generate([1, 2, 3], sampling, f"whole-{i}", stream=False)]
            assert len(chunks) == 1 and len(chunks[0].token_ids) == 4 + i and chunks[0].finish_reason == "length"
        assert backend._client.generation_pool.opened == 1
        assert sim.engine.counters["requests_whole"] == 10
    finally:
        await backend.aclose()


def event(n: int, **extra: Any) -> bytes:
    """A cumulative event: every output id so far."""
    return b"data: " + orjson.dumps({"output_ids": list(range(n)), **extra}) + b"\n\n"


@pytest.mark.parametrize(
    ("buffer", "kept", "done", "error"),
    [
        (event(1) + event(2) + event(3) + b"data: {", [3], False, None),  # the last complete event; the rest stays
        (event(1) + event(2) + b"data: [DONE]\n\n", [2], True, None),  # the end is kept with it
        (event(1), [1], False, None),  # nothing to skip
        (event(1) + b'data: {"error": {"message": "boom", "code": 503}}\n\n' + event(3), [1], False, (503, "boom")),
        (event(1) + event(2) + b'data: {"error": {"message": "boom"}}\n\n', [1, 2], False, (500, "boom")),
        (event(1) + b"data: [DONE]\n\n" + event(3), [1], True, None),  # nothing after the end
        (event(1, text='say "error"') + event(2), [2], False, None),  # a quoted word in a text is escaped: skipped
        (event(1, status="error") + event(2), [1, 2], False, None),  # could be an error: all decoded
    ],
)
def test_decode_latest_decodes_only_the_last_event_where_nothing_is_lost(
    buffer: bytes, kept: list[int], done: bool, error: tuple[int, str] | None
) -> None:
    rest, batch, ended, failure = decode_latest(buffer)
    assert rest == (b"data: {" if buffer.endswith(b"{") else b"")
    assert [len(payload["output_ids"]) for payload in batch] == kept
    assert (ended, failure) == (done, error)


@pytest.mark.parametrize("latest", [False, True])
async def test_sse_batches_yield_only_the_latest_event_of_a_read_while_asked(latest: bool) -> None:
    body = event(1) + event(2) + event(3) + b"data: [DONE]\n\n"
    async with scripted_server(lambda _: Answer(200, body, "text/event-stream")) as server:
        client = ReplicaClient(spec_for(server.url))
        async with contextlib.aclosing(sse_batches(client, "r0", "/generate", b"{}", lambda: latest)) as batches:
            counts = [len(payload["output_ids"]) async for batch in batches for payload in batch]
        await client.aclose()
    assert counts == ([3] if latest else [1, 2, 3])


# -- streamed answers --------------------------------------------------------------------------------------------


def chunked_head(extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n%s\r\n" % extra


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def one_event_then_silent(connection: Connection) -> None:
    """Read one request, stream one event of its answer, and send nothing more until the client closes."""
    await connection.read_request()
    await connection.answer(chunked_head() + chunk(b"data: 1\n\n"))
    await connection.wait_for_close()


async def test_a_stream_is_read_as_it_comes_and_its_connection_kept() -> None:
    step = asyncio.Event()

    async def serve(connection: Connection) -> None:
        while (request := await connection.read_request()) is not None:
            if request.headers.get(b"accept") != b"text/event-stream":
                await connection.answer(ok())
                continue
            await connection.answer(chunked_head() + chunk(b"data: 1\n\n"))
            await step.wait()
            step.clear()
            await connection.answer(chunk(b"data: 2\n\n") + b"0\r\n\r\n")

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        for _ in range(2):
            async with pool.stream("/s", b"{}") as answer:
                assert answer.status == 200
                assert await answer.read() == b"data: 1\n\n"  # before the rest was even sent
                step.set()
                assert await answer.read_all() == b"data: 2\n\n"
                assert await answer.read() == b""
        assert await pool.post("/x", b"{}") == (200, OK)  # the same connection, after two streams
        await pool.aclose()
    assert pool.opened == 1 and server.connections == 1


async def test_a_stream_left_before_its_end_closes_the_connection() -> None:
    async with raw_server(one_event_then_silent) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read() == b"data: 1\n\n"
        await asyncio.wait_for(server.closed_by_client.wait(), 10)  # the engine sees its client leave
        assert pool.open_connections == 0
        await pool.aclose()


async def test_a_stream_cut_mid_body_fails_its_reader() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(chunked_head() + chunk(b"data: 1\n\n"))

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read() == b"data: 1\n\n"
            with pytest.raises(ConnectionResetError, match="before its answer ended"):
                await answer.read()
        assert pool.open_connections == 0
        await pool.aclose()


async def test_a_stream_ended_by_the_close_is_read_to_its_end() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read_all() == b"data: 1\n\n"
        assert pool.open_connections == 0
        await pool.aclose()


async def test_a_connection_closed_before_the_head_fails_the_stream() -> None:
    async def serve(connection: Connection) -> None:
        await connection.read_request()

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        with pytest.raises(ConnectionResetError):
            async with pool.stream("/s", b"{}"):
                pass
        assert pool.open_connections == 0
        await pool.aclose()


async def test_a_reader_that_is_behind_stops_the_socket_being_read_and_loses_nothing() -> None:
    piece = b"x" * 4096
    count = 256  # 1 MiB, far beyond what the pool buffers for a reader

    async def serve(connection: Connection) -> None:
        await connection.read_request()
        await connection.answer(chunked_head())
        for _ in range(count):
            await connection.answer(chunk(piece))
        await connection.answer(b"0\r\n\r\n")
        await connection.wait_for_close()

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            transport = answer.transport
            assert transport is not None
            await wait_for(lambda: not transport.is_reading(), what="the socket no longer read")
            assert pool.open_connections == 1
            body = await answer.read_all()
            assert transport.is_reading()
        assert body == piece * count
        await pool.aclose()


async def test_a_stream_whose_socket_a_pacer_held_past_its_end_goes_back_read() -> None:
    async def serve(connection: Connection) -> None:
        while (request := await connection.read_request()) is not None:
            streamed = request.headers.get(b"accept") == b"text/event-stream"
            await connection.answer(chunked_head() + chunk(b"data: 1\n\n") + b"0\r\n\r\n" if streamed else ok())

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read_all() == b"data: 1\n\n"
            assert answer.transport is not None
            answer.transport.pause_reading()  # what `ReadPacer.hold` does between ticks
        assert await asyncio.wait_for(pool.post("/x", b"{}"), 5) == (200, OK)
        await pool.aclose()
    assert pool.opened == 1


async def test_closing_the_pool_fails_a_stream_being_read() -> None:
    async with raw_server(one_event_then_silent) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read() == b"data: 1\n\n"
            reading = asyncio.create_task(answer.read())
            await asyncio.sleep(0)
            await pool.aclose()
            with pytest.raises(ConnectionResetError, match="pool was closed"):
                await reading
        await asyncio.wait_for(server.closed_by_client.wait(), 10)


async def test_an_answer_after_a_stream_in_the_same_bytes_retires_the_connection() -> None:
    async def serve(connection: Connection) -> None:
        while (request := await connection.read_request()) is not None:
            if request.headers.get(b"accept") == b"text/event-stream":
                await connection.answer(chunked_head() + chunk(b"data: 1\n\n") + b"0\r\n\r\n" + ok())
            else:
                await connection.answer(ok())

    async with raw_server(serve) as server:
        pool = pool_for(server.url)
        async with pool.stream("/s", b"{}") as answer:
            assert await answer.read_all() == b"data: 1\n\n"
        assert await pool.post("/x", b"{}") == (200, OK)
        await pool.aclose()
    assert server.connections == 2
