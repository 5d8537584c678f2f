"""`LaneProtocol`: a lane request's body is read whole by the server and handed to the fast lane; every other request,
and every unusual way a lane request can arrive, is served as uvicorn serves it (real server, raw sockets).

Each scenario runs against the gateway's protocol and against `HeadWithBodyProtocol` (uvicorn's own request cycle,
the protocol before this one) and must end alike; the lane scenarios also check that the lane's cycle served them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest
import uvicorn
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from common.asgi import ClientDisconnected, unless_disconnected
from gateway.api.errors import install_error_handlers
from gateway.api.json_answer import json_answer
from gateway.api.lean_route import LeanRoute
from gateway.api.limits import BodySizeLimit
from gateway.api.observability import RequestMetrics
from gateway.api.streaming import GatewayApp, GuardedStreamingResponse
from gateway.http_protocol import HeadWithBodyProtocol
from gateway.lane_protocol import LaneCycle, LaneProtocol
from gateway.server import uvicorn_config
from tests.gateway_helpers import until_a_request_is_in
from tests.sim_helpers import wait_for

MAX_BODY = 4096


class Echo(BaseModel):
    text: str
    stream: bool = False


async def _echo(body: Echo, request: Request) -> Response:
    if body.stream:

        async def events() -> AsyncIterator[bytes]:
            yield b"data: " + body.text.encode() + b"\n\n"

        async def nothing() -> None:
            pass

        return GuardedStreamingResponse(events(), nothing, media_type="text/event-stream")
    return json_answer({"text": body.text, "query": request.url.query})


class Wait(BaseModel):
    text: str
    seconds: float = 60


HEARD: list[str] = []
"""The texts of the `/wait` requests whose client was heard leaving."""
GATE = asyncio.Event()  # a test's own loop makes and sets it (an Event binds to a loop only when first awaited)


async def _wait(body: Wait, request: Request) -> Response:
    """Waits for `GATE`, then `seconds` watched for a disconnect from 30 s on (so only a server's notice hears one
    sooner)."""
    await GATE.wait()
    with contextlib.suppress(ClientDisconnected):
        await unless_disconnected(
            request, asyncio.sleep(body.seconds), lambda: HEARD.append(body.text), watch_after_s=30
        )
    return json_answer({"text": body.text})


def _app() -> GatewayApp:
    """The gateway's app shape (its middlewares and error handlers) around one lane route."""
    app = GatewayApp()
    install_error_handlers(app)
    router = APIRouter(route_class=LeanRoute)
    router.add_api_route("/echo", _echo, methods=["POST"])
    router.add_api_route("/wait", _wait, methods=["POST"])
    app.include_router(router)
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY)
    app.add_middleware(RequestMetrics)
    return app


@dataclass
class Served:
    port: int
    server: uvicorn.Server

    def cycles(self) -> list[type]:
        """The type of each open connection's latest request cycle."""
        return [type(protocol.cycle) for protocol in self.server.server_state.connections]  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def serve(protocol: type[HeadWithBodyProtocol]) -> AsyncIterator[Served]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    config = uvicorn_config(_app())  # as the gateway serves
    config.http = protocol
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        yield Served(sock.getsockname()[1], server)
    finally:
        server.should_exit = True
        await task


PROTOCOLS = [LaneProtocol, HeadWithBodyProtocol]


def post(body: bytes, path: str = "/echo", *, headers: bytes = b"", version: bytes = b"1.1") -> bytes:
    return b"POST %s HTTP/%s\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        path.encode(),
        version,
        len(body),
        headers,
        body,
    )


def echo(text: str, **more: object) -> bytes:
    return orjson.dumps({"text": text, **more})


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer: status, headers, body (by content-length, or chunked)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split()[1])
    headers = dict(line.lower().split(": ", 1) for line in head[1:] if line)
    if status == 100:
        return status, headers, b""  # an interim answer: no body
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while (size := int((await reader.readuntil(b"\r\n")).strip(), 16)) > 0:
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readexactly(2)
    return status, headers, body


async def answer_of(reader: asyncio.StreamReader) -> tuple[int, object]:
    """Status and parsed JSON body (or the raw body, if it is not JSON) of the next answer."""
    status, _, body = await read_answer(reader)
    try:
        return status, orjson.loads(body)
    except orjson.JSONDecodeError:
        return status, body


@contextlib.asynccontextmanager
async def connected(served: Served) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    try:
        yield reader, writer
    finally:
        writer.close()


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_a_lane_request_whole_or_in_pieces(protocol: type[HeadWithBodyProtocol]) -> None:
    text = "in pieces " * 40
    async with serve(protocol) as served, connected(served) as (reader, writer):
        writer.write(post(echo("whole")))
        assert await answer_of(reader) == (200, {"text": "whole", "query": ""})
        request = post(echo(text))
        for start in range(0, len(request), 97):  # the head and the body split across several reads
            writer.write(request[start : start + 97])
            await writer.drain()
            await asyncio.sleep(0.005)
        assert await answer_of(reader) == (200, {"text": text, "query": ""})
        writer.write(post(echo("events", stream=True)))
        status, headers, body = await read_answer(reader)
        assert (status, headers["content-type"], body) == (200, "text/event-stream; charset=utf-8", b"data: events\n\n")
        if protocol is LaneProtocol:
            assert served.cycles() == [LaneCycle]
            # The last cycle stays with its idle connection until the next request: it keeps no body.
            assert [p.cycle.parts for p in served.server.server_state.connections] == [[]]  # type: ignore[attr-defined]


UVICORNS_WAY = {
    "a query": (post(echo("q"), "/echo?x=1"), (200, {"text": "q", "query": "x=1"})),
    "a chunked body": (
        b"POST /echo HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(echo("c")), echo("c")),
        (200, {"text": "c", "query": ""}),
    ),
    "100-continue": (post(echo("e"), headers=b"expect: 100-continue\r\n"), (200, {"text": "e", "query": ""})),
    "over the body limit": (post(b" " * (MAX_BODY + 1)), 413),
    "another method": (b"GET /echo HTTP/1.1\r\nhost: t\r\n\r\n", 405),
    "an invalid body": (post(b'{"text": 1}'), 400),
}


@pytest.mark.parametrize("case", UVICORNS_WAY)
async def test_other_requests_are_served_as_uvicorn_serves_them(case: str) -> None:
    request, expected = UVICORNS_WAY[case]
    answers = []
    for protocol in PROTOCOLS:
        async with serve(protocol) as served, connected(served) as (reader, writer):
            writer.write(request)
            status, content = await answer_of(reader)
            if status == 100:  # `Expect: 100-continue`: the interim answer, then the answer
                status, content = await answer_of(reader)
            answers.append((status, content))
            if protocol is LaneProtocol and case != "an invalid body":  # that one took the lane, then FastAPI
                assert served.cycles() == [RequestResponseCycle]
    assert answers[0] == answers[1]
    assert answers[0] == expected or answers[0][0] == expected, answers[0]


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_pipelined_requests_are_answered_in_order(protocol: type[HeadWithBodyProtocol]) -> None:
    async with serve(protocol) as served, connected(served) as (reader, writer):
        writer.write(b"".join(post(echo(f"#{i}")) for i in range(4)))
        assert [await answer_of(reader) for _ in range(4)] == [(200, {"text": f"#{i}", "query": ""}) for i in range(4)]
        writer.write(post(echo("after")))
        assert await answer_of(reader) == (200, {"text": "after", "query": ""})


@pytest.mark.parametrize("protocol", PROTOCOLS)
async def test_an_http_1_0_request_is_answered_and_its_connection_closed(protocol: type[HeadWithBodyProtocol]) -> None:
    async with serve(protocol) as served, connected(served) as (reader, writer):
        writer.write(post(echo("old"), version=b"1.0"))
        assert await answer_of(reader) == (200, {"text": "old", "query": ""})
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed after the answer


async def test_a_client_gone_mid_body_ends_alike_and_the_server_serves_on(caplog: pytest.LogCaptureFixture) -> None:
    logged = []
    for protocol in PROTOCOLS:
        caplog.clear()
        async with serve(protocol) as served:
            async with connected(served) as (_, writer):
                request = post(echo("never whole " * 10))
                writer.write(request[: len(request) - 20])
                await writer.drain()
                await until_a_request_is_in(served.server, "/echo")
            for _ in range(200):  # the abandoned request's task ends: nothing left running
                if not served.server.server_state.tasks and not served.server.server_state.connections:
                    break
                await asyncio.sleep(0.01)
            assert not served.server.server_state.tasks
            async with connected(served) as (reader, writer):
                writer.write(post(echo("next")))
                assert await answer_of(reader) == (200, {"text": "next", "query": ""})
        logged.append(sorted((r.levelname, r.getMessage()) for r in caplog.records if r.levelname != "DEBUG"))
    assert logged[0] == logged[1]


@pytest.mark.parametrize("before_the_watch", [False, True])
async def test_a_lane_request_hears_its_client_leave_at_once(before_the_watch: bool) -> None:
    # The lane's notice tells the request's watch when the connection is lost, whether its watch was already named
    # or (`before_the_watch`) is named after the client left. uvicorn's own cycle gives no notice: there the watch
    # would start after 30 s.
    global GATE
    GATE = asyncio.Event()
    HEARD.clear()
    if not before_the_watch:
        GATE.set()
    async with serve(LaneProtocol) as served:
        async with connected(served) as (_, writer):
            writer.write(post(orjson.dumps({"text": "left"}), "/wait"))
            await writer.drain()
            await until_a_request_is_in(served.server, "/wait")
            assert served.cycles() == [LaneCycle]
            cycle = next(iter(served.server.server_state.connections)).cycle  # type: ignore[attr-defined]
            if not before_the_watch:  # the endpoint is watching, its listener named
                await wait_for(lambda: cycle.notice.listener is not None, what="the watch's listener")
        await wait_for(lambda: not served.server.server_state.connections, what="the server to see the connection go")
        GATE.set()
        # Within 5 s: a late watch would start after 30 s.
        await wait_for(lambda: "left" in HEARD, timeout=5, what="the disconnect heard through the notice")
        assert cycle.notice.disconnected and cycle.notice.listener is None  # the ended watch let go of it
        async with connected(served) as (reader, writer):  # a watch that ends normally leaves no listener named
            writer.write(post(orjson.dumps({"text": "stayed", "seconds": 0}), "/wait"))
            assert await answer_of(reader) == (200, {"text": "stayed"})
            (protocol,) = served.server.server_state.connections  # type: ignore[attr-defined]
            assert protocol.cycle.notice.listener is None and not protocol.cycle.notice.disconnected
    assert HEARD == ["left"]
