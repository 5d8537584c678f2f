"""Request bodies and silent connections (the fast path's `server_protocol`) over real sockets to a real gateway: a
body with no byte for server.body_timeout_s, or slower on average than server.min_body_rate_bytes_s past that grace,
is answered 408 and its connection closed, on every route and in either framing; a slow but steady upload is served;
and near server.max_connections a connection that has sent nothing is closed after server.silent_timeout_near_cap_s,
so neither trickled bodies nor a flood of silent connections keep requests out."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import socket
import time
from collections.abc import Iterable

import pytest

from tests.conftest import GatewayFactory
from tests.gateway.raw_http import PART_ON, Connection, address, answer, connected, get, send_ignoring_reset

Answer = tuple[int, dict[str, str], bytes]

BODY_LIMITS = {"body_timeout_s": 0.5, "min_body_rate_bytes_s": 1024}


def post_head(path: str, length: int | None) -> bytes:
    """A POST's head: `length` bytes of body declared, or a chunked one (None)."""
    framing = "transfer-encoding: chunked" if length is None else f"content-length: {length}"
    return f"POST {path} HTTP/1.1\r\nhost: gateway\r\ncontent-type: application/json\r\n{framing}\r\n\r\n".encode()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def trickle(writer: asyncio.StreamWriter, pieces: Iterable[bytes], every_s: float) -> None:
    for piece in pieces:
        await send_ignoring_reset(writer, piece)
        await asyncio.sleep(every_s)


async def refused_while_trickling(connection: Connection, head: bytes, piece: bytes) -> Answer:
    """Sends `head`, then `piece` every 50 ms until the gateway answers; the answer, once the connection closed."""
    reader, writer = connection
    writer.write(head)
    sending = asyncio.create_task(trickle(writer, itertools.repeat(piece), 0.05))
    try:
        status, headers, body = await answer(reader)
        assert await reader.read() == b""  # then closed
    finally:
        sending.cancel()
    return status, headers, body


def assert_body_timeout(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 408
    assert headers["connection"] == "close"
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "request_body_timeout"
    assert "server.min_body_rate_bytes_s" in error["message"] and "server.body_timeout_s" in error["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/sessions"], ids=["hot-route", "fastapi-route"])
async def test_a_body_trickled_a_byte_at_a_time_gets_408_and_its_connection_closes(
    make_gateway: GatewayFactory, path: str, chunked: bool
) -> None:
    gw = await make_gateway([], fastpath=PART_ON, server=BODY_LIMITS)
    head = post_head(path, None if chunked else 100_000)
    piece = chunk(b" ") if chunked else b" "
    start = time.monotonic()
    async with connected(gw) as connection, asyncio.timeout(10):
        status, headers, body = await refused_while_trickling(connection, head, piece)
        while gw.server.server_state.tasks:  # the request's task ended too, the client's socket still open
            await asyncio.sleep(0.01)
    assert_body_timeout(status, headers, body)
    assert time.monotonic() - start >= BODY_LIMITS["body_timeout_s"]


async def test_a_body_that_stops_after_a_fast_start_gets_408(make_gateway: GatewayFactory) -> None:
    """A burst earns time at the rate floor, but no byte for body_timeout_s is a timeout whatever came before."""
    gw = await make_gateway([], fastpath=PART_ON, server=BODY_LIMITS)
    async with connected(gw) as (reader, writer), asyncio.timeout(10):
        writer.write(post_head("/v1/sessions", 100_000) + b" " * 50_000)  # enough for 48 s at the floor
        status, headers, body = await answer(reader)
        assert await reader.read() == b""
    assert_body_timeout(status, headers, body)


async def test_a_trickled_body_the_app_answered_without_reading_closes_its_connection(
    make_gateway: GatewayFactory,
) -> None:
    """Answered already (405 before the body was read): the rest of the body is still timed, and the connection
    closed without a second answer."""
    gw = await make_gateway([], fastpath=PART_ON, server=BODY_LIMITS)
    async with connected(gw) as (reader, writer):
        writer.write(post_head("/health", 100_000))
        sending = asyncio.create_task(trickle(writer, itertools.repeat(b" "), 0.05))
        try:
            async with asyncio.timeout(10):
                assert (await answer(reader))[0] == 405
                try:
                    rest = await reader.read()
                except ConnectionResetError:  # closed while the trickle still came: reset by the kernel, no answer
                    rest = b""
                assert rest == b""
        finally:
            sending.cancel()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_slow_but_steady_upload_is_served_and_its_connection_kept_alive(
    make_gateway: GatewayFactory, chunked: bool
) -> None:
    """Longer than body_timeout_s in all, with a pause shorter than it, at a rate over the floor. The timeout is 1 s
    here, not 0.5: the client shares the gateway's loop, and a loaded host stretched its 0.05 s gaps past 0.5 s."""
    limits = BODY_LIMITS | {"body_timeout_s": 1.0}
    gw = await make_gateway([], fastpath=PART_ON, server=limits)
    body = b'{"metadata": {"note": "steady"}' + b" " * (48 * 1024) + b"}"
    pieces = [body[i : i + 1024] for i in range(0, len(body), 1024)]
    framed = [chunk(piece) for piece in pieces] + [b"0\r\n\r\n"] if chunked else pieces
    start = time.monotonic()
    async with connected(gw) as (reader, writer), asyncio.timeout(20):
        writer.write(post_head("/v1/sessions", None if chunked else len(body)))
        for i, piece in enumerate(framed):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.3 if i == len(framed) // 2 else 0.05)
        status, _, answered = await answer(reader)
        assert status == 201, answered
        assert json.loads(answered)["metadata"] == {"note": "steady"}
        assert time.monotonic() - start > 2 * limits["body_timeout_s"]
        await asyncio.sleep(2 * limits["body_timeout_s"])  # idle between requests: keep-alive's, not a body's
        writer.write(get("/health"))
        assert (await answer(reader))[0] == 200


async def test_trickled_bodies_filling_the_cap_give_their_connections_back(make_gateway: GatewayFactory) -> None:
    cap = 8
    gw = await make_gateway([], fastpath=PART_ON, server=BODY_LIMITS | {"max_connections": cap})

    async def trickled() -> Answer:
        async with connected(gw) as connection:
            return await refused_while_trickling(connection, post_head("/v1/sessions", 100_000), b" ")

    async with asyncio.timeout(20):
        answers = await asyncio.gather(*(trickled() for _ in range(cap)))
        async with connected(gw) as (reader, writer):
            writer.write(get("/health"))
            assert (await answer(reader))[0] == 200
    for status, headers, body in answers:
        assert_body_timeout(status, headers, body)


NEAR_CAP = {"max_connections": 8, "header_timeout_s": 30.0, "silent_timeout_near_cap_s": 0.25}


async def test_far_from_the_cap_a_silent_connection_has_header_timeout_s(make_gateway: GatewayFactory) -> None:
    gw = await make_gateway([], fastpath=PART_ON, server=NEAR_CAP)
    async with connected(gw) as (reader, writer), asyncio.timeout(10):
        await asyncio.sleep(2 * NEAR_CAP["silent_timeout_near_cap_s"])
        async with connected(gw) as (other_reader, other_writer):  # two open, under half the cap
            other_writer.write(get("/health"))
            assert (await answer(other_reader))[0] == 200
        writer.write(get("/health"))
        assert (await answer(reader))[0] == 200


async def test_near_the_cap_connections_silent_for_silent_timeout_near_cap_s_are_closed(
    make_gateway: GatewayFactory,
) -> None:
    gw = await make_gateway([], fastpath=PART_ON, server=NEAR_CAP)
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(10):
        talker = await stack.enter_async_context(connected(gw))  # served, then idle: kept alive, not silent
        talker[1].write(get("/health"))
        assert (await answer(talker[0]))[0] == 200
        silent = [await stack.enter_async_context(connected(gw)) for _ in range(NEAR_CAP["max_connections"] // 2)]
        for reader, _ in silent:
            assert await reader.read() == b""
        talker[1].write(get("/health"))
        assert (await answer(talker[0]))[0] == 200


async def test_near_the_cap_a_request_that_came_during_a_slow_loop_pass_is_served(
    make_gateway: GatewayFactory,
) -> None:
    """Under load one pass of the event loop can outlast silent_timeout_near_cap_s. A client that sent its request as
    it connected is not silent while its request waits unread behind such a pass: the connection that comes next (near
    the cap) does not close it."""
    gw = await make_gateway([], fastpath=PART_ON, server=NEAR_CAP)
    loop = asyncio.get_running_loop()
    async with contextlib.AsyncExitStack() as stack, asyncio.timeout(10):
        silent = int(NEAR_CAP["max_connections"]) // 2 - 2  # with the two below: half the cap
        for _ in range(silent):
            await stack.enter_async_context(connected(gw))
        while len(gw.server.server_state.connections) < silent:  # until the gateway made them its own
            await asyncio.sleep(0.01)  # a poll's period, not synchronisation
        talker = socket.create_connection(address(gw))
        talker.sendall(get("/health"))  # as it connects
        late: list[socket.socket] = []

        def connect_another_then_stall() -> None:
            # A timer: it runs after the pass's I/O, in which the loop accepted `talker` (a task makes its transport
            # in the next pass, and that one has the protocol's `connection_made` called in the pass after). The
            # other connection is accepted in the next pass, so its `connection_made` comes first in the pass after
            # that of `talker`, before the loop reads `talker`; that pass is slow.
            late.append(stack.enter_context(socket.create_connection(address(gw))))
            loop.call_soon(loop.call_soon, time.sleep, 2 * NEAR_CAP["silent_timeout_near_cap_s"])

        loop.call_at(loop.time(), connect_another_then_stall)
        reader, writer = await asyncio.open_connection(sock=talker)
        stack.callback(writer.close)
        assert (await answer(reader))[0] == 200
        assert late


@pytest.mark.timeout(60)
async def test_a_flood_of_silent_connections_leaves_room_for_requests(make_gateway: GatewayFactory) -> None:
    cap = 16
    gw = await make_gateway([], fastpath=PART_ON, server={"max_connections": cap, "silent_timeout_near_cap_s": 0.25})
    flood: list[Connection] = []

    async def open_silent_connections(per_s: float) -> None:
        while True:
            flood.append(await asyncio.open_connection(*address(gw)))
            await asyncio.sleep(1 / per_s)

    flooding = asyncio.create_task(open_silent_connections(30))
    statuses = []
    try:
        await asyncio.sleep(1.0)  # the cap would be full of them by now
        for _ in range(20):
            async with connected(gw) as (reader, writer), asyncio.timeout(10):
                writer.write(get("/health"))
                statuses.append((await answer(reader))[0])
            await asyncio.sleep(0.1)
    finally:
        flooding.cancel()
        for _, writer in flood:
            writer.close()
    assert statuses == [200] * 20
    assert len(flood) >= 2 * cap
