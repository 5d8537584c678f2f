"""`HeadWithBodyProtocol`: a response's head goes out with its body in one write, a head alone still goes out in the
loop's next pass, and uvicorn serves over it as before (real server, real sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from starlette.types import Receive, Scope, Send

from gateway.fastpath.head_with_body import HeadWithBodyProtocol, HeadWithBodyTransport, send_whole_answer

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


class RecordingTransport(asyncio.Transport):
    """The socket end of a transport: records every write call (a stand-in for the event loop's transport)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, bytes]] = []
        self.closing = False

    def write(self, data: Any) -> None:
        self.calls.append(("write", bytes(data)))

    def writelines(self, list_of_data: Any) -> None:
        self.calls.append(("writelines", b"".join(list_of_data)))

    def close(self) -> None:
        self.calls.append(("close", b""))
        self.closing = True

    def abort(self) -> None:
        self.calls.append(("abort", b""))
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing


def held(recorder: RecordingTransport) -> HeadWithBodyTransport:
    return HeadWithBodyTransport(recorder, asyncio.get_running_loop())


async def next_pass() -> None:
    await asyncio.sleep(0)  # the callbacks the previous pass scheduled run before this task resumes
    await asyncio.sleep(0)


async def test_a_head_and_its_body_go_out_in_one_call() -> None:
    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(HEAD)
    assert recorder.calls == []
    transport.write(b"{}")
    assert recorder.calls == [("writelines", HEAD + b"{}")]
    await next_pass()  # the scheduled flush finds nothing left
    assert recorder.calls == [("writelines", HEAD + b"{}")]


async def test_a_head_alone_goes_out_in_the_next_pass() -> None:
    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(HEAD)
    await next_pass()
    assert recorder.calls == [("write", HEAD)]
    transport.write(b"{}")  # a later body is written as it is
    assert recorder.calls == [("write", HEAD), ("write", b"{}")]


async def test_other_writes_are_not_held() -> None:
    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(b"5\r\nhello\r\n")
    transport.write(memoryview(b"0\r\n\r\n"))
    assert recorder.calls == [("write", b"5\r\nhello\r\n"), ("write", b"0\r\n\r\n")]


async def test_close_sends_a_held_head_first_and_abort_drops_it() -> None:
    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
    transport.close()
    assert [call for call, _ in recorder.calls] == ["write", "close"]

    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(HEAD)
    transport.abort()
    await next_pass()
    assert recorder.calls == [("abort", b"")]


async def test_a_held_head_is_dropped_when_the_connection_is_already_closing() -> None:
    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(HEAD)
    recorder.closing = True  # the peer went away meanwhile
    await next_pass()
    assert recorder.calls == []
    assert transport.is_closing()


async def test_writelines_keeps_the_order_after_a_held_head() -> None:
    recorder = RecordingTransport()
    transport = held(recorder)
    transport.write(HEAD)
    transport.writelines([b"{", b"}"])
    assert recorder.calls == [("write", HEAD), ("writelines", b"{}")]


@contextlib.asynccontextmanager
async def serve(app: Any, keep_alive_s: float = 5.0) -> AsyncIterator[str]:
    """`app` served by uvicorn over `HeadWithBodyProtocol` on a free port of this loop. The socket listens before
    uvicorn starts, so a client's connection waits in its backlog until uvicorn accepts it: nothing to poll for."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config = uvicorn.Config(
        app,
        loop="none",
        http=HeadWithBodyProtocol,
        lifespan="off",
        log_level="warning",
        access_log=False,  # as the gateway serves (an access log leaves whole answers to `send`)
        timeout_keep_alive=keep_alive_s,  # type: ignore[arg-type]  # a float works; uvicorn annotates an int
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


async def test_uvicorn_serves_json_and_streams_over_it() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if scope["path"] == "/json":
            await send({"type": "http.response.start", "status": 201, "headers": [(b"content-length", b"7")]})
            await send({"type": "http.response.body", "body": b'{"a":1}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for piece in (b"one ", b"two ", b""):
            await send({"type": "http.response.body", "body": piece, "more_body": bool(piece)})

    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        for _ in range(3):  # the same keep-alive connection, response after response
            answer = await client.post("/json", content=b"x")
            assert (answer.status_code, answer.json()) == (201, {"a": 1})
            streamed = await client.post("/stream", content=b"x")
            assert (streamed.status_code, streamed.content) == (200, b"one two ")
            assert streamed.headers["transfer-encoding"] == "chunked"


async def test_a_stream_gets_its_head_before_its_first_event() -> None:
    head_seen = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await head_seen.wait()  # the first event waits until the client has the head
        await send({"type": "http.response.body", "body": b"event", "more_body": False})

    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/", content=b"x") as answer:  # returns once the head is in
            assert answer.status_code == 200
            head_seen.set()
            assert await answer.aread() == b"event"


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One POST on a raw kept-alive connection; the answer's two-byte body."""
    writer.write(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\n\r\nx")
    await reader.readuntil(b"\r\n\r\n")
    return await reader.readexactly(2)


async def test_an_idle_kept_alive_connection_is_closed_after_the_timeout_and_a_busy_one_is_not() -> None:
    keep_alive_s = 0.5
    slow = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        if slow.is_set():
            await asyncio.sleep(2 * keep_alive_s)  # a request running past the timeout: its connection is not idle
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with serve(app, keep_alive_s) as url:
        port = int(url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        slow.set()
        assert await _post(reader, writer) == b"ok"  # answered after twice the timeout, on the same connection
        slow.clear()
        for _ in range(3):  # reused within the timeout, again and again
            await asyncio.sleep(keep_alive_s / 5)
            assert await _post(reader, writer) == b"ok"
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 10) == b""  # then idle: the server closes it
        waited = asyncio.get_running_loop().time() - started
        # Not at the first sweep after the answer (a quarter of the timeout); the client took the answer a little after
        # the server stamped the connection idle, so the margin. The sweep may close it up to 1.25 times the timeout.
        assert waited >= keep_alive_s / 2
        writer.close()
        await writer.wait_closed()


async def test_a_zero_keep_alive_closes_the_connection_after_its_response() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async with serve(app, keep_alive_s=0) as url:
        reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
        assert await _post(reader, writer) == b"ok"
        assert await asyncio.wait_for(reader.read(), 10) == b""  # closed at once, as uvicorn does
        writer.close()
        await writer.wait_closed()


WHOLE_HEADERS = [(b"content-length", b"7"), (b"content-type", b"application/json")]


async def _whole_or_sent(scope: Scope, receive: Receive, send: Send) -> None:
    """`/whole` answers through `send_whole_answer`, anything else the same answer through `send`."""
    await receive()
    if scope["path"] == "/whole":
        assert send_whole_answer(send, 201, WHOLE_HEADERS, b'{"a":1}')
        assert not send_whole_answer(send, 201, WHOLE_HEADERS, b'{"a":1}')  # once sent, never again
        return
    await send({"type": "http.response.start", "status": 201, "headers": WHOLE_HEADERS})
    await send({"type": "http.response.body", "body": b'{"a":1}'})


async def _exchange(port: int, request: bytes, answers: int = 1) -> tuple[bytes, bool]:
    """Everything the server sends back for `request` on a fresh connection, and whether it then closed it: a probe
    request after the answers gets an answer of its own on a kept-alive connection, the end of the stream (or a
    reset) on a closed one."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    received = b""
    for _ in range(answers):
        received += await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        received += await asyncio.wait_for(reader.readexactly(7), 10)
    try:
        writer.write(b"POST /probe HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\n\r\nx")
        closed = await asyncio.wait_for(reader.read(1), 10) == b""
    except ConnectionError:
        closed = True
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    return received, closed


def _without_date(received: bytes) -> bytes:
    return b"\r\n".join(line for line in received.split(b"\r\n") if not line.startswith(b"date: "))


async def test_a_whole_answer_goes_out_as_uvicorns_send_would_write_it() -> None:
    async with serve(_whole_or_sent) as url:
        port = int(url.rsplit(":", 1)[1])
        for connection in (b"", b"connection: close\r\n"):
            answers = {}
            for path in (b"/whole", b"/sent"):
                request = b"POST " + path + b" HTTP/1.1\r\nhost: t\r\n" + connection + b"content-length: 1\r\n\r\nx"
                answers[path] = await _exchange(port, request)
            whole, sent = answers[b"/whole"], answers[b"/sent"]
            assert whole[0].startswith(b"HTTP/1.1 201 Created\r\ndate: ")
            assert _without_date(whole[0]) == _without_date(sent[0])
            assert whole[1] == sent[1] == bool(connection)  # closed after the answer exactly when uvicorn closes it
            assert (b"connection: close" in whole[0]) == bool(connection)


async def test_a_connection_stays_usable_after_whole_answers() -> None:
    async with serve(_whole_or_sent) as url:
        port = int(url.rsplit(":", 1)[1])
        one = b"POST /whole HTTP/1.1\r\nhost: t\r\ncontent-length: 1\r\n\r\nx"
        received, closed = await _exchange(port, one * 3, answers=3)  # pipelined, then kept alive
        assert received.count(b"HTTP/1.1 201 Created\r\n") == 3 and received.count(b'{"a":1}') == 3
        assert not closed
        async with httpx.AsyncClient(base_url=url) as client:
            for _ in range(3):  # one kept-alive connection, answer after answer
                answer = await client.post("/whole", content=b"x")
                assert (answer.status_code, answer.json()) == (201, {"a": 1})


async def test_a_whole_answer_is_left_to_send_when_send_is_not_uvicorns() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        async def wrapped(message: Any) -> None:
            await send(message)

        await _whole_or_sent({**scope, "path": "/sent"}, receive, wrapped)
        assert not send_whole_answer(wrapped, 201, WHOLE_HEADERS, b'{"a":1}')

    async with serve(app) as url, httpx.AsyncClient(base_url=url) as client:
        answer = await client.post("/whole", content=b"x")
        assert (answer.status_code, answer.json()) == (201, {"a": 1})
