"""The OpenAI-compatible API through the official `openai` client, sessions, and what lands in Redis."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import orjson
import pytest
from redis.asyncio import Redis

from backends.sim.engine import EngineSettings
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.server import RunningGateway
from gateway.store import Keys
from gateway.tokenization import ChatTokenizer
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import client, publish
from tests.sim_helpers import wait_for

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
KEYS = Keys()


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.load(TINY_TOKENIZER_DIR)


async def gateway_on(make_sim: SimFactory, make_gateway: GatewayFactory, **sections: Any) -> tuple[Any, RunningGateway]:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=sections.pop("token_delay", 0.0)))
    return sim, await make_gateway([sim], **sections)


def script_tool_call(
    sim: Any, tokenizer: ChatTokenizer, messages: list[dict[str, Any]], call: dict[str, Any]
) -> list[int]:
    """Make the simulator answer this conversation with exactly the template's rendering of a tool call."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": call}],
    }
    prompt = tokenizer.render(messages, TOOLS)
    full = tokenizer.render([*messages, assistant], TOOLS, add_generation_prompt=False)
    reply = full[len(prompt) :]
    reply = reply[: reply.index(tokenizer.end_of_turn_id) + 1]
    sim.engine.add_script(prompt[-12:], reply)
    return reply


async def test_models_and_plain_chat(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    api = client(gw)
    models = await api.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    chat = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0, seed=1
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert chat.usage is not None and chat.usage.completion_tokens == len(
        chat.model_extra["rollout"]["choices"][0]["output_ids"]
    )
    rollout = chat.model_extra["rollout"]
    assert rollout["session_id"] and rollout["choices"][0]["versions"] == [0] * chat.usage.completion_tokens
    await api.close()


async def test_sync_client_and_stream_match_non_stream(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    messages = [{"role": "user", "content": "stream me"}]

    def sync_call() -> Any:
        with openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0) as sync:
            return sync.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)

    reference = await asyncio.to_thread(sync_call)
    api = client(gw)
    stream = await api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=2,
    )
    text, finish, usage, logprobs = "", None, None, 0
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            if choice.logprobs and choice.logprobs.content:
                logprobs += len(choice.logprobs.content)
                assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert text == reference.choices[0].message.content
    assert finish == reference.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == reference.usage.completion_tokens == logprobs
    await api.close()


async def test_multi_turn_tool_agent_is_one_exact_sample(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, tokenizer: ChatTokenizer
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway)
    api = client(gw, **{"X-Session-ID": "agent-1"})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 2? Use the tool."}]
    reply = script_tool_call(sim, tokenizer, messages, {"name": "add", "arguments": '{"a": 1, "b": 2}'})
    first = await api.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=64, temperature=0
    )
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "3"},
    ]
    second = await api.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=16, temperature=0
    )
    assert second.model_extra["rollout"]["choices"][0]["sample_index"] == 0  # the same sample, extended
    sampled2 = second.model_extra["rollout"]["choices"][0]["output_ids"]
    session = (await http.get(f"{gw.url}/v1/sessions/agent-1")).json()
    assert [s["num_turns"] for s in session["samples"]] == [2]
    stored = await gw.services.store.load_samples("agent-1")
    sample = stored[0]
    prompt = tokenizer.render(messages[:1], TOOLS)
    env = tokenizer.render_delta([messages[0], messages[1]], messages, TOOLS)
    assert sample.prompt_ids.tolist() == prompt
    assert sample.response_ids.tolist() == reply + env + sampled2
    assert sample.loss_mask.tolist() == [1] * len(reply) + [0] * len(env) + [1] * len(sampled2)
    assert (sample.logprobs[sample.loss_mask == 0] == 0).all() and (sample.logprobs[sample.loss_mask == 1] < 0).all()
    assert sample.versions.tolist() == [0] * len(reply) + [-1] * len(env) + [0] * len(sampled2)
    # The exact prompt + turns: what the model saw is the template's rendering of the whole conversation.
    assert sample.input_ids.tolist()[: len(prompt) + len(reply) + len(env)] == tokenizer.render(messages, TOOLS)
    await api.close()


async def test_streamed_tool_call_deltas(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway)
    messages = [{"role": "user", "content": "add 5 and 7"}]
    script_tool_call(sim, tokenizer, messages, {"name": "add", "arguments": '{"a": 5, "b": 7}'})
    api = client(gw, **{"X-Session-ID": "streamed-call"})
    stream = await api.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=64, stream=True)
    name, arguments, finish, call_id = "", "", None, None
    async for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                name += call.function.name or ""
                arguments += call.function.arguments or ""
                call_id = call.id or call_id
            finish = choice.finish_reason or finish
    assert name == "add" and json.loads(arguments) == {"a": 5, "b": 7} and finish == "tool_calls"
    # The recorded reply names the call as the stream did: an agent echoing it back matches the session's message.
    [sample] = await gw.services.store.load_samples("streamed-call")
    assert sample.conversation is not None and sample.conversation[-1]["tool_calls"][0]["id"] == call_id
    await api.close()


async def test_weight_update_mid_stream_is_invisible(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway, token_delay=0.003)
    api = client(gw)
    stream = await api.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "long answer please"}],
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, rollout, published = "", None, False
    async for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.finish_reason:
                rollout = chunk.model_extra["rollout"]["choices"][0]
        if not published and sim.engine.counters["generation_tokens"] > 40:
            published = (await publish(http, gw.url, 1)).status_code == 200
    assert published and rollout is not None
    assert 0 in rollout["versions"] and 1 in rollout["versions"] and rollout["num_resumes"] == 1
    assert len(rollout["output_ids"]) == 200
    tokenizer = gw.services.turns.tokenizer
    assert text == tokenizer.decode(rollout["output_ids"], skip_special_tokens=True)
    await api.close()


async def test_history_rewrite_starts_a_new_sample(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    api = client(gw, **{"X-Session-ID": "rewrite"})
    first = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "one"}], max_tokens=5)
    history = [{"role": "user", "content": "one"}, first.choices[0].message.model_dump(exclude_none=True)]
    follow = await api.chat.completions.create(
        model="tiny", messages=[*history, {"role": "user", "content": "two"}], max_tokens=5
    )
    assert follow.model_extra["rollout"]["choices"][0]["sample_index"] == 0
    rewritten = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "something else"}], max_tokens=5
    )
    assert rewritten.model_extra["rollout"]["choices"][0] == rewritten.model_extra["rollout"]["choices"][0] | {
        "sample_index": 1,
        "new_sample": True,
    }
    session = (await http.get(f"{gw.url}/v1/sessions/rewrite")).json()
    assert [s["num_turns"] for s in session["samples"]] == [2, 1]
    await api.close()


async def test_sessions_evicted_between_and_during_their_turns_keep_exact_multi_turn_samples(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A cache of one session: three sessions' turns interleave, each turn reads its session back from Redis (or
    finds it evicted by the time it records), and every turn still extends its session's one sample."""
    _, gw = await gateway_on(make_sim, make_gateway, token_delay=0.01, store={"session_cache_size": 1})
    names = ["evict-a", "evict-b", "evict-c"]
    apis = {name: client(gw, **{"X-Session-ID": name}) for name in names}

    async def episode(name: str) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{name}: count to three"}]
        rollouts = []
        for turn in range(3):
            reply = await apis[name].chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            rollouts.append(reply.model_extra["rollout"]["choices"][0])
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": f"{turn}"}]
        return rollouts

    try:
        results = await asyncio.gather(*(episode(name) for name in names))
    finally:
        for api in apis.values():
            await api.close()
    for name, rollouts in zip(names, results, strict=True):
        assert [(r["sample_index"], r["new_sample"]) for r in rollouts] == [(0, True), (0, False), (0, False)]
        session = (await http.get(f"{gw.url}/v1/sessions/{name}")).json()
        assert [s["num_turns"] for s in session["samples"]] == [3]


async def test_sessions_finish_is_idempotent(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    created = await http.post(f"{gw.url}/v1/sessions", json={"metadata": {"task_id": "t1", "group_id": "g1"}})
    assert created.status_code == 201
    session_id = created.json()["id"]
    api = client(gw, **{"X-Session-ID": session_id})
    await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    first = await http.post(f"{gw.url}/v1/sessions/{session_id}/finish", json={"reward": 1.0})
    second = await http.post(f"{gw.url}/v1/sessions/{session_id}/finish", json={"reward": 1.0})
    assert first.status_code == second.status_code == 200
    assert first.json()["stream_id"] == second.json()["stream_id"]
    assert (await http.post(f"{gw.url}/v1/sessions/{session_id}/finish", json={})).status_code == 200
    # Issue 38 §6: another reward was a silent 200 that dropped it.
    other = await http.post(f"{gw.url}/v1/sessions/{session_id}/finish", json={"reward": 999.0})
    assert other.status_code == 409 and other.json()["error"]["param"] == "reward"
    assert await redis.xlen(KEYS.trajectories) == 1
    meta = (await http.get(f"{gw.url}/v1/sessions/{session_id}")).json()
    assert meta["status"] == "finished" and meta["reward"] == 1.0 and meta["metadata"]["group_id"] == "g1"
    missing = await http.post(f"{gw.url}/v1/sessions/nope/finish", json={})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "session_id"
    await api.close()


async def test_one_turn_requests_are_finished_sessions(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis: Redis
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    api = client(gw)
    completion = await api.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length")
    session_id = completion.model_extra["rollout"]["session_id"]
    await wait_for(lambda: redis.xlen(KEYS.trajectories), what="a trajectory")  # type: ignore[arg-type,return-value]
    assert (await gw.services.store.get_session(session_id)).status == "finished"
    await api.close()


async def test_n_samples_of_one_prompt(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    api = client(gw, **{"X-Session-ID": "grpo"})
    chat = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "sample"}], max_tokens=8, n=3, temperature=1.0
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    indexes = [c["sample_index"] for c in chat.model_extra["rollout"]["choices"]]
    assert sorted(indexes) == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) > 1  # distinct seeds, distinct samples
    await api.close()


async def test_backpressure_429(make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient) -> None:
    _, gw = await gateway_on(make_sim, make_gateway, store={"max_pending": 1})
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=chat, headers={"X-Session-ID": "s"})).is_success
    await http.post(f"{gw.url}/v1/sessions/s/finish", json={"reward": 0.5})  # one delivered, not yet taken
    refused = await http.post(f"{gw.url}/v1/sessions", json={})
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["type"] == "rate_limit_error"
    api = client(gw)
    with pytest.raises(openai.RateLimitError):
        await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    await api.close()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": "hello"}, 400, "messages"),
        ({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        (
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            },
            400,
            "tools.0.function.parameters",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "bogus": True}, 400, "bogus"),
    ],
)
async def test_bad_chat_requests(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    body: dict[str, Any],
    status: int,
    param: str,
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert not [k async for k in redis.scan_iter(match="rg:{*")]  # nothing stored


async def test_malformed_json(make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    response = await http.post(
        f"{gw.url}/v1/chat/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"


async def test_admin_token_is_not_an_api_key(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway, server={"api_keys": ["agent-key"]})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=body)).status_code == 401
    agent = {"authorization": "Bearer agent-key"}
    assert (await http.post(f"{gw.url}/v1/chat/completions", json=body, headers=agent)).status_code == 200
    assert (await http.get(f"{gw.url}/admin/status", headers=agent)).status_code == 403
    assert (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).status_code == 200


async def test_oversized_body_is_413(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway, server={"max_body_bytes": 2000})
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
    response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("size", [5000, 1500])
async def test_a_chunked_body_is_held_to_the_same_limit(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, size: int
) -> None:
    """Issue 38 §11: a chunked body over the limit was FastAPI's 400 "There was an error parsing the body"; under
    it, it is read and parsed as a declared one is."""
    _, gw = await gateway_on(make_sim, make_gateway, server={"max_body_bytes": 2000})
    raw = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x" * size}], "max_tokens": 2})

    async def chunks() -> AsyncIterator[bytes]:  # no length known up front: sent with Transfer-Encoding: chunked
        for start in range(0, len(raw), 512):
            yield raw[start : start + 512]

    json_type = {"content-type": "application/json"}
    response = await http.post(f"{gw.url}/v1/chat/completions", content=chunks(), headers=json_type)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    if size > 2000:
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    else:
        assert response.status_code == 200, response.text


async def test_trainer_receives_exactly_what_the_agent_generated(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any
) -> None:
    from gateway.trainer import TrajectoryConsumer

    _, gw = await gateway_on(make_sim, make_gateway)
    session = (await http.post(f"{gw.url}/v1/sessions", json={"metadata": {"group_id": "g", "group_size": 1}})).json()
    api = client(gw, **{"X-Session-ID": session["id"]})
    chat = await api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=9)
    sampled = chat.model_extra["rollout"]["choices"][0]["output_ids"]
    await http.post(f"{gw.url}/v1/sessions/{session['id']}/finish", json={"reward": 0.25})
    async with TrajectoryConsumer(redis_server.url, "trainers", "t0", group_by="group_id") as consumer:
        batch = await consumer.next_batch(4, timeout=5)
        assert [t.session_id for t in batch.trajectories] == [session["id"]]
        trajectory = batch.trajectories[0]
        assert trajectory.reward == 0.25
        assert trajectory.samples[0].response_ids.tolist() == sampled
        assert await consumer.ack(batch) == 1
    await api.close()


async def test_partial_sample_is_written_at_a_segment_boundary(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway, token_delay=0.003)
    api = client(gw, **{"X-Session-ID": "partial"})
    task = asyncio.create_task(
        api.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "go"}],
            max_tokens=400,
            extra_body={"ignore_eos": True},
        )
    )
    await wait_for(lambda: sim.engine.counters["generation_tokens"] > 30, what="tokens")
    assert (await publish(http, gw.url, 1)).status_code == 200
    await wait_for(lambda: gw.services.generator.resumes_total >= 1, what="the resume")
    partial = await gw.services.store.load_samples("partial")
    assert partial and 30 <= int(partial[0].loss_mask.sum()) < 400  # persisted mid-turn, before the reply ends
    chat = await task
    output_ids = chat.model_extra["rollout"]["choices"][0]["output_ids"]
    assert len(output_ids) == 400
    # Two whole answers, decoded once at the end: the text of every token, as a stream would have shown it.
    tokenizer = gw.services.turns.tokenizer
    assert chat.choices[0].message.content == tokenizer.decode(output_ids, skip_special_tokens=True)
    stored = await gw.services.store.load_samples("partial")
    assert int(stored[0].loss_mask.sum()) == 400
    await api.close()


async def test_engine_transport_follows_the_callers_need(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    """A non-streamed turn takes its engine's answer whole, unless stop strings must be watched token by token (the
    gateway applies them, and stops the engine at the first match); a streamed turn streams."""
    sim, gw = await gateway_on(make_sim, make_gateway)
    api = client(gw)
    counters = sim.engine.counters

    def transports() -> tuple[int, int]:
        return counters["requests_whole"], counters["requests_streamed"]

    plain = await api.completions.create(model="tiny", prompt="hello there", max_tokens=8, temperature=0)
    assert plain.choices[0].finish_reason in ("stop", "length") and transports() == (1, 0)
    stopped = await api.completions.create(
        model="tiny", prompt="hello there", max_tokens=40, temperature=0, stop=[plain.choices[0].text[-2:]]
    )
    assert stopped.choices[0].finish_reason == "stop" and transports() == (1, 1)
    stream = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True
    )
    assert [chunk async for chunk in stream] and transports() == (1, 2)
    chat = await api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content is not None and transports() == (2, 2)
    await api.close()
