"""The published OpenAPI schema and the validation agree (issue 38 §15: schemathesis found `return_routed_experts: 0`,
`reward: false`, `max_tokens: "10"` / `true` and token ids `true` / `"1"` / `1.0` accepted by lax coercion, while
`prompt: []` and a tool message without content were refused though the schema allowed them). Request bodies are
strict: a JSON value of another type is a 400 naming the field. One exception, which the schema states: an integral
float is an integer (JSON Schema's `type: integer` holds `1.0`), taken as the integer it is (issue 52 §12;
tests/gateway/api/test_integral_floats.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import ADMIN, GatewayFactory, SimFactory

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
COERCED: list[tuple[str, str, dict[str, Any], str]] = [
    ("/generate", "return_routed_experts", {**GENERATE, "return_routed_experts": 0}, "return_routed_experts"),
    ("/generate", "max_tokens string", {**GENERATE, "sampling_params": {"max_tokens": "10"}}, "max_tokens"),
    ("/generate", "max_tokens bool", {**GENERATE, "sampling_params": {"max_tokens": True}}, "max_tokens"),
    ("/generate", "token id bool", {**GENERATE, "input_ids": [1, True]}, "input_ids"),
    ("/generate", "token id string", {**GENERATE, "input_ids": [1, "1"]}, "input_ids"),
    # `1.0` was here too, refused as lax coercion; but JSON Schema calls it the integer 1, as the published schema's
    # `type: integer` does, so it is now taken as 1 (issue 52 §12). A fraction is no integer in either.
    ("/generate", "token id fraction", {**GENERATE, "input_ids": [1, 1.5]}, "input_ids"),
    ("/v1/chat/completions", "max_tokens string", {**CHAT, "max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", "stream int", {**CHAT, "stream": 1}, "stream"),
    ("/v1/completions", "prompt id bool", {"model": "tiny", "prompt": [1, False]}, "prompt"),
    ("/v1/sessions/s/finish", "reward bool", {"reward": False}, "reward"),
]


@pytest.mark.parametrize(("path", "case", "body", "param"), COERCED, ids=[f"{c[0]} {c[1]}" for c in COERCED])
async def test_a_value_of_another_json_type_is_a_400(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    path: str,
    case: str,
    body: dict[str, Any],
    param: str,
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    if path.startswith("/v1/sessions/"):
        await http.post(f"{gw.url}/v1/sessions", json={"session_id": "s"})
    response = await http.post(f"{gw.url}{path}", json=body, headers=ADMIN)
    assert response.status_code == 400, (case, response.text)
    assert param in response.json()["error"]["param"], response.json()


async def test_the_schema_says_what_the_validation_refuses(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    schemas = (await http.get(f"{gw.url}/openapi.json")).json()["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert {"minItems": 1}.items() <= next(b for b in prompt if b.get("type") == "array").items()
    needs = schemas["ChatMessage"]["allOf"]
    assert any("tool" in rule["if"]["properties"]["role"].get("enum", []) for rule in needs)
    empty = await http.post(f"{gw.url}/v1/completions", json={"model": "tiny", "prompt": []})
    assert empty.status_code == 400


def integer_schemas(node: Any) -> list[dict[str, Any]]:
    """Every schema of the document that says `type: integer`."""
    if isinstance(node, list):
        return [found for item in node for found in integer_schemas(item)]
    if not isinstance(node, dict):
        return []
    here = [node] if node.get("type") == "integer" else []
    return here + [found for value in node.values() for found in integer_schemas(value)]


async def test_integer_bounds_are_published_as_the_integers_the_validation_takes(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Issue 52 §12: FastAPI's OpenAPI model writes every bound as a float, so `seed`'s maximum 2**63 - 1 was
    published as 2.0**63, a seed the validation refuses. The bounds of integer schemas are integers, exact."""
    gw = await make_gateway([await make_sim("vllm")])
    schemas = (await http.get(f"{gw.url}/openapi.json")).json()["components"]["schemas"]  # the stdlib's floats
    seeds = [
        s for name in ("ChatCompletionRequest", "ResponseRequest") for s in schemas[name]["properties"]["seed"]["anyOf"]
    ]
    assert [(s["minimum"], s["maximum"]) for s in seeds if s.get("type") == "integer"] == [(-(2**63), 2**63 - 1)] * 2
    bounds = [(key, s[key]) for s in integer_schemas(schemas) for key in ("minimum", "maximum") if key in s]
    assert bounds and all(type(value) is int for _, value in bounds), [b for b in bounds if type(b[1]) is not int]
    over = await http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "seed": 2**63})
    assert over.status_code == 400 and over.json()["error"]["param"] == "seed"


async def test_an_integral_float_the_schema_calls_an_integer_is_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Issue 52 §12: the schema says `type: integer` (with its bounds) for token ids, a weight version, a budget; JSON
    Schema holds `1.0` and `650644.0` to be such integers, and so does the validation now (it refused them)."""
    gw = await make_gateway([await make_sim("vllm")])
    schemas = (await http.get(f"{gw.url}/openapi.json")).json()["components"]["schemas"]
    assert schemas["GenerateBody"]["properties"]["input_ids"]["items"] == {"type": "integer", "minimum": 0}
    assert schemas["WeightsUpdate"]["properties"]["version"]["type"] == "integer"
    assert schemas["GenerateSampling"]["properties"]["max_tokens"]["type"] == "integer"
    body = {**GENERATE, "input_ids": [1, 1.0], "sampling_params": {"max_tokens": 2.0}}
    assert (await http.post(f"{gw.url}/generate", json=body)).status_code == 200
    update = {"version": 650644.0, "source": "external"}
    assert (await http.post(f"{gw.url}/admin/weights", json=update, headers=ADMIN)).status_code == 200
