"""`OnePassRoute` (gateway/fastpath/one_pass_route.py) answers exactly as FastAPI's own handler.

The same requests go to two gateways on the same simulator replica, one serving the hot routes with `OnePassRoute`
and one with FastAPI's `APIRoute`, over real HTTP: every answer must have the same status and the same body (ids
and timestamps aside). Property tests check the two shortcuts the lean handler takes: its content-type parse is
FastAPI's, and pydantic's one-pass JSON validation accepts nothing the standard library's parser refuses and
builds the same model from what it accepts.
"""

from __future__ import annotations

import asyncio
import codecs
import email.message
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request, Response
from fastapi.routing import APIRoute, iter_route_contexts
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from common.asgi import ClientDisconnected
from gateway.api import deps
from gateway.api.errors import install_error_handlers
from gateway.api.generate import routes as generate
from gateway.api.generate.routes import GenerateBody
from gateway.api.json_answer import JSONAnswer
from gateway.api.limits import BodySizeLimit
from gateway.api.observability import RequestMetrics
from gateway.api.openai import routes as openai
from gateway.api.openai.models import ChatCompletionRequest, CompletionRequest
from gateway.api.responses import routes as responses
from gateway.api.responses.models import ResponseRequest
from gateway.api.streaming import GatewayApp, GuardedStreamingResponse
from gateway.errors import Forbidden, InvalidRequest
from gateway.fastpath.hot_routes import HotRoutes
from gateway.fastpath.one_pass_route import OnePassRoute, is_json_content_type
from gateway.server import RunningGateway
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import scrape, until_a_request_is_in

AGENT_KEY = "sk-lean-0123456789abcdef"
AUTH = {"authorization": f"Bearer {AGENT_KEY}"}
JSON = {"content-type": "application/json"}
HOT = {
    "/generate": GenerateBody,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponseRequest,
}
VALID: dict[str, dict[str, Any]] = {
    "/generate": {"input_ids": [11, 22, 33], "sampling_params": {"max_tokens": 5, "temperature": 0}},
    "/v1/completions": {"model": "tiny", "prompt": "hello there", "max_tokens": 5, "temperature": 0},
    "/v1/chat/completions": {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "temperature": 0,
    },
    "/v1/responses": {"model": "tiny", "input": "hello", "max_output_tokens": 5, "temperature": 0},
}
VOLATILE = {"id", "created", "created_at", "item_id", "request_id", "session_id"}  # random or clock-made, per request


@dataclass
class Answer:
    status: int
    body: Any
    content_type: str | None


@dataclass
class Pair:
    """A lean gateway and a stock one over the same replica, with API keys configured."""

    lean: RunningGateway
    stock: RunningGateway
    http: httpx.AsyncClient

    async def send(self, method: str, path: str, *, chunked: bytes | None = None, **kw: Any) -> Answer:
        """Send the same request to both; assert identical answers; return the answer. `chunked`: a body sent in
        chunks, without a content-length."""
        answers = []
        for gateway in (self.lean, self.stock):
            if chunked is not None:
                kw["content"] = _chunks(chunked)
            answers.append(await _answer(self.http, method, f"{gateway.url}{path}", **kw))
        lean, stock = answers
        assert lean == stock, f"{method} {path} {kw}"
        return lean


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    for i in range(0, len(body), 16 * 1024):
        yield body[i : i + 16 * 1024]


async def _answer(http: httpx.AsyncClient, method: str, url: str, **kw: Any) -> Answer:
    response = await http.request(method, url, **kw)
    content_type = response.headers.get("content-type")
    media_type = (content_type or "").partition(";")[0]
    if media_type == "text/event-stream":
        events = [e for e in response.text.split("\n\n") if e]
        body: Any = [_event_data(e) for e in events]
    elif media_type == "application/json":
        body = _normalized(response.json())
    else:
        body = response.text
    return Answer(response.status_code, body, content_type)


def _event_data(event: str) -> Any:
    """An event's data (the Responses API's events also name their type on an `event:` line)."""
    data = next(line[len("data: ") :] for line in event.split("\n") if line.startswith("data: "))
    return event if data == "[DONE]" else _normalized(orjson.loads(data))


def _normalized(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<volatile>" if k in VOLATILE else _normalized(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalized(v) for v in value]
    return value


@pytest.fixture
async def pair(make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient) -> Pair:
    sim = await make_sim("vllm")
    server = {"api_keys": [AGENT_KEY], "max_body_bytes": 64 * 1024, "max_tokens_limit": 64}
    lean = await make_gateway([sim], server=server, fastpath={"enabled": True})
    stock = await make_gateway([sim], server=server, fastpath={"enabled": False})
    return Pair(lean, stock, http)


def _route_classes(app: FastAPI) -> dict[str, type]:
    return {c.path: type(c.original_route) for c in iter_route_contexts(app.routes) if c.path in HOT}


async def test_the_gateways_differ_only_in_route_class(pair: Pair) -> None:
    assert _route_classes(pair.lean.app) == dict.fromkeys(HOT, OnePassRoute)
    assert _route_classes(pair.stock.app) == dict.fromkeys(HOT, APIRoute)
    routers = (generate.create_router, openai.create_router, responses.create_router)
    routes = [route for router in routers for route in router(OnePassRoute).routes]
    handlers = {r.path: r.get_route_handler().__module__ for r in routes if isinstance(r, APIRoute)}
    # GET /v1/models and /v1/responses/{id} have no body: FastAPI's handler, from the same route class.
    plain = dict.fromkeys(["/v1/models", "/v1/responses/{response_id}"], "fastapi.routing")
    assert handlers == dict.fromkeys(HOT, "gateway.fastpath.one_pass_route") | plain


async def test_the_lean_gateway_serves_its_hot_routes_in_the_fast_lane(pair: Pair) -> None:
    await pair.send("POST", "/generate", json=VALID["/generate"], headers=AUTH)
    lean, stock = (gateway.app for gateway in (pair.lean, pair.stock))
    assert isinstance(lean, GatewayApp) and isinstance(stock, GatewayApp)
    assert isinstance(lean.built_shortcut, HotRoutes) and lean.built_shortcut.paths == set(HOT)
    assert stock.built_shortcut is None  # no OnePassRoute, no lane: FastAPI serves everything


async def test_requests_are_counted_alike(pair: Pair) -> None:
    """`RequestMetrics` counts each request once, by route and status, whichever way the gateway served it."""
    for path in HOT:
        await pair.send("POST", path, json=VALID[path], headers=AUTH)
        await pair.send("POST", path, json=VALID[path] | {"stream": True}, headers=AUTH)
        await pair.send("POST", path, json=VALID[path], headers={})
        await pair.send("POST", path, content=b"{not json", headers=AUTH | JSON)
        await pair.send("POST", path, json=VALID[path] | _over_the_token_limit(path), headers=AUTH)
        await pair.send("POST", path, json=VALID[path] | {"user": "x" * 70_000}, headers=AUTH)
        await pair.send("POST", path, chunked=json.dumps(VALID[path]).encode(), headers=AUTH | JSON)
        await pair.send("GET", path, headers=AUTH)
    counts = []
    for gateway in (pair.lean, pair.stock):
        samples = await scrape(pair.http, gateway.url)
        counts.append({labels: v for (name, labels), v in samples.items() if name == "rollout_gateway_requests_total"})
    lean, stock = counts
    assert lean == stock
    assert {dict(labels)["status"] for labels in lean} >= {"200", "400", "401", "405", "413"}


async def test_the_openapi_schema_is_byte_identical(pair: Pair) -> None:
    lean, stock = [await pair.http.get(f"{gw.url}/openapi.json") for gw in (pair.lean, pair.stock)]
    assert lean.status_code == 200 and lean.content == stock.content
    assert set(HOT) <= set(lean.json()["paths"])


@pytest.mark.parametrize("path", list(HOT))
@pytest.mark.parametrize("stream", [False, True])
async def test_valid_requests(pair: Pair, path: str, stream: bool) -> None:
    body = VALID[path] | {"stream": stream}
    answer = await pair.send("POST", path, json=body, headers=AUTH)
    assert answer.status == 200
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
        same = await pair.send(
            "POST", path, content=json.dumps(body).encode(), headers=AUTH | {"content-type": content_type}
        )
        assert same == answer


def _bodies(path: str) -> list[bytes]:
    valid = VALID[path]
    first = next(iter(valid))
    return [
        b"{not json",
        b"{",
        b'{"a": 1,}',
        json.dumps(valid).encode() + b"x",
        b'{"x": "\xff"}',  # invalid UTF-8: the standard library's decode error, not a JSON error
        codecs.BOM_UTF8 + json.dumps(valid).encode(),  # pydantic refuses the BOM, the standard library accepts it
        json.dumps(valid).encode("utf-16"),  # and UTF-16
        json.dumps(valid).replace('"', '"\\ud800', 1).encode(),  # a lone surrogate: pydantic refuses it
        json.dumps(valid)[:-1].encode() + b', "user": "\\udc00"}',
        json.dumps(valid)[:-1].encode() + b', "seed": ' + b"9" * 5000 + b"}",  # over Python's 4300 digits
        b'{"a": ' + b"[" * 300 + b"]" * 300 + b"}",  # deeper than pydantic's limit, within the standard library's
        b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # deeper than the standard library's
        b"null",
        b"[]",
        b'"text"',
        b"1",
        b"{}",
        json.dumps({k: v for k, v in valid.items() if k != first}).encode(),  # a required field missing
        json.dumps(valid | {"bogus": 1}).encode(),  # extra="forbid"
        json.dumps(valid | {first: "not the type"}).encode(),
        json.dumps(valid | {first: None}).encode(),
        json.dumps(valid | {"temperature": "0"}).encode(),
        json.dumps(valid | {"stream": "yes"}).encode(),
        (json.dumps(valid)[:-1] + ', "temperature": NaN}').encode(),
        (json.dumps(valid)[:-1] + ', "temperature": Infinity}').encode(),
        (json.dumps(valid)[:-1] + ', "temperature": 0.5, "temperature": 0}').encode(),  # duplicate keys
        json.dumps(valid | _over_the_token_limit(path)).encode(),  # refused by the route itself
    ]


def _over_the_token_limit(path: str) -> dict[str, Any]:
    if path == "/generate":
        return {"sampling_params": {"max_tokens": 10**6}}
    if path == "/v1/responses":
        return {"max_output_tokens": 10**6}
    return {"max_tokens": 10**6}


@pytest.mark.parametrize("path", list(HOT))
async def test_bodies_fastapi_refuses_or_parses_its_way(pair: Pair, path: str) -> None:
    for body in _bodies(path):
        await pair.send("POST", path, content=body, headers=AUTH | JSON)


@pytest.mark.parametrize("path", list(HOT))
async def test_content_types_and_empty_bodies(pair: Pair, path: str) -> None:
    valid = json.dumps(VALID[path]).encode()
    content_types = [
        None,
        "",
        "text/plain",
        "text/json",
        "application/jsonx",
        "application/x-json",
        "application/json/x",
        "application/",
        "application/+json",
        "application/json ; charset=utf-8",
        "APPLICATION/VND.API+JSON; q=1",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
    ]
    for content_type in content_types:
        headers = AUTH if content_type is None else AUTH | {"content-type": content_type}
        answers = [await pair.send("POST", path, content=body, headers=headers) for body in (valid, b"")]
        assert all(a.status in (200, 400) for a in answers)


@pytest.mark.parametrize("path", list(HOT))
async def test_auth_is_checked_where_fastapi_checks_it(pair: Pair, path: str) -> None:
    valid = json.dumps(VALID[path]).encode()
    for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": f"Basic {AGENT_KEY}"}, {"authorization": ""}):
        # FastAPI parses the body before it runs dependencies, and validates it after them.
        for body in (valid, b"{not json", b"{}", b""):
            answer = await pair.send("POST", path, content=body, headers=auth | JSON)
            assert answer.status in (400, 401, 403)


async def test_methods_sizes_and_streamed_bodies(pair: Pair) -> None:
    for path in HOT:
        assert (await pair.send("GET", path, headers=AUTH)).status == 405
        big = json.dumps(VALID[path] | {"user": "x" * 70_000}).encode()
        assert (await pair.send("POST", path, content=big, headers=AUTH | JSON)).status == 413
        # Without a content-length, the body limit fails the read itself (no declared size to refuse up front).
        for body in (big, json.dumps(VALID[path]).encode()):
            await pair.send("POST", path, chunked=body, headers=AUTH | JSON)
    await pair.send("GET", "/v1/models", headers=AUTH)


def generate_scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    """The ASGI scope of a `POST /generate` with these headers, for calling a gateway's app directly."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/generate",
        "raw_path": b"/generate",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


@pytest.mark.parametrize("declared", [False, True])
async def test_a_client_gone_before_its_body_arrived(pair: Pair, declared: bool) -> None:
    async def call(app: Any) -> list[Any]:
        incoming = [{"type": "http.request", "body": b'{"input_', "more_body": True}, {"type": "http.disconnect"}]
        sent: list[Any] = []

        async def receive() -> Any:
            return incoming.pop(0) if incoming else {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            sent.append(message)

        headers = [(b"content-type", b"application/json"), (b"authorization", AUTH["authorization"].encode())]
        if declared:  # the fast lane reads the body itself
            headers.append((b"content-length", b"100"))
        scope = generate_scope(headers)
        await app(scope, receive, send)
        return sent

    assert await call(pair.lean.app) == await call(pair.stock.app)


async def test_a_request_cancelled_while_its_body_is_read_is_counted_alike(pair: Pair) -> None:
    """A server shutting down past its grace period cancels requests wherever they are, the body read included."""

    async def cancelled_mid_body(app: Any) -> None:
        started = asyncio.Event()

        async def receive() -> Any:
            if not started.is_set():
                started.set()
                return {"type": "http.request", "body": b'{"input_', "more_body": True}
            await asyncio.Event().wait()  # the rest of the body never comes

        async def send(message: Any) -> None:
            raise AssertionError(f"nothing is sent: {message}")

        headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
        headers.append((b"authorization", AUTH["authorization"].encode()))
        scope = generate_scope(headers)
        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(started.wait(), 5)  # set in the first receive: the app now waits in the second
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    counts = []
    for gateway in (pair.lean, pair.stock):
        await cancelled_mid_body(gateway.app)
        samples = await scrape(pair.http, gateway.url)
        counts.append({labels: v for (name, labels), v in samples.items() if name == "rollout_gateway_requests_total"})
    assert counts[0] == counts[1]
    assert counts[0][(("route", "/generate"), ("status", "499"))] == 1


async def test_a_client_gone_mid_body_is_counted_alike(pair: Pair) -> None:
    """Over a real connection: a client that leaves before the body is whole is still a request the app counts,
    in the hot routes as in FastAPI's stack."""
    body = orjson.dumps(VALID["/generate"])
    head = b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    head += b"authorization: %s\r\ncontent-length: %d\r\n\r\n" % (AUTH["authorization"].encode(), len(body))
    counts = []
    for gateway in (pair.lean, pair.stock):
        host, port = gateway.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body[:10])
        await writer.drain()
        await until_a_request_is_in(gateway.server, "/generate")  # the server has the head and part of the body
        writer.close()
        for _ in range(100):
            samples = await scrape(pair.http, gateway.url)
            count = {labels: v for (name, labels), v in samples.items() if name == "rollout_gateway_requests_total"}
            if any(dict(labels)["route"] == "/generate" for labels in count):
                break
            await asyncio.sleep(0.02)
        counts.append(count)
    assert counts[0] == counts[1]
    # FastAPI's answer to a body it could not read, counted though nobody is left to read it.
    assert counts[0] == {(("route", "/generate"), ("status", "400")): 1}


async def test_dependency_overrides_are_honoured(pair: Pair) -> None:
    async def deny(request: Request) -> None:
        raise Forbidden("overridden")

    for gateway in (pair.lean, pair.stock):
        gateway.app.dependency_overrides[deps.require_agent] = deny
    try:
        answer = await pair.send("POST", "/generate", json=VALID["/generate"], headers=AUTH)
        assert answer.status == 403 and answer.body["error"]["message"] == "overridden"
    finally:
        for gateway in (pair.lean, pair.stock):
            gateway.app.dependency_overrides.clear()


# -- the lean handler on other shapes and settings, in process -------------------------------------------------


class Item(BaseModel):
    name: str
    size: int = 0


async def _tag(request: Request) -> str:
    return request.headers.get("x-tag", "none")


def _toy_app(route_class: type[APIRoute], strict_content_type: bool) -> FastAPI:
    """Routes of the lean shape and of others (a path parameter, a dict return, no request), on a router that
    may or may not require a content type."""
    router = APIRouter(route_class=route_class, strict_content_type=strict_content_type)

    async def lean(item: Item, request: Request, tag: str = Depends(_tag)) -> Response:
        return Response(f"{item.name}/{item.size}/{tag}/{request.method}")

    async def with_path(item: Item, request: Request, key: int) -> Response:
        return Response(f"{item.name}/{key}")

    async def returns_dict(item: Item, request: Request) -> dict[str, Any]:
        return {"name": item.name}

    async def no_request(item: Item) -> Response:
        return Response(item.name)

    router.add_api_route("/lean", lean, methods=["POST"])
    router.add_api_route("/path/{key}", with_path, methods=["POST"])
    router.add_api_route("/dict", returns_dict, methods=["POST"])
    router.add_api_route("/no-request", no_request, methods=["POST"])
    app = FastAPI()
    app.include_router(router)
    return app


@pytest.mark.parametrize("strict", [True, False])
async def test_other_shapes_and_lax_content_types(strict: bool) -> None:
    apps = [_toy_app(OnePassRoute, strict), _toy_app(APIRoute, strict)]
    clients = [httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://toy") for a in apps]
    try:
        for path in ("/lean", "/path/7", "/path/x", "/dict", "/no-request"):
            for body in (b'{"name": "a", "size": 2}', b'{"name": 1}', b"{", b""):
                for headers in ({}, JSON, {"content-type": "text/plain"}, {"x-tag": "t"} | JSON):
                    lean, stock = [await c.post(path, content=body, headers=headers) for c in clients]
                    assert (lean.status_code, lean.content) == (stock.status_code, stock.content), (path, body, headers)
    finally:
        for client in clients:
            await client.aclose()


class Outcome(BaseModel):
    outcome: str


async def _outcome(body: Outcome, request: Request) -> Response:
    """Each way an endpoint can end, by name."""
    match body.outcome:
        case "crash":
            raise RuntimeError("an unexpected error")
        case "invalid":
            raise InvalidRequest("not like that", param="outcome")
        case "http":
            raise HTTPException(409, "taken")
        case "gone":
            raise ClientDisconnected("client disconnected")
        case "stream-crash":

            async def events() -> AsyncIterator[bytes]:
                yield b"data: 1\n\n"
                raise RuntimeError("failed while streaming")

            async def nothing() -> None:
                pass

            return GuardedStreamingResponse(events(), nothing, media_type="text/event-stream")
    return Response(body.outcome)


def _toy_gateway(route_class: type[APIRoute]) -> GatewayApp:
    """The gateway's app shape (its middlewares and error handlers) around one endpoint that ends as asked."""
    app = GatewayApp()
    app.shortcut_factory = HotRoutes.of  # as `create_app` wires it
    install_error_handlers(app)
    router = APIRouter(route_class=route_class)
    router.add_api_route("/outcome", _outcome, methods=["POST"])
    app.include_router(router)
    app.add_middleware(BodySizeLimit, max_bytes=1024)
    app.add_middleware(RequestMetrics)
    return app


async def test_errors_end_requests_alike_in_and_out_of_the_fast_lane(caplog: pytest.LogCaptureFixture) -> None:
    lane_app, stock_app = _toy_gateway(OnePassRoute), _toy_gateway(APIRoute)
    for raising in (False, True):
        clients = [
            httpx.AsyncClient(transport=httpx.ASGITransport(app=a, raise_app_exceptions=raising), base_url="http://t")
            for a in (lane_app, stock_app)
        ]
        try:
            for outcome in ("fine", "crash", "invalid", "http", "gone", "stream-crash"):
                answers: list[Any] = []
                for client in clients:
                    try:
                        response = await client.post("/outcome", json={"outcome": outcome})
                        answers.append((response.status_code, response.headers.get("content-type"), response.content))
                    except RuntimeError as exc:  # the app re-raised it to the server, after answering 500
                        answers.append(("raised", str(exc)))
                assert answers[0] == answers[1], (outcome, raising)
                assert raising or answers[0][0] == {"fine": 200, "invalid": 400, "http": 409, "gone": 499}.get(
                    outcome, answers[0][0]
                )
        finally:
            for client in clients:
                await client.aclose()
    assert isinstance(lane_app.built_shortcut, HotRoutes) and lane_app.built_shortcut.paths == {"/outcome"}
    assert stock_app.built_shortcut is None


# -- the two shortcuts ------------------------------------------------------------------------------------------


def _fastapi_json_rule(content_type: str) -> bool:
    """FastAPI's own check, as `get_request_handler` writes it."""
    message = email.message.Message()
    message["content-type"] = content_type
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


_PIECES = ["application", "APPLICATION", "Application", "json", "JSON", "/", "+", ";", "vnd.x", "charset=utf-8", " "]
_PIECES += ["\t", "\x85", "\xa0", "\x0b", "=", '"', "x", "text", "/json", "+json", ";json", ""]


@given(st.lists(st.sampled_from(_PIECES) | st.text(st.characters(max_codepoint=255), max_size=3), max_size=8))
@settings(max_examples=1500, deadline=None)
def test_content_type_rule_is_fastapis(pieces: list[str]) -> None:
    content_type = "".join(pieces)
    assert is_json_content_type(content_type) == _fastapi_json_rule(content_type), repr(content_type)


_JSON_PIECES = ["{", "}", "[", "]", ",", ":", '"', "\\", "\\u", "d800", "dc00", "0041", "NaN", "Infinity", "-"]
_JSON_PIECES += ["1", "0", "e", "E", ".", "+", "9" * 400, "true", "null", " ", "\t", "\n", "\r", "\x0c", "\x00"]
_JSON_PIECES += ["\x1f", "\x7f", "\ufeff", "\u2028", "é", "\U0001f600", '"a"', '"a":', "1e400", "-0", "01"]
_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(st.characters(codec="utf-8"), max_size=6),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=4),
    max_leaves=12,
)
_ANY = TypeAdapter(Any)


def _mutated_json() -> st.SearchStrategy[bytes]:
    """JSON texts, broken or stretched at random places with the pieces parsers disagree on."""

    @st.composite
    def build(draw: st.DrawFn) -> bytes:
        text = json.dumps(draw(_JSON_VALUES), ensure_ascii=draw(st.booleans()))
        for _ in range(draw(st.integers(0, 3))):
            at = draw(st.integers(0, len(text)))
            text = text[:at] + draw(st.sampled_from(_JSON_PIECES)) + text[at:]
        raw = text.encode("utf-8", "surrogatepass")
        return draw(st.sampled_from([raw, raw + b"\xff", codecs.BOM_UTF8 + raw, raw[: len(raw) // 2]]))

    return build()


@given(_mutated_json())
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_pydantic_json_accepts_nothing_the_standard_library_refuses(body: bytes) -> None:
    try:
        parsed = _ANY.validate_json(body)
    except ValidationError:
        return  # FastAPI's handler decides
    assert repr(parsed) == repr(json.loads(body))


def _request_bodies() -> st.SearchStrategy[tuple[type[BaseModel], bytes]]:
    """Valid bodies of the hot routes with fields replaced or added, values of every JSON type."""
    values = _JSON_VALUES | st.sampled_from([0, 1, 1.0, 2.5, -1, 10**20, "1", "true", "", [1, 2], [1.0], {"a": 1}])

    @st.composite
    def build(draw: st.DrawFn) -> tuple[type[BaseModel], bytes]:
        path = draw(st.sampled_from(list(HOT)))
        body = dict(VALID[path])
        for _ in range(draw(st.integers(0, 3))):
            fields = list(HOT[path].model_fields)
            body[draw(st.sampled_from(fields))] = draw(values)
        return HOT[path], json.dumps(body).encode()

    return build()


@given(_request_bodies())
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_json_validation_builds_the_model_fastapi_builds(case: tuple[type[BaseModel], bytes]) -> None:
    model, body = case
    try:
        lean = model.model_validate_json(body)
    except ValidationError:
        return  # FastAPI's handler decides
    stock = TypeAdapter(model).validate_python(json.loads(body), from_attributes=True)
    assert repr(lean) == repr(stock)


@given(st.binary(max_size=300))
def test_a_json_answer_is_starlettes_json_response(body: bytes) -> None:
    ours, theirs = JSONAnswer(body), Response(body, media_type="application/json")
    assert (ours.status_code, ours.raw_headers, ours.body, ours.background) == (
        theirs.status_code,
        theirs.raw_headers,
        theirs.body,
        theirs.background,
    )
