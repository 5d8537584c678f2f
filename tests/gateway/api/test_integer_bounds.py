"""Integers the engines cannot take are a 400 naming the field, on every route (issue 38 §4: `seed` 2**64 was a
500 `TypeError` from the engine adapter, and streamed, a 200 with a role chunk then a dropped connection); an error
after a stream started ends it with an error event, and the turn is recorded as cancelled, its tokens kept. Real
simulator, real gateway, real Redis."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body, slow

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
TOO_BIG = {"seed": 2**64, "top_k": 2**31, "min_tokens": 2**63, "stop_token_ids": [2**64], "max_tokens": 2**31}


@pytest.mark.parametrize("field", sorted(TOO_BIG))
@pytest.mark.parametrize("route", ["chat", "completions", "generate"])
async def test_an_integer_beyond_the_engines_range_is_a_400_naming_it(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, field: str, route: str
) -> None:
    """Streamed requests, which went out as a 200 before the engine adapter failed: the body is checked first."""
    gw = await make_gateway([await make_sim("vllm")])
    stream = True
    value = TOO_BIG[field]
    if route == "generate":
        body = generate_body([1, 2, 3], 2, stream=stream)
        body["sampling_params"][field] = value
        path, param = "/generate", f"sampling_params.{field}"
    else:
        body = {**(CHAT if route == "chat" else COMPLETION), field: value, "stream": stream}
        path, param = ("/v1/chat/completions" if route == "chat" else "/v1/completions"), field
    response = await http.post(f"{gw.url}{path}", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param), error


async def test_the_largest_seed_works_for_every_choice(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The seed of choice i is the request's seed + i, wrapped into the signed 64-bit range the engines take."""
    gw = await make_gateway([await make_sim("vllm")])
    for seed in (2**63 - 1, -(2**63)):
        response = await http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "seed": seed, "n": 3})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 3


async def test_a_stream_cut_by_an_error_ends_with_an_error_event_and_records_a_cancelled_turn(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim(*slow("vllm", delay=0.01))
    gw = await make_gateway([sim], generation={"request_timeout_s": 0.3})
    body: dict[str, Any] = {**CHAT, "max_tokens": 2000, "stream": True}
    response = await http.post(f"{gw.url}/v1/chat/completions", json=body, headers={"X-Session-ID": "cut"})
    assert response.status_code == 200  # the head went out before the deadline
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] != "[DONE]"
    error = orjson.loads(events[-1])["error"]
    assert error["code"] == 504 and error["type"] == "timeout_error"
    [sample] = await gw.services.store.load_samples("cut")
    assert sample.cancelled and 0 < len(sample.response_ids) < 2000  # its tokens kept, never extended
    next_turn = {
        **CHAT,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
    }
    answer = await http.post(f"{gw.url}/v1/chat/completions", json=next_turn, headers={"X-Session-ID": "cut"})
    assert answer.json()["rollout"]["choices"][0]["new_sample"]
