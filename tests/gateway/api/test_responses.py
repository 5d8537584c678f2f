"""The OpenAI Responses API (`POST /v1/responses`) through the official `openai` client and an openai-agents SDK agent,
configured with nothing but a base URL and an API key: whole and streamed answers, multi-turn by
`previous_response_id` and by replaying the input (one sample, exact ids), a function-tool loop, weight updates in
the middle of a turn, errors. Real simulator, real gateway, real Redis."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from gateway.api.openai.models import ChatMessage
from gateway.api.responses.items import chat_messages
from gateway.api.responses.models import ResponseRequest
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.parsers.reasoning_families import QWEN3
from tests.gateway_helpers import publish
from tests.sim_helpers import wait_for

KEY_MODE = {"identity": "api_key"}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    "strict": False,
}
AGENT_SCRIPT = Path(__file__).with_name("responses_agent.py")


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.load(TINY_TOKENIZER_DIR)


def agent(base_url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def rollout(response: Response) -> dict[str, Any]:
    assert response.model_extra is not None
    found: dict[str, Any] = response.model_extra["rollout"]
    return found


def sampled(response: Response) -> list[int]:
    ids: list[int] = rollout(response)["choices"][0]["output_ids"]
    return ids


async def served(make_sim: SimFactory, make_gateway: GatewayFactory, **sections: Any) -> tuple[Any, RunningGateway]:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=sections.pop("token_delay", 0.0)))
    return sim, await make_gateway([sim], **sections)


async def one_sample(gw: RunningGateway, session: str, turns: list[list[int]]) -> Any:
    """The session holds one sample: each turn's sampled ids (mask 1), the environment's between them (mask 0)."""
    [sample] = await gw.services.store.load_samples(session)
    response, mask = sample.response_ids.tolist(), sample.loss_mask.tolist()
    assert sample.num_turns == len(turns) and mask[0] == 1
    spans: list[list[int]] = []  # the runs of mask 1
    for token, sampled_here, before in zip(response, mask, [0, *mask], strict=False):
        if sampled_here and not before:
            spans.append([])
        if sampled_here:
            spans[-1].append(token)
    assert spans == turns and mask[-1] == 1
    return sample


async def test_a_whole_and_a_streamed_answer_agree(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    _, gw = await served(make_sim, make_gateway)
    api = agent(f"{gw.url}/v1")
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "input": "hello there",
        "instructions": "Be brief.",
        "max_output_tokens": 12,
        "temperature": 0,
        "metadata": {"task": "t1"},
    }
    whole = await api.responses.create(**kwargs)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == "tiny"
    assert [item.type for item in whole.output] == ["message"]
    message = whole.output[0]
    assert message.type == "message" and message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert whole.output_text == message.content[0].text and whole.instructions == "Be brief."
    assert whole.usage is not None and whole.usage.output_tokens == len(sampled(whole))
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.metadata == {"task": "t1"} and whole.tool_choice == "auto" and whole.tools == []
    if len(sampled(whole)) == 12:
        assert whole.status == "incomplete" and whole.incomplete_details is not None
        assert whole.incomplete_details.reason == "max_output_tokens"
    else:
        assert whole.status == "completed" and whole.incomplete_details is None

    async with api.responses.stream(**kwargs) as stream:
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == ("response.completed" if whole.status == "completed" else "response.incomplete")
    streamed = events[-1].response
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    assert streamed.output_text == whole.output_text and sampled(streamed) == sampled(whole)
    assert streamed.usage == whole.usage and streamed.status == whole.status

    raw = await api.responses.create(**kwargs, stream=True)
    events = [event async for event in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.output_text == whole.output_text
    # A stored response is there to read back.
    again = await api.responses.retrieve(whole.id)
    assert again.output_text == whole.output_text and again.id == whole.id
    await api.close()


async def test_previous_response_id_and_a_replayed_input_extend_one_sample(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    _, gw = await served(make_sim, make_gateway, sessions=KEY_MODE)
    # A second gateway process on the same Redis serves the middle turn: the chain lives in Redis, not in a process.
    other = await make_gateway([gw.services.settings.replicas[0]], sessions=KEY_MODE)
    api, elsewhere = agent(f"{gw.url}/v1", "ep-1"), agent(f"{other.url}/v1", "ep-1")
    common: dict[str, Any] = {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}
    first = await api.responses.create(input="first question", **common)
    second = await elsewhere.responses.create(input="second question", previous_response_id=first.id, **common)
    assert rollout(second)["session_id"] == "ep-1" and second.previous_response_id == first.id
    assert rollout(second)["choices"][0]["sample_index"] == 0 and not rollout(second)["choices"][0]["new_sample"]
    # The whole input replayed, as agents that keep their own history send it: the output items echoed back.
    replay = [
        {"role": "user", "content": "first question"},
        *(item.model_dump(exclude_none=True) for item in first.output),
        {"role": "user", "content": [{"type": "input_text", "text": "second question"}]},
        *(item.model_dump(exclude_none=True) for item in second.output),
        {"role": "user", "content": "third question"},
    ]
    third = await api.responses.create(input=replay, **common)
    assert rollout(third)["choices"][0]["sample_index"] == 0 and not rollout(third)["choices"][0]["new_sample"]
    fourth = await api.responses.create(input="fourth", previous_response_id=third.id, **common)
    sample = await one_sample(gw, "ep-1", [sampled(r) for r in (first, second, third, fourth)])
    assert [m["role"] for m in sample.conversation] == ["system", *["user", "assistant"] * 4]
    assert sample.conversation[0]["content"] == "Be brief."

    # New instructions replace the previous response's (not carried over): the history is rewritten, a new sample.
    changed = await api.responses.create(
        input="fifth", previous_response_id=fourth.id, **(common | {"instructions": "Be verbose."})
    )
    assert rollout(changed)["choices"][0]["new_sample"] and rollout(changed)["choices"][0]["sample_index"] == 1
    [_, rewritten] = await gw.services.store.load_samples("ep-1")
    assert rewritten.conversation[0] == {"role": "system", "content": "Be verbose."}
    assert [m["content"] for m in rewritten.conversation if m["role"] == "user"] == [
        "first question",
        "second question",
        "third question",
        "fourth",
        "fifth",
    ]
    # A previous response of another session than the one named is refused.
    stranger = agent(f"{gw.url}/v1", "ep-2")
    with pytest.raises(openai.BadRequestError) as refused:
        await stranger.responses.create(input="x", previous_response_id=first.id, **common)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]
    for client in (api, elsewhere, stranger):
        await client.close()


async def test_a_chained_turn_back_on_the_answering_process_reads_its_own_cache(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """Each process keeps the responses it stored last (`store.response_cache_size`): a chained turn that comes back
    to it starts without reading Redis, and builds the same prompt as one that reads Redis. The stored record is
    deleted from Redis to tell the two paths apart."""
    _, gw = await served(make_sim, make_gateway, sessions=KEY_MODE, store={"response_cache_size": 1})
    other = await make_gateway([gw.services.settings.replicas[0]], sessions=KEY_MODE)
    api, elsewhere = agent(f"{gw.url}/v1", "ep-c"), agent(f"{other.url}/v1", "ep-c")
    common: dict[str, Any] = {"model": "tiny", "instructions": "Be brief.", "max_output_tokens": 5, "temperature": 0}
    first = await api.responses.create(input="one", **common)
    second = await elsewhere.responses.create(input="two", previous_response_id=first.id, **common)  # from Redis
    third = await api.responses.create(input="three", previous_response_id=second.id, **common)  # from Redis
    store = gw.services.store
    await store.client.delete(store.keys.response(third.id))
    # Not in Redis any more: the other process cannot continue it, the one that answered it can, from its cache.
    with pytest.raises(openai.BadRequestError) as refused:
        await elsewhere.responses.create(input="four", previous_response_id=third.id, **common)
    assert refused.value.code == "previous_response_not_found"
    assert (await api.responses.retrieve(third.id)).id == third.id
    fourth = await api.responses.create(input="four", previous_response_id=third.id, **common)
    await one_sample(gw, "ep-c", [sampled(r) for r in (first, second, third, fourth)])
    # The cache holds one response: the fourth's. The third's, evicted, is gone for this process too.
    with pytest.raises(openai.BadRequestError):
        await api.responses.create(input="five", previous_response_id=third.id, **common)
    await store.client.delete(store.keys.response(fourth.id))
    fifth = await api.responses.create(input="five", previous_response_id=fourth.id, **common)
    await one_sample(gw, "ep-c", [sampled(r) for r in (first, second, third, fourth, fifth)])
    for client in (api, elsewhere):
        await client.close()


async def test_without_a_session_each_turn_is_its_own_one_turn_session(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    _, gw = await served(make_sim, make_gateway)
    api = agent(f"{gw.url}/v1")
    first = await api.responses.create(model="tiny", input="alpha", max_output_tokens=4, temperature=0)
    second = await api.responses.create(
        model="tiny", input="beta", previous_response_id=first.id, max_output_tokens=4, temperature=0
    )
    sessions = [rollout(r)["session_id"] for r in (first, second)]
    assert sessions[0] != sessions[1] and all(s.startswith("chat-") for s in sessions)
    # The second turn's prompt is the whole conversation: the first turn's, then the new input.
    [sample] = await gw.services.store.load_samples(sessions[1])
    assert [m.get("content") for m in sample.conversation[:3]] == ["alpha", first.output_text, "beta"]
    # `store: false`: nothing to continue from or read back.
    unstored = await api.responses.create(model="tiny", input="gamma", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as refused:
        await api.responses.create(model="tiny", input="delta", previous_response_id=unstored.id)
    assert refused.value.code == "previous_response_not_found"
    await api.close()


def chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool as the chat template sees it."""
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def script_reply(
    sim: Any, tokenizer: ChatTokenizer, messages: list[dict[str, Any]], reply: dict[str, Any]
) -> list[int]:
    """Make the simulator answer a prompt ending as `messages` render with exactly the template's rendering of
    `reply` (an assistant message), its end-of-turn token included. Only the prompt's last tokens are matched, so the
    system block (instructions, tool schemas) may differ from the gateway's."""
    prompt = tokenizer.render(messages, None)
    full = tokenizer.render([*messages, reply], None, add_generation_prompt=False)
    ids = full[len(prompt) :]
    ids = ids[: ids.index(tokenizer.end_of_turn_id) + 1]
    sim.engine.add_script(prompt[-12:], ids)
    return ids


def tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_function_tool_loop(
    streamed: bool, make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer
) -> None:
    sim, gw = await served(make_sim, make_gateway)
    api = agent(f"{gw.url}/sessions/tools-{streamed}/v1")
    question = [{"role": "user", "content": "What is 1 plus 2? Use the tool please."}]
    call_ids = script_reply(sim, tokenizer, question, tool_call("c1", "add", '{"a": 1, "b": 2}'))
    kwargs: dict[str, Any] = {"model": "tiny", "tools": [ADD], "max_output_tokens": 64, "temperature": 0}

    async def create(**more: Any) -> Response:
        if not streamed:
            return await api.responses.create(**kwargs, **more)
        async with api.responses.stream(**kwargs, **more) as stream:
            kinds = [event.type async for event in stream]
            assert "response.function_call_arguments.delta" in kinds or "response.output_text.delta" in kinds
            return await stream.get_final_response()

    first = await create(input=question[0]["content"])
    [call] = first.output
    assert call.type == "function_call" and call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    assert call.id == f"fc_{call.call_id}" and first.status == "completed" and sampled(first) == call_ids
    result = [{"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    answered = [*question, tool_call(call.call_id, "add", call.arguments), {"role": "tool", "content": "3"}]
    answer_ids = script_reply(sim, tokenizer, answered, {"role": "assistant", "content": "The sum is 3."})
    second = await create(input=result, previous_response_id=first.id)
    assert second.output_text == "The sum is 3." and sampled(second) == answer_ids
    sample = await one_sample(gw, f"tools-{streamed}", [call_ids, answer_ids])
    assert sample.conversation[-3]["tool_calls"][0]["id"] == call.call_id  # the recorded call is the one answered
    # The tool's output went in as environment tokens (mask 0), between the two sampled spans.
    env = sample.response_ids.tolist()[len(call_ids) : -len(answer_ids)]
    assert "3" in tokenizer.decode(env) and "tool_response" in tokenizer.decode(env)
    await api.close()


@pytest.mark.parametrize("streamed", [False, True])
async def test_a_weight_update_in_the_middle_of_a_turn_is_invisible(
    streamed: bool, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim, gw = await served(make_sim, make_gateway, token_delay=0.003)
    api = agent(f"{gw.url}/sessions/update-{streamed}/v1")
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "input": "a long answer please",
        "max_output_tokens": 200,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }

    async def update_when_under_way() -> None:
        await wait_for(lambda: sim.engine.counters["generation_tokens"] > 40, what="tokens before the update")
        assert (await publish(http, gw.url, 1)).status_code == 200

    update = asyncio.create_task(update_when_under_way())
    if streamed:
        async with api.responses.stream(**kwargs) as stream:
            events = [event async for event in stream]
        # Cut by max_output_tokens: `response.incomplete` ends the stream (`get_final_response` wants a completed one).
        assert events[-1].type == "response.incomplete"
        response = events[-1].response
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    else:
        response = await api.responses.create(**kwargs)
    await update
    ids, rolled = sampled(response), rollout(response)["choices"][0]
    assert len(ids) == 200 and response.status == "incomplete"
    assert 0 in rolled["versions"] and 1 in rolled["versions"] and rolled["num_resumes"] == 1
    assert response.output_text == gw.services.turns.tokenizer.decode(ids, skip_special_tokens=True)
    [sample] = await gw.services.store.load_samples(f"update-{streamed}")
    assert sample.response_ids.tolist() == ids and sample.loss_mask.tolist() == [1] * 200
    assert set(sample.versions.tolist()) == {0, 1} and [s.version for s in sample.segments] == [0, 1]
    await api.close()


async def test_refusals_are_openai_shaped(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    _, gw = await served(make_sim, make_gateway)
    url = f"{gw.url}/v1/responses"
    base = {"model": "tiny", "max_output_tokens": 2}
    cases: list[tuple[dict[str, Any], int, str]] = [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input.0"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools.0"),
        ({"input": "x", "tools": [ADD | {"parameters": {"type": "string"}}]}, 400, "tools.0.parameters"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}}, 400, "text.format"),
        ({"input": "x", "temperatur": 1}, 400, "temperatur"),
        ({"input": [{"type": "function_call", "call_id": "c"}]}, 400, "input.0.function_call.name"),
        ({"input": []}, 400, "input"),
        ({"input": "x", "previous_response_id": "resp_nope"}, 400, "previous_response_id"),
        ({"input": "x", "model": "gpt-4o"}, 404, "model"),
    ]
    for extra, status, param in cases:
        answer = await http.post(url, json=base | extra)
        assert answer.status_code == status, (extra, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"].startswith(param), error
    unknown = (await http.post(url, json=base | {"input": "x", "previous_response_id": "resp_nope"})).json()["error"]
    assert unknown["code"] == "previous_response_not_found" and unknown["type"] == "invalid_request_error"
    assert "resp_nope" in unknown["message"]
    missing = await http.get(f"{url}/resp_nope")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "response_id"


async def test_an_openai_agents_sdk_agent_runs_a_tool_episode(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer
) -> None:
    """The agent knows only the base URL and an API key, which names the session (`sessions.identity: api_key`); the
    trainer gets one sample with exactly the engine's ids, the tool's output and the user's turns masked out."""
    sim, gw = await served(make_sim, make_gateway, sessions=KEY_MODE)
    first, second, third = (
        {"role": "user", "content": q}
        for q in ("What is 1 plus 2? Use the tool please.", "Thanks. Now say goodbye.", "Once more, please; thank you.")
    )
    call = tool_call("c", "add", '{"a": 1, "b": 2}')
    replies = [
        script_reply(sim, tokenizer, [first], call),
        script_reply(
            sim,
            tokenizer,
            [first, call, {"role": "tool", "content": "3"}],
            {"role": "assistant", "content": "1 plus 2 is 3."},
        ),
        script_reply(sim, tokenizer, [second], {"role": "assistant", "content": "Goodbye!"}),
        script_reply(sim, tokenizer, [third], {"role": "assistant", "content": "Goodbye again!"}),
    ]
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-I",
        str(AGENT_SCRIPT),
        f"{gw.url}/v1",
        "agent-ep",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    report = json.loads(out)
    assert report["outputs"] == ["1 plus 2 is 3.", "Goodbye!", "Goodbye again!"]
    assert report["tool_outputs"] == [3] and [len(r) for r in report["responses"]] == [2, 1, 1]
    assert "raw_response_event" in report["streamed_events"]
    sample = await one_sample(gw, "agent-ep", replies)
    assert sample.conversation[0] == {"role": "system", "content": "Use the add tool for sums."}
    assert [m["role"] for m in sample.conversation[1:]] == ["user", "assistant", "tool", "assistant"] + [
        "user",
        "assistant",
    ] * 2
    # Every response of the episode is stored, and names the session's one sample.
    for response_id in (r for run in report["responses"] for r in run):
        stored = await gw.services.store.responses.load(response_id)
        assert stored is not None and json.loads(stored)["session_id"] == "agent-ep"


@pytest.mark.parametrize("form", ["whole, previous_response_id", "streamed, replayed"])
async def test_reasoning_goes_out_as_an_item_and_comes_back_into_the_same_sample(
    form: str, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """Qwen3 (`reasoning_parser: qwen3`): the reply's reasoning is a reasoning item (whole) or reasoning-text deltas
    (streamed); echoed back before its tool call (by `previous_response_id`, or replayed as an item), it is the
    assistant message's `reasoning_content`, which the template renders before a tool result: the turn extends the
    sample the reasoning was sampled in."""
    streamed = form.startswith("streamed")
    tokenizer_dir = QWEN3.tokenizer_dir(tmp_path)
    tokenizer = ChatTokenizer.load(tokenizer_dir)
    shape = ModelShape(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape))
    gw = await make_gateway([sim], model={"tokenizer": str(tokenizer_dir), "reasoning_parser": "qwen3"})
    api = agent(f"{gw.url}/sessions/think/v1")
    question = {"role": "user", "content": "What is 1 plus 2? Use the tool please."}
    thought = tool_call("c", "add", '{"a": 1, "b": 2}') | {"content": "", "reasoning_content": "\nI should add them.\n"}
    call_ids = script_reply(sim, tokenizer, [question], thought)
    kwargs: dict[str, Any] = {"model": "tiny", "tools": [ADD], "max_output_tokens": 64, "temperature": 0}

    async def create(**more: Any) -> Response:
        if not streamed:
            return await api.responses.create(**kwargs, **more)
        async with api.responses.stream(**kwargs, **more) as stream:
            events = [event async for event in stream]
        deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        done = [e.text for e in events if e.type == "response.reasoning_text.done"]
        response = await stream.get_final_response()
        reasoning = [item for item in response.output if item.type == "reasoning"]
        assert done == ["".join(deltas)] == [c.text for r in reasoning for c in r.content or []]
        pieces.append(len(deltas))
        return response

    pieces: list[int] = []  # reasoning deltas per streamed turn

    first = await create(input=question["content"])
    assert not streamed or pieces[0] > 1  # streamed as sampled, not in one piece at the end
    [reasoning, call] = first.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.text for c in reasoning.content or []] == ["\nI should add them.\n"]
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 1, "b": 2}
    assert first.usage is not None and 0 < first.usage.output_tokens_details.reasoning_tokens < len(call_ids)
    answered = [question, thought, {"role": "tool", "content": "3"}]
    answer_ids = script_reply(sim, tokenizer, answered, {"role": "assistant", "content": "It is 3."})
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "3"}
    if streamed:
        echoed = [item.model_dump(exclude_none=True) for item in first.output]
        second = await create(input=[{"role": "user", "content": question["content"]}, *echoed, result])
    else:
        second = await create(input=[result], previous_response_id=first.id)
    assert second.output_text.strip() == "It is 3." and sampled(second) == answer_ids
    assert not rollout(second)["choices"][0]["new_sample"]
    sample = await one_sample(gw, "think", [call_ids, answer_ids])
    assert sample.conversation[1]["reasoning_content"] == "\nI should add them.\n"
    await api.close()


def test_input_items_become_the_chat_apis_template_messages() -> None:
    """The adapter hands its messages to the turn without validating them again as chat messages: they must be
    what the chat API makes of the same messages (`ChatMessage.to_template`), a developer message included."""
    body = ResponseRequest.model_validate(
        {
            "model": "tiny",
            "input": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "1 + 2?"}]},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "add"}]},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "3"},
                {"role": "assistant", "content": [{"type": "output_text", "text": "3"}]},
            ],
        }
    )
    messages = chat_messages(body.input)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages == [ChatMessage.model_validate(m).to_template() for m in messages]
