"""Request limits: the body size (an ASGI middleware, before a body is parsed) and the configured bounds on
what a parsed request may ask for (message count, max_tokens). Each refusal is a 4xx naming the field."""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.config import ServerConfig
from gateway.errors import InvalidRequest


def check_messages(count: int, server: ServerConfig) -> None:
    if count > server.max_messages:
        raise InvalidRequest(
            f"{count} messages exceed the limit of {server.max_messages} (server.max_messages)",
            param="messages",
            code="too_many_messages",
        )


def check_max_tokens(value: int | None, param: str, server: ServerConfig) -> None:
    if value is not None and value > server.max_tokens_limit:
        raise InvalidRequest(
            f"{param} = {value} exceeds the limit of {server.max_tokens_limit} (server.max_tokens_limit)",
            param=param,
            code="max_tokens_limit",
        )


class BodySizeLimit:
    """Answer 413 (OpenAI-style error) to a body over `max_bytes`, whether it declares its length or streams.

    A declared length over the limit is refused before a byte is read (the server reads no more than it declares).
    A chunked body is read here, up to the limit, before the app sees it, then handed on whole: refusing it from
    inside the app's body parsing came out as FastAPI's 400 "There was an error parsing the body".
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        if declared is not None or b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            await self.app(scope, receive, send)
            return
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: the app sees it at its first read
                break
            parts.append(message.get("body", b""))
            size += len(parts[-1])
            if size > self.max_bytes:
                await self._refuse(send)
                return
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(parts), "more_body": False}
                break
        await self.app(scope, _replaying(message, receive), send)

    async def _refuse(self, send: Send) -> None:
        body = orjson.dumps(
            {
                "error": {
                    "message": f"request body exceeds {self.max_bytes} bytes",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _replaying(first: Message, receive: Receive) -> Receive:
    """A `receive` that answers `first`, then the server's own (a disconnect, later)."""
    pending: list[Message] = [first]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay
