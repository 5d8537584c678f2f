"""Sampling policies per API key (issue 49 §3), over real HTTP on a served gateway and the simulator: a pin reaches
the engine whatever the agent sent, a forbidden field is a 400 naming it as sent with nothing stored, the cap lowers a
budget (and gives one), each key gets its policy, a key is configured alone or as {id, key}, and each stored segment
keeps what the engine got; `min_p` and the penalties reach each engine dialect. The simulator logs the sampling fields
each request brought (`GET /sim/sampling_log`)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from backends.sim.server import SimReplica
from gateway.config import ReplicaConfig, derived_key_id
from gateway.server import RunningGateway
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import PROMPT, generate_body

USER = [{"role": "user", "content": "hi"}]
PLAIN_KEY = "sk-plain-5b1f0c9e77d24a13"
TEAM_KEY = "sk-team-a-0d6e4b2a9c8f7e11"
OTHER_KEY = "sk-other-91c3e2d4b5a6f708"


def route_body(route: str, session: str | None = None, **sampling: Any) -> tuple[str, dict[str, Any]]:
    """The path and body of a turn on `route` (its sampling fields as given; `max_tokens` 4 unless given)."""
    named = {"session_id": session} if session is not None else {}
    if route == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 4} | named | sampling
    if route == "completions":
        return "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4} | named | sampling
    if route == "messages":
        return "/v1/messages", {"model": "tiny", "messages": USER, "max_tokens": 4} | named | sampling
    if route == "responses":
        budget = {"max_output_tokens": sampling.pop("max_tokens", 4)}
        return "/v1/responses", {"model": "tiny", "input": "hi"} | budget | named | sampling
    budget = sampling.pop("max_tokens", 4)
    return "/generate", generate_body(PROMPT, budget, sampling=sampling) | named


ROUTES = ["chat", "completions", "messages", "responses", "generate"]


async def received(http: httpx.AsyncClient, sim: SimReplica) -> list[dict[str, Any]]:
    """The sampling fields of each request the simulator received, oldest first."""
    log: list[dict[str, Any]] = (await http.get(f"{sim.url}/sim/sampling_log")).json()["requests"]
    return log


async def gateway(make_sim: SimFactory, make_gateway: GatewayFactory, **sections: Any) -> tuple[RunningGateway, Any]:
    sim = await make_sim("vllm")
    return await make_gateway([sim], **sections), sim


def assert_forbidden(response: httpx.Response, param: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    message: str = error["message"]
    assert message.startswith(f"{param}: "), message
    if error["type"] == "invalid_request_error" and "param" not in error:  # Anthropic's shape: a message alone
        return message
    assert (error["param"], error["code"]) == (param, "sampling_param_forbidden"), error
    return message


async def nothing_stored(redis: Redis) -> bool:
    return not [key async for key in redis.scan_iter(match="rg:{*")]


@pytest.mark.parametrize("route", ROUTES)
async def test_a_pin_replaces_what_the_agent_sent_and_sets_what_it_left_out(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, route: str
) -> None:
    policy = {"temperature": {"pin": 0.25}, "top_p": {"pin": 0.5}, "top_k": {"pin": 7}, "seed": {"pin": 11}}
    penalties = {"min_p": 0.1, "presence_penalty": 0.3, "frequency_penalty": -0.2}  # no route but chat's takes all
    policy |= {field: {"pin": value} for field, value in penalties.items()}
    gw, sim = await gateway(make_sim, make_gateway, sampling={"default": policy})
    path, body = route_body(route, "pinned", temperature=0.9, top_p=0.8)  # the others left out
    response = await http.post(f"{gw.url}{path}", json=body)
    assert response.status_code == 200, response.text
    if route == "responses":  # the response says what it was sampled with
        assert (response.json()["temperature"], response.json()["top_p"]) == (0.25, 0.5)
    (engine,) = await received(http, sim)
    assert (engine["temperature"], engine["top_p"], engine["top_k"], engine["seed"]) == (0.25, 0.5, 7, 11)
    assert {field: engine[field] for field in penalties} == penalties
    (sample,) = await gw.services.store.load_samples("pinned")
    used = sample.segments[0].sampling
    assert used is not None and (used["temperature"], used["top_p"], used["top_k"], used["seed"]) == (0.25, 0.5, 7, 11)
    assert {field: used[field] for field in penalties} == penalties


PENALTIES = {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.25}
TAKEN = {"chat": PENALTIES, "completions": PENALTIES, "responses": {"min_p": 0.05}, "generate": PENALTIES}
"""What each route takes of `min_p` and the penalties (the Responses API has no penalties, Anthropic's none)."""


@pytest.mark.parametrize("dialect", ["vllm", "vllm-scale-out", "sglang"])
@pytest.mark.parametrize("route", list(TAKEN))
async def test_min_p_and_the_penalties_reach_each_engine_dialect_and_are_stored(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, route: str, dialect: str
) -> None:
    """vLLM's completions and `/inference/v1/generate` bodies, SGLang's `sampling_params`: each field the agent set
    arrives as sent, one left out is left out (the engine's default: null in the vLLM log, SGLang's 0.0)."""
    name, scale_out = dialect.removesuffix("-scale-out"), dialect.endswith("-scale-out")
    sim = await make_sim(name, enable_scale_out=scale_out)
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect=name, scale_out=scale_out)])
    sent = TAKEN[route]
    path, body = route_body(route, "penalised", **sent)
    assert (response := await http.post(f"{gw.url}{path}", json=body)).status_code == 200, response.text
    default = 0.0 if name == "sglang" else None
    (engine,) = await received(http, sim)
    assert {field: engine[field] for field in PENALTIES} == {field: default for field in PENALTIES} | sent
    (sample,) = await gw.services.store.load_samples("penalised")
    used = sample.segments[0].sampling
    assert used is not None and {field: used[field] for field in PENALTIES} == dict.fromkeys(PENALTIES) | sent


@pytest.mark.parametrize(
    ("route", "sent", "policy", "param"),
    [
        ("chat", {"temperature": 0.3}, {"temperature": "forbid"}, "temperature"),
        ("chat", {"max_completion_tokens": 3}, {"max_tokens": "forbid"}, "max_completion_tokens"),
        ("chat", {"n": 2}, {"n": "forbid"}, "n"),
        ("chat", {"presence_penalty": 0.5}, {"presence_penalty": "forbid"}, "presence_penalty"),
        ("completions", {"logprobs": 2}, {"top_logprobs": "forbid"}, "logprobs"),
        ("messages", {"stop_sequences": ["x"]}, {"stop": "forbid"}, "stop_sequences"),
        ("messages", {"top_k": 3}, {"top_k": "forbid"}, "top_k"),
        ("responses", {"max_tokens": 3}, {"max_tokens": "forbid"}, "max_output_tokens"),
        ("responses", {"min_p": 0.1}, {"min_p": "forbid"}, "min_p"),
        ("generate", {"seed": 5}, {"seed": "forbid"}, "sampling_params.seed"),
    ],
)
async def test_a_forbidden_field_is_a_400_naming_it_as_sent_and_nothing_is_stored(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    route: str,
    sent: dict[str, Any],
    policy: dict[str, Any],
    param: str,
) -> None:
    gw, sim = await gateway(make_sim, make_gateway, sampling={"default": policy})
    path, body = route_body(route, "refused", **sent)
    message = assert_forbidden(await http.post(f"{gw.url}{path}", json=body), param)
    assert f"sampling.default.{next(iter(policy))}" in message
    assert await nothing_stored(redis) and await received(http, sim) == []
    if route == "messages" or "max_tokens" in policy:
        return  # the budget: Anthropic's is required; the other routes' is left out below
    path, body = route_body(route, "allowed")  # the same request without the field
    assert (await http.post(f"{gw.url}{path}", json=body)).status_code == 200


async def test_a_field_sent_as_null_is_left_out(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, sim = await gateway(make_sim, make_gateway, sampling={"default": {"temperature": "forbid"}})
    path, body = route_body("responses", temperature=None)
    assert (await http.post(f"{gw.url}{path}", json=body)).status_code == 200
    assert (await received(http, sim))[0]["temperature"] == 1.0


@pytest.mark.parametrize("route", ROUTES)
async def test_the_cap_lowers_a_larger_budget_and_keeps_a_smaller_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, route: str
) -> None:
    """A budget over `server.max_tokens_limit` is lowered too, not refused: agents such as Claude Code ask for more
    than a gateway's limit, and the cap is the key's answer to that."""
    server = {"max_tokens_limit": 64}
    gw, sim = await gateway(make_sim, make_gateway, server=server, sampling={"default": {"max_tokens_cap": 5}})
    for asked in (1000, 3):
        path, body = route_body(route, max_tokens=asked)
        response = await http.post(f"{gw.url}{path}", json=body)
        assert response.status_code == 200, response.text
    assert [request["max_tokens"] for request in await received(http, sim)] == [5, 3]


@pytest.mark.parametrize("route", ["chat", "responses"])
async def test_the_cap_gives_a_budget_to_a_request_without_one(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, route: str
) -> None:
    gw, sim = await gateway(make_sim, make_gateway, sampling={"default": {"max_tokens_cap": 6}})
    path, body = route_body(route)
    body.pop("max_tokens", None)
    body.pop("max_output_tokens", None)
    assert (await http.post(f"{gw.url}{path}", json=body)).status_code == 200
    assert (await received(http, sim))[0]["max_tokens"] == 6


async def test_each_key_gets_its_policy_a_key_alone_and_an_id_and_key_alike(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    """A key given alone is named by its derived id, one given as {id, key} by its id; a key neither names gets the
    default."""
    server = {"api_keys": [PLAIN_KEY, {"id": "team-a", "key": TEAM_KEY}, OTHER_KEY]}
    sampling = {
        "default": {"temperature": {"pin": 0.5}},
        "keys": {
            derived_key_id(PLAIN_KEY): {"temperature": {"pin": 0.0}},
            "team-a": {"temperature": "forbid", "max_tokens_cap": 3},
        },
    }
    gw, sim = await gateway(make_sim, make_gateway, server=server, sampling=sampling)

    async def chat(key: str, **sent: Any) -> httpx.Response:
        path, body = route_body("chat", **sent)
        return await http.post(f"{gw.url}{path}", json=body, headers={"authorization": f"Bearer {key}"})

    assert (await chat(PLAIN_KEY, temperature=0.9)).status_code == 200
    message = assert_forbidden(await chat(TEAM_KEY, temperature=0.9), "temperature")
    assert "sampling.keys.team-a.temperature" in message and TEAM_KEY not in message
    assert (await chat(TEAM_KEY, max_tokens=10)).status_code == 200
    assert (await chat(OTHER_KEY, temperature=0.9)).status_code == 200
    plain, team, other = await received(http, sim)
    assert plain["temperature"] == 0.0
    assert (team["temperature"], team["max_tokens"]) == (1.0, 3)  # allowed: the route's default; capped
    assert (other["temperature"], other["max_tokens"]) == (0.5, 4)
    owners = {await redis.hget(key, "owner") async for key in redis.scan_iter(match="rg:{*}:meta")}
    assert owners == {derived_key_id(PLAIN_KEY).encode(), b"team-a", derived_key_id(OTHER_KEY).encode()}


async def test_each_stored_segment_keeps_what_its_turn_was_sampled_with(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Two turns of one sample, sampled differently: each turn's tokens carry their own values (the trainer reads
    them from the stored sample, as `GET /v1/sessions/{id}` shows them)."""
    gw, sim = await gateway(make_sim, make_gateway, sampling={"default": {"top_k": {"pin": 5}}})
    path, first = route_body("generate", "kept", temperature=0.0, max_tokens=3)
    answer = (await http.post(f"{gw.url}{path}", json=first)).json()
    extended = PROMPT + answer["output_ids"] + [5]
    _, second = route_body("generate", "kept", temperature=0.7, max_tokens=2, seed=3)
    second["input_ids"] = extended
    assert (await http.post(f"{gw.url}{path}", json=second)).status_code == 200
    (sample,) = await gw.services.store.load_samples("kept")
    assert sample.num_turns == 2
    by_turn = [s.sampling for s in sample.segments]
    same = {"top_p": 1.0, "top_k": 5, "stop": [], "stop_token_ids": [], "min_tokens": 0, "ignore_eos": True}
    same |= {"min_p": None, "presence_penalty": None, "frequency_penalty": None}
    assert by_turn == [
        same | {"temperature": 0.0, "seed": None, "max_tokens": 3, "top_logprobs": 0},
        same | {"temperature": 0.7, "seed": 3, "max_tokens": 2, "top_logprobs": 0},
    ]
    engine = await received(http, sim)
    assert [(r["temperature"], r["top_k"], r["seed"], r["max_tokens"]) for r in engine] == [
        (0.0, 5, None, 3),
        (0.7, 5, 3, 2),
    ]
    view = (await http.get(f"{gw.url}/v1/sessions/kept")).json()["samples"][0]
    assert [segment["sampling"] for segment in view["segments"]] == by_turn


async def test_no_secret_reaches_an_error_a_log_or_the_metrics(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    caplog.set_level(logging.DEBUG)
    server = {"api_keys": [PLAIN_KEY, {"id": "team-a", "key": TEAM_KEY}]}
    sampling = {"keys": {"team-a": {"seed": "forbid"}}}
    gw, _ = await gateway(make_sim, make_gateway, server=server, sampling=sampling)
    texts = [repr(gw.services.settings), str(gw.services.settings), gw.services.settings.model_dump_json()]
    for key in (PLAIN_KEY, TEAM_KEY):
        path, body = route_body("chat", seed=1)
        response = await http.post(f"{gw.url}{path}", json=body, headers={"authorization": f"Bearer {key}"})
        texts.append(response.text)
    assert "sampling_param_forbidden" in texts[-1]
    wrong = await http.post(f"{gw.url}{path}", json=body, headers={"authorization": f"Bearer {TEAM_KEY}x"})
    assert wrong.status_code == 403
    texts += [wrong.text, (await http.get(f"{gw.url}/metrics")).text]
    out, err = capfd.readouterr()
    everything = "\n".join([*texts, caplog.text, out, err])
    assert "team-a" in everything  # the id is what names the key
    for secret in (PLAIN_KEY, TEAM_KEY):
        assert secret not in everything
