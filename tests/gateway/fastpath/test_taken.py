"""On the library versions pyproject.toml pins, every part of the fast path (`gateway/fastpath/`) is taken: none
falls back to the library's own way because a private name it relies on moved. A failure here after an upgrade
means a part silently stopped paying: re-check it (or let it go) before widening the pin.

And with `fastpath.enabled: false`, none of them is."""

from __future__ import annotations

import inspect

import httpx
from starlette.requests import Request

from gateway.api.streaming import SERVER_SEND, GatewayApp
from gateway.fastpath import hot_routes, one_pass_route
from gateway.fastpath.engine_client import KeepAlivePool
from gateway.fastpath.hot_routes import HotRoutes
from gateway.fastpath.redis_batching import PipelineBatcher
from gateway.fastpath.server_protocol import CYCLE_NAMES, UVICORN_NAMES, LimitedHttpToolsProtocol
from gateway.fastpath.server_send import abort_connection, server_transport
from gateway.server import RunningGateway
from gateway.store.pipelines import OwnPipelines
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body

HOT = {"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"}


async def _serve_both_routes(gw: RunningGateway, http: httpx.AsyncClient) -> None:
    one = await http.post(f"{gw.url}/generate", json=generate_body([5, 6, 7], 4, session_id="taken"))
    assert one.status_code == 200, one.text
    two = await http.post(f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
    assert two.status_code == 200, two.text


async def _server_send_found(gw: RunningGateway, http: httpx.AsyncClient) -> bool | None:
    """Whether a request's scope carries the server's `send` and `server_send` finds its connection's transport
    (None: no `send` in the scope), asked of a probe route added to the running app."""

    async def probe(request: Request) -> bool | None:
        send = request.scope.get(SERVER_SEND)
        return None if send is None else server_transport(send) is not None

    gw.app.add_api_route("/taken/server-send", probe)
    answer = await http.get(f"{gw.url}/taken/server-send")
    assert answer.status_code == 200, answer.text
    found: bool | None = answer.json()
    return found


def _replica_transport(gw: RunningGateway) -> object:
    (replica,) = gw.services.pool.replicas.values()
    return replica.backend._client.generation_pool  # type: ignore[attr-defined]


async def test_every_part_is_taken_on_the_pinned_libraries(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    # What each part checks on import about the installed libraries.
    assert hot_routes._ROUTE_CONTEXTS, "FastAPI no longer offers its route contexts"
    assert one_pass_route._FASTAPI_KNOWN, "FastAPI moved the names the one-pass handler needs"
    assert hot_routes.is_async_callable is not inspect.iscoroutinefunction, "Starlette moved is_async_callable"

    gw = await make_gateway([await make_sim("vllm")], fastpath={"enabled": True})
    await _serve_both_routes(gw, http)
    app = gw.app
    assert isinstance(app, GatewayApp) and isinstance(app.built_shortcut, HotRoutes)
    assert app.built_shortcut.paths == HOT
    batcher = gw.services.store.batcher
    assert isinstance(batcher, PipelineBatcher) and batcher._connection is not None, "the batcher fell back"
    transport = _replica_transport(gw)
    assert isinstance(transport, KeepAlivePool) and transport.opened >= 1
    assert app.abort_client is abort_connection
    assert await _server_send_found(gw, http) is True, "uvicorn's send no longer leads to its transport"
    # The server protocol's class, and the names of uvicorn's protocol it uses on every live connection.
    assert issubclass(gw.server.config.http, LimitedHttpToolsProtocol)  # type: ignore[arg-type]
    connections = gw.server.server_state.connections
    assert connections and all(isinstance(c, LimitedHttpToolsProtocol) for c in connections)
    assert all(set(UVICORN_NAMES) <= vars(c).keys() for c in connections), "uvicorn's protocol renamed its state"
    cycles = [c.cycle for c in connections if c.cycle is not None]
    assert cycles and all(set(CYCLE_NAMES) <= vars(c).keys() for c in cycles), "uvicorn's cycle renamed its state"


async def test_off_switch_leaves_the_libraries_alone(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], fastpath={"enabled": False})
    await _serve_both_routes(gw, http)
    assert isinstance(gw.app, GatewayApp) and gw.app.built_shortcut is None
    assert isinstance(gw.services.store.batcher, OwnPipelines)
    assert not isinstance(_replica_transport(gw), KeepAlivePool)
    assert gw.app.abort_client is None and await _server_send_found(gw, http) is None
    assert gw.server.config.http == "httptools" and gw.server.config.limit_concurrency is not None
