"""Focused regression tests for bugs found in issue 7 (reliability work: chaos soak, fuzzing, shutdown) that belong
to no one module of the core; those of generation, routing, turns and weights are in test_generation.py,
test_routing.py, test_turns.py and test_weights.py beside this file."""

from __future__ import annotations

import asyncio
import gc
import socket
import struct
import types
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import PROMPT, generate_body
from tests.sim_helpers import wait_for


async def test_stream_cut_before_its_first_byte_releases_the_session(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """Bug: when the client left while the head of a streamed answer was being sent, Starlette cancelled the
    body before its generator started, so the turn was never closed: the session's lock (and its per-key slot)
    stayed taken and every later turn of that session hung."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True})
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await asyncio.Event().wait()  # the socket never drains: the client leaves during the head

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"cut")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await asyncio.wait_for(gw.app(scope, receive, send), timeout=10)
    assert not gw.services.turns.sessions.lock("cut").locked()
    assert gw.services.quota.in_flight() == 0


async def test_json_numbers_beyond_64_bits_are_refused_not_a_500(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by the property tests of the Redis codecs): JSON allows integers of any size, the store
    encodes with orjson (64-bit), so a session created with such metadata was a 500. Now it is a 400 naming
    the field, and nothing is stored."""
    gw = await make_gateway([await make_sim("vllm")])
    huge = 2**64
    headers = {"content-type": "application/json"}
    cases = [
        ("/v1/sessions", {"metadata": {"x": huge}}, "metadata"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "n": huge}]}]},
            "messages.0.content",
        ),
    ]
    for path, body, param in cases:
        response = await http.post(f"{gw.url}{path}", content=_dumps(body), headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    session = (await http.post(f"{gw.url}/v1/sessions", json={})).json()["id"]
    finish = await http.post(
        f"{gw.url}/v1/sessions/{session}/finish", content=_dumps({"metadata": {"x": huge}}), headers=headers
    )
    assert finish.status_code == 400 and finish.json()["error"]["param"] == "metadata"


def _dumps(body: Any) -> bytes:
    import json

    return json.dumps(body).encode()  # the standard library writes integers of any size, as a client may


async def test_redis_pool_waits_for_a_free_connection(redis_server: Any, redis: Any) -> None:
    """Bug (found by the chaos soak): redis-py's default pool fails at once with "Too many connections" when all
    its connections are busy, so under 300 concurrent sessions ordinary turns got 503s. The gateway's pool now
    waits for a free connection."""
    from gateway.store import connect

    client = connect(redis_server.url, socket_timeout_s=5.0, max_connections=2)
    try:
        # BLPOP holds a connection for its timeout: far more commands than connections, all must succeed.
        results = await asyncio.gather(*(client.blpop([f"empty-{i}"], timeout=0.05) for i in range(12)))
        assert results == [None] * 12
    finally:
        await client.aclose()


@pytest.mark.parametrize("path", ["/admin/weights", "/admin/resume"])
@pytest.mark.parametrize("version", [2**31, 2**64])
async def test_weight_version_beyond_int32_is_refused_not_a_500(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, path: str, version: int
) -> None:
    """Bug (found by the schema fuzzer): a weight version beyond 64 bits made the coordination bus's encoder
    raise (a 500), and one beyond 32 bits cannot be stored in a sample's int32 per-token versions. Both are a
    400 naming `version` now, and the gateway's version is unchanged."""
    gw = await make_gateway([await make_sim("vllm")])
    headers = ADMIN | {"content-type": "application/json"}
    body = {"version": version} | ({"source": "external"} if path == "/admin/weights" else {})
    response = await http.post(f"{gw.url}{path}", content=_dumps(body), headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "version"
    status = await http.get(f"{gw.url}/admin/status", headers=ADMIN)
    assert status.json()["version"] == 0


ROUNDS = 20


def _describe(obj: object) -> str:
    """A short name for an object that refers to a leaked request cycle (a frame says where it stopped)."""
    if isinstance(obj, types.FrameType):
        return f"frame {obj.f_code.co_qualname} ({obj.f_code.co_filename.rsplit('/', 2)[-1]}:{obj.f_lineno})"
    if isinstance(obj, types.TracebackType):
        return f"traceback of {_describe(obj.tb_frame)}"
    if isinstance(obj, types.MethodType):
        return f"bound method {obj.__func__.__qualname__}"
    if isinstance(obj, BaseException):
        return f"exception {type(obj).__name__}({obj})"
    if isinstance(obj, (types.CoroutineType, types.AsyncGeneratorType, types.GeneratorType)):
        return f"{type(obj).__name__} {obj.__qualname__}"
    if isinstance(obj, asyncio.Future):
        return f"{type(obj).__name__} {obj!r:.160}"
    if isinstance(obj, dict):
        return f"dict with keys {sorted(map(str, obj))[:8]}"
    return f"{type(obj).__qualname__}"


def _referrer_chains(target: object, garbage: list[Any], depth: int = 6) -> list[str]:
    """What refers to `target` among the collector's garbage, walked `depth` steps up (`gc.get_referrers`): the
    chains that end at an object nothing else in the garbage refers to, or at `depth`."""
    ids = {id(o) for o in garbage}
    chains: list[str] = []

    def walk(obj: object, path: list[str], seen: set[int]) -> None:
        referrers = [r for r in gc.get_referrers(obj) if id(r) in ids and id(r) not in seen]
        if not referrers or len(path) >= depth:
            chains.append(" <- ".join(path))
            return
        for r in referrers[:3]:
            walk(r, [*path, _describe(r)], seen | {id(r)})

    walk(target, [_describe(target)], {id(target)})
    return chains[:6]


def _leak_report(leaked: list[RequestResponseCycle], garbage: list[Any], app: object) -> str:
    """Each leaked request cycle: its route, whether its response completed or its client left, whether `app` (the
    gateway under test) served it or another server on the same port did, and what holds it."""
    lines = []
    for cycle in leaked:
        scope = cycle.scope
        served_by = "this gateway" if scope.get("app") is app else f"another app ({type(scope.get('app')).__name__})"
        lines.append(
            f"{scope['method']} {scope['path']} complete={cycle.response_complete} disconnected={cycle.disconnected}"
            f" served by {served_by}"
        )
        lines.extend(f"    {chain}" for chain in _referrer_chains(cycle, garbage))
    return "\n".join(lines)


async def test_served_requests_leave_no_reference_cycle_of_the_server(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by counting the collector's garbage): the app kept the server's `send` (a method of uvicorn's
    request cycle) in the scope, which the cycle holds, so every request left a reference cycle: the cycle object,
    its scope, headers and events, freed only by the cyclic collector (about 4 % of the CPU of a short request).
    Now the app drops it when the request ends; the simulator runs in a process of its own, so that whatever
    garbage is left here is the gateway's or the client's."""
    sim = SimProcess()
    await asyncio.to_thread(sim.start)
    try:
        gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")])
        requests: list[tuple[str, dict[str, Any]]] = [
            ("/generate", generate_body(PROMPT, 3)),
            ("/generate", generate_body(PROMPT, 3, stream=True)),
            ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3}),
            ("/health", {}),
        ]
        for path, body in requests:  # warm: first-use allocations are not per request
            await (http.post(f"{gw.url}{path}", json=body) if body else http.get(f"{gw.url}{path}"))
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(ROUNDS):
                for path, body in requests:
                    answer = await (http.post(f"{gw.url}{path}", json=body) if body else http.get(f"{gw.url}{path}"))
                    assert answer.status_code == 200, answer.text
            gc.collect()
            # This gateway's request cycles only: a server of an earlier test in this process may free cycles of its
            # own meanwhile (the simulator's protocol keeps a reset connection's last cycle for its keep-alive
            # timeout, see `test_a_reset_connection_leaves_nothing_of_its_last_request`), on any port, this one
            # included (ports are reused): the app that served a cycle tells.
            port = urlsplit(gw.url).port
            cycles = [o for o in gc.garbage if isinstance(o, RequestResponseCycle)]
            leaked = [o for o in cycles if o.scope.get("server", ("", 0))[1] == port and o.scope.get("app") is gw.app]
            report = _leak_report(leaked, gc.garbage, gw.app)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert leaked == [], f"{len(leaked)} request cycles left to the collector:\n{report}"
    finally:
        await asyncio.to_thread(sim.stop)


async def test_a_reset_connection_leaves_nothing_of_its_last_request(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """Bug: uvicorn disarms a connection's keep-alive timer only when the connection closed cleanly; one its client
    reset kept its protocol and last request cycle (scope, headers) alive for `timeout_keep_alive` (30 s), then left
    them to the cyclic collector. A full run of the suite saw another test's such cycles freed in the middle of
    the reference-cycle test. The gateway's protocol (the fast path's `server_protocol`, on here whatever
    RG_FASTPATH__* says: with it off, uvicorn's own protocol keeps them as described) lets go of a lost connection at
    once."""
    gw = await make_gateway([await make_sim("vllm")], fastpath={"enabled": True, "server_protocol": True})
    port = urlsplit(gw.url).port
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /health HTTP/1.1\r\nhost: gateway\r\n\r\n")
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # an RST: the server's connection_lost gets an error
        await wait_for(lambda: not gw.server.server_state.connections, what="the server's connections to be lost")
        gc.collect()
        ours = [o for o in gc.get_objects() + gc.garbage if type(o) is RequestResponseCycle]
        kept = [o for o in ours if o.scope.get("server", ("", 0))[1] == port]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert kept == [], _leak_report(kept, [], gw.app)
