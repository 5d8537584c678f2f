"""An integral float is an integer (issue 52 §12): JSON Schema calls `650644.0` an integer, and the published schema
says `type: integer`, yet `version: 650644.0` and the like were 400s. Every integer field of every route takes a float
with no fractional part, as the integer it is, through one rule (`gateway.api.bounds.integral`); fractions, bools,
strings and floats past 2**53 (which no longer say which integer they are) stay 400s naming the field. Real
simulator, real gateway, real Redis; the hot routes through the fast lane."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

import gateway.api
from gateway.api.bounds import MAX_EXACT_INTEGER, IntegralItems, integral
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
VARYING = {"id", "created", "created_at", "rollout", "request_id", "session_id"}
MESSAGES = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def _request_models() -> list[type[BaseModel]]:
    """Every pydantic model of the API layer (request bodies and their parts)."""
    for module in pkgutil.walk_packages(gateway.api.__path__, "gateway.api."):
        importlib.import_module(module.name)
    found: list[type[BaseModel]] = []
    pending = list(BaseModel.__subclasses__())
    while pending:
        model = pending.pop()
        pending.extend(model.__subclasses__())
        if model.__module__.startswith("gateway.api.") and model not in found:
            found.append(model)
    return found


def _bare_integers(node: Any, path: str) -> list[str]:
    """Where a core schema validates an `int` other than through the integral-float rule."""
    if isinstance(node, list):
        return [bare for i, item in enumerate(node) for bare in _bare_integers(item, f"{path}[{i}]")]
    if not isinstance(node, dict):
        return []
    function = node.get("python_schema", node).get("function")  # a validator, or a JSON-or-Python choice's
    if isinstance(function, dict) and function.get("function") in (integral, IntegralItems.validate):
        return []  # the rule's own validators: the integers under them take integral floats
    if node.get("type") == "int":
        return [path]
    return [bare for key, value in node.items() for bare in _bare_integers(value, f"{path}.{key}")]


def test_every_integer_of_a_request_body_takes_integral_floats() -> None:
    """Not a list of fields kept by hand: a model or field added later without the rule fails here."""
    models = _request_models()
    assert len(models) > 20, [m.__name__ for m in models]
    bare = [f"{m.__module__}.{m.__name__}" for m in models if _bare_integers(m.__pydantic_core_schema__, "")]
    assert bare == []


@pytest.mark.parametrize(
    ("value", "expected"),
    [(3.0, 3), (-0.0, 0), (1e3, 1000), (float(MAX_EXACT_INTEGER), MAX_EXACT_INTEGER), (7, 7), (True, True)],
)
def test_the_rule_converts_exactly_and_passes_anything_else_on(value: Any, expected: Any) -> None:
    converted = integral(value)
    assert converted == expected and type(converted) is type(expected)


@pytest.mark.parametrize("value", [2.5, float(MAX_EXACT_INTEGER + 1), -(2.0**60), 1e300])
def test_the_rule_refuses_a_fraction_and_a_float_that_stands_for_several_integers(value: float) -> None:
    with pytest.raises(ValueError, match="integer"):
        integral(value)


def _floats(body: Any) -> Any:
    """`body` with every integer (not bool) written as a float."""
    if isinstance(body, dict):
        return {key: _floats(value) for key, value in body.items()}
    if isinstance(body, list):
        return [_floats(item) for item in body]
    return float(body) if type(body) is int else body


ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 3, "seed": 5, "n": 1, "top_k": 4, "stop_token_ids": [7]}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2}),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3, "logprobs": 1, "min_tokens": 1}),
    ("/generate", generate_body([5, 6, 7], 3, sampling={"top_k": 4, "stop_token_ids": [9], "top_logprobs": 1})),
    ("/generate", generate_body([5, 6, 7], 3, session_id="floats", sampling={"seed": 11})),
    ("/v1/messages", {**MESSAGES, "max_tokens": 3, "top_k": 4, "thinking": {"type": "enabled", "budget_tokens": 2}}),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 3, "seed": 5, "min_tokens": 1}),
]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[f"{p} {i}" for i, (p, _) in enumerate(ROUTES)])
async def test_integral_floats_answer_as_their_integers_on_every_route(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    """The same answer for the body written with integers and with integral floats (the ids sampled, the finish)."""
    gw = await make_gateway([await make_sim("vllm")], fastpath={"enabled": True})
    answers = []
    for written in (body, _floats(body)):
        if "session_id" in written:
            written = written | {"session_id": f"{written['session_id']}-{len(answers)}"}
        response = await http.post(f"{gw.url}{path}", json=written)
        assert response.status_code == 200, (written, response.text)
        answer = response.json()
        answers.append((_steady(answer), _sampled_ids(answer)))
    assert answers[0] == answers[1]
    if path == "/generate" and "session_id" in body:  # the turn is stored with integer ids
        [sample] = await gw.services.store.load_samples("floats-1")
        assert sample.prompt_ids.tolist()[:3] == [5, 6, 7]


def _steady(answer: Any) -> Any:
    """`answer` without what differs between any two answers (ids, times, the rollout field)."""
    if isinstance(answer, dict):
        return {key: _steady(value) for key, value in answer.items() if key not in VARYING}
    if isinstance(answer, list):
        return [_steady(item) for item in answer]
    return answer


def _sampled_ids(answer: dict[str, Any]) -> Any:
    rollout = answer.get("rollout")
    if rollout is None:
        return answer.get("output_ids")
    return [choice.get("output_ids") for choice in rollout.get("choices", [])]


async def test_a_weight_version_written_as_a_float_is_that_version(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    update = await http.post(f"{gw.url}/admin/weights", json={"version": 650644.0, "source": "external"}, headers=ADMIN)
    assert update.status_code == 200, update.text
    assert update.json()["version"] == 650644 and gw.services.weights.version == 650644
    assert type(gw.services.weights.version) is int
    fraction = await http.post(
        f"{gw.url}/admin/weights", json={"version": 650645.5, "source": "external"}, headers=ADMIN
    )
    assert fraction.status_code == 400 and fraction.json()["error"]["param"] == "version"


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2.5}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "seed": 2.0**60}, "seed"),  # integral, but 2**60 + 1 arrives as it too
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [7.5]}, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": [5, 6.5], "max_tokens": 2}, "prompt"),
    ("/generate", generate_body([5, 6.5], 2), "input_ids"),
    ("/generate", generate_body([5, 6], 2, sampling={"max_tokens": True}), "sampling_params.max_tokens"),
    ("/v1/messages", {**MESSAGES, "max_tokens": 3.25}, "max_tokens"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": "3"}, "max_output_tokens"),
    ("/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2.0**31}, "max_output_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[f"{p} {f}" for p, _, f in REFUSED])
async def test_a_fraction_a_bool_a_string_or_an_inexact_float_is_still_a_400(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    param: str,
) -> None:
    gw = await make_gateway([await make_sim("vllm")], fastpath={"enabled": True})
    response = await http.post(f"{gw.url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"] if path != "/v1/messages" else response.json()
    assert param in str(error), error
