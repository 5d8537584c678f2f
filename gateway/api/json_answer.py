"""`JSONAnswer`: a 200 answer of JSON the route has already encoded (orjson), built without Starlette's header logic."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["JSONAnswer", "json_answer"]


class JSONAnswer(Response):
    """Starlette's `Response(body, media_type="application/json")`, the same two headers in the same order, built
    directly: `Response.__init__` renders the content and works out which headers to add on every answer."""

    media_type = "application/json"

    def __init__(self, body: bytes) -> None:
        self.status_code = 200
        self.background = None
        self.body = body
        self.raw_headers = [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]


def json_answer(content: Any) -> JSONAnswer:
    """`content` encoded by orjson, as a 200 answer."""
    return JSONAnswer(orjson.dumps(content))
