"""`JSONAnswer`: a 200 answer of JSON the route has already encoded (orjson), built without Starlette's header logic;
`model_json`: JSON the model wrote, decoded so that orjson encodes it back as written."""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import Response

__all__ = ["JSONAnswer", "json_answer", "model_json"]

# orjson encodes integers from -2**63 to 2**64 - 1 and raises TypeError beyond: a 500 on an answer.
_ORJSON_INT_MIN, _ORJSON_INT_MAX = -(2**63), 2**64 - 1


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


def model_json(text: str) -> Any:
    """The JSON value of `text`, a model's output the parser found to be JSON (a tool call's arguments), to be
    answered inside orjson-encoded content. An integer orjson cannot encode (a policy in RL writes 2,000 digits)
    stays its text, which JSON's grammar makes the integer's one form, as the stdlib would encode it: the client
    reads the number the model wrote, whatever its size."""
    return json.loads(text, parse_int=_integer)


def _integer(text: str) -> int | orjson.Fragment:
    # 21 characters hold every integer orjson encodes; a longer text is not converted at all (int() of thousands of
    # digits is quadratic, and refused past Python's 4,300-digit limit).
    if len(text) <= 21 and _ORJSON_INT_MIN <= (value := int(text)) <= _ORJSON_INT_MAX:
        return value
    return orjson.Fragment(text)
