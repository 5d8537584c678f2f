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


class BodyTooLarge(Exception):
    pass


class BodySizeLimit:
    """Answer 413 (OpenAI-style error) to a body over `max_bytes`, whether it declares its length or streams."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge
            return message

        started = False

        async def tracking(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, tracking)
        except BodyTooLarge:
            if not started:
                await self._refuse(send)

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
