"""Anthropic's Messages API (issue 36 §2) through the official `anthropic` client: whole and streamed answers, a
tool-use agent that extends one exact sample, session identity from only a base URL and a key, weight updates
invisible to the client, stop reasons, and Anthropic-shaped errors. Real simulator, gateway and Redis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from gateway.api.anthropic.chat import chat_messages
from gateway.api.anthropic.models import MessageParam, MessagesRequest
from gateway.api.openai.models import ChatMessage
from gateway.errors import InvalidRequest
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.parsers.reasoning_families import QWEN3
from tests.gateway_helpers import publish
from tests.sim_helpers import wait_for

MODEL = "tiny"
TOOLS: list[Any] = [
    {
        "name": "add",
        "description": "Add two integers.",
        "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    }
]
CHAT_TOOLS = [  # the same tools as the chat turn renders them
    {
        "type": "function",
        "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]},
    }
    for t in TOOLS
]


def agent(base_url: str, api_key: str = "unused", **headers: str) -> anthropic.AsyncAnthropic:
    """An agent as Anthropic SDK agents configure one: a base URL and an API key."""
    return anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0, default_headers=headers)


def rollout(answer: Any) -> dict[str, Any]:
    found: dict[str, Any] = answer.model_extra["rollout"]
    return found


def comparable(message: Any, *without: str) -> dict[str, Any]:
    """A message as the client sees it, without what differs between two requests (its id, the vendor field, and
    with "tool ids" its tool calls' ids)."""
    out: dict[str, Any] = message.model_dump(exclude_none=True)
    for key in ("id", "rollout"):
        out.pop(key, None)
    if "tool ids" in without:
        out["content"] = [{k: v for k, v in block.items() if k != "id"} for block in out["content"]]
    return out


def tokenizer_of(gw: RunningGateway) -> ChatTokenizer:
    return gw.services.turns.tokenizer


def script_call(
    sim: Any, tokenizer: ChatTokenizer, messages: list[dict[str, Any]], call: dict[str, Any], text: str | None = None
) -> list[int]:
    """Make the simulator answer exactly this conversation (OpenAI-style, as the gateway renders it) with the
    template's rendering of `text` and a hermes tool call; the reply's ids."""
    prompt = tokenizer.render(messages, CHAT_TOOLS)
    calls = [{"id": "c", "type": "function", "function": call}]
    assistant = {"role": "assistant", "content": text, "tool_calls": calls}
    full = tokenizer.render([*messages, assistant], CHAT_TOOLS, add_generation_prompt=False)
    reply = full[len(prompt) :]
    reply = reply[: reply.index(tokenizer.end_of_turn_id) + 1]
    sim.engine.add_script(prompt, reply)  # the whole prompt: no other turn of the test ends with it
    return reply


def chat_call(block: Any) -> dict[str, Any]:
    """A `tool_use` block as the chat turn's assistant message carries it."""
    arguments = json.dumps(block.input)
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}}


async def test_whole_sync_and_streamed_answers_agree(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    api = agent(gw.url)
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "extra_body": {"temperature": 0.5, "top_p": 0.9, "top_k": 5},  # no longer in the SDK's signature
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    }
    whole = await api.messages.create(**ask)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    [text] = whole.content
    assert text.type == "text"
    output_ids = rollout(whole)["choices"][0]["output_ids"]
    assert text.text == tokenizer_of(gw).decode(output_ids, skip_special_tokens=True)
    assert whole.usage.output_tokens == len(output_ids) and whole.usage.input_tokens > 0

    def sync_call() -> Any:
        with anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0) as sync:
            return sync.messages.create(**ask)

    assert comparable(await asyncio.to_thread(sync_call)) == comparable(whole)
    async with api.messages.stream(**ask) as stream:
        deltas = [event.text async for event in stream if event.type == "text"]
        streamed = await stream.get_final_message()
    assert comparable(streamed) == comparable(whole) and "".join(deltas) == text.text
    counted = await api.messages.count_tokens(model=MODEL, system=ask["system"], messages=ask["messages"])
    assert counted.input_tokens == whole.usage.input_tokens
    await api.close()


@pytest.mark.parametrize("form", ["key", "url"])
async def test_a_tool_use_agent_extends_one_exact_sample(
    form: str, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Three turns (a whole one, a streamed one, a whole one) of an agent that calls a tool twice and echoes the
    answers back: one sample holding the engine's sampled ids (mask 1) and the tool results' (mask 0)."""
    sim = await make_sim("vllm")
    if form == "key":  # nothing but a base URL and a key that names the session
        gw = await make_gateway([sim], sessions={"identity": "api_key"})
        api, session = agent(gw.url, "agent-9"), "agent-9"
    else:
        gw = await make_gateway([sim])
        api, session = agent(f"{gw.url}/sessions/ep-4", "anything"), "ep-4"
    tokenizer = tokenizer_of(gw)
    chat: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 2 + 4? Use the tool."}]
    reply1 = script_call(sim, tokenizer, chat, {"name": "add", "arguments": {"a": 1, "b": 2}})
    messages: list[Any] = [{"role": "user", "content": chat[0]["content"]}]

    first = await api.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=messages)
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    [call1] = first.content
    assert call1.type == "tool_use" and call1.name == "add" and call1.input == {"a": 1, "b": 2}
    messages += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call1.id, "content": "3"}]},
    ]
    chat += [
        {"role": "assistant", "content": None, "tool_calls": [chat_call(call1)]},
        {"role": "tool", "tool_call_id": call1.id, "content": "3"},
    ]
    reply2 = script_call(sim, tokenizer, chat, {"name": "add", "arguments": {"a": 3, "b": 4}})

    partial, streamed_rollout = "", {}
    async with api.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS, messages=messages) as stream:
        async for event in stream:
            if event.type == "input_json":
                partial += event.partial_json
            elif event.type == "message_delta":  # the vendor field rides on it
                streamed_rollout = rollout(event)
        second = await stream.get_final_message()
    [call2] = second.content
    assert second.stop_reason == "tool_use" and call2.input == {"a": 3, "b": 4} and json.loads(partial) == call2.input
    assert call2.id != call1.id
    tool_result = [{"type": "text", "text": "7"}]
    messages += [
        {"role": "assistant", "content": second.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call2.id, "content": tool_result}]},
    ]
    chat += [
        {"role": "assistant", "content": None, "tool_calls": [chat_call(call2)]},
        {"role": "tool", "tool_call_id": call2.id, "content": "7"},
    ]
    third = await api.messages.create(model=MODEL, max_tokens=8, tools=TOOLS, messages=messages)
    assert rollout(third)["session_id"] == session
    rollouts = [rollout(first), streamed_rollout, rollout(third)]
    assert [r["choices"][0]["sample_index"] for r in rollouts] == [0, 0, 0]
    assert rollouts[1]["choices"][0]["output_ids"] == reply2

    # The trainer's view: one sample, exactly what the engine sampled and what the environment added.
    out3 = rollout(third)["choices"][0]["output_ids"]
    assert rollout(first)["choices"][0]["output_ids"] == reply1
    [sample] = await gw.services.store.load_samples(session)
    env1 = tokenizer.render_delta(chat[:2], chat[:3], CHAT_TOOLS)
    env2 = tokenizer.render_delta(chat[:4], chat, CHAT_TOOLS)
    assert sample.prompt_ids.tolist() == tokenizer.render(chat[:1], CHAT_TOOLS)
    assert sample.response_ids.tolist() == reply1 + env1 + reply2 + env2 + out3
    spans = [(reply1, 1), (env1, 0), (reply2, 1), (env2, 0), (out3, 1)]
    assert sample.loss_mask.tolist() == [mask for ids, mask in spans for _ in ids]
    meta = (await http.get(f"{gw.url}/v1/sessions/{session}")).json()
    assert [s["num_turns"] for s in meta["samples"]] == [3]
    counted = await api.messages.count_tokens(model=MODEL, tools=TOOLS, messages=messages)
    assert counted.input_tokens == third.usage.input_tokens == len(tokenizer.render(chat, CHAT_TOOLS))
    await api.close()


async def test_streamed_events_on_the_wire(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Text then a tool call: each block started, filled and stopped in order, then message_delta and message_stop;
    the SDK's accumulation of them is the whole answer."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    content = "Let me add them."
    script_call(
        sim,
        tokenizer_of(gw),
        [{"role": "user", "content": "1 + 2?"}],
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        content,
    )
    body = {"model": MODEL, "max_tokens": 64, "tools": TOOLS, "messages": [{"role": "user", "content": "1 + 2?"}]}
    events: list[tuple[str, dict[str, Any]]] = []
    async with http.stream("POST", f"{gw.url}/v1/messages", json=body | {"stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        name = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append((name, json.loads(line.removeprefix("data: "))))
    assert all(name == data["type"] for name, data in events)
    kinds = [
        (data["type"], data.get("index"), (data.get("content_block") or data.get("delta") or {}).get("type"))
        for _, data in events
    ]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # deltas of a block in a row as one
    assert squeezed == [
        ("message_start", None, None),
        ("content_block_start", 0, "text"),
        ("content_block_delta", 0, "text_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "tool_use"),
        ("content_block_delta", 1, "input_json_delta"),
        ("content_block_stop", 1, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    text = "".join(d["delta"]["text"] for _, d in events if d.get("delta", {}).get("type") == "text_delta")
    arguments = "".join(
        d["delta"]["partial_json"] for _, d in events if d.get("delta", {}).get("type") == "input_json_delta"
    )
    assert text == content and json.loads(arguments) == {"a": 1, "b": 2}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(delta["rollout"]["choices"][0]["output_ids"])
    api = agent(gw.url)
    whole = await api.messages.create(**body)
    async with api.messages.stream(**body) as stream:
        streamed = await stream.get_final_message()
    assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.content[0].text == content
    assert comparable(streamed, "tool ids") == comparable(whole, "tool ids")  # each request names its calls anew
    await api.close()


def test_how_blocks_become_chat_messages() -> None:
    """The conversion's rules on one conversation: system blocks joined, thinking as reasoning, redacted thinking
    left out, tool uses as calls with their ids, tool results in order as tool messages before the user's text."""
    body = MessagesRequest.model_validate(
        {
            "model": MODEL,
            "max_tokens": 4,
            "system": [
                {"type": "text", "text": "a"},
                {"type": "text", "text": "b", "cache_control": {"type": "ephemeral"}},
            ],
            "messages": [
                {"role": "user", "content": "go"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "sig"},
                        {"type": "redacted_thinking", "data": "opaque"},
                        {"type": "text", "text": "calling"},
                        {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "é": 2}},
                        {"type": "tool_use", "id": "t2", "name": "add", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "both done"},
                        {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "0"}]},
                        {"type": "tool_result", "tool_use_id": "t1", "content": "3", "is_error": True},
                    ],
                },
            ],
        }
    )
    assert chat_messages(body) == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "calling",
            "reasoning_content": "hm",
            "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "é": 2}'}},
                {"id": "t2", "type": "function", "function": {"name": "add", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "t2", "content": "0"},
        {"role": "tool", "tool_call_id": "t1", "content": "3"},
        {"role": "user", "content": "both done"},
    ]
    # The turn takes them as they are (no second validation): the chat API's own form of the same messages.
    assert chat_messages(body) == [ChatMessage.model_validate(m).to_template() for m in chat_messages(body)]
    misplaced = body.model_copy(update={"messages": [MessageParam(role="user", content=[body.messages[1].content[3]])]})  # type: ignore[index]
    with pytest.raises(InvalidRequest, match="a user message cannot hold a tool_use block"):
        chat_messages(misplaced)


async def test_thinking_blocks_out_and_back_in_one_sample(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """A reasoning model (Qwen3's template and parser): its reasoning comes out as a thinking block, whole and
    streamed as thinking_delta before the text; echoed back with the tool result, it extends the same sample."""
    tokenizer_dir = QWEN3.tokenizer_dir(tmp_path)
    tokenizer = ChatTokenizer.load(tokenizer_dir)
    shape = ModelShape(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape))
    gw = await make_gateway([sim], model={"tokenizer": str(tokenizer_dir), "reasoning_parser": "qwen3"})
    api = agent(gw.url, **{"X-Session-ID": "thinker"})
    chat: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 2?"}]
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    sim.engine.add_script(tokenizer.render(chat, CHAT_TOOLS), tokenizer.encode(f"<think>\nI add.\n</think>\n\n{call}"))
    messages: list[Any] = [{"role": "user", "content": chat[0]["content"]}]

    first = await api.messages.create(model=MODEL, max_tokens=64, tools=TOOLS, messages=messages)
    thinking, use = first.content
    assert thinking.type == "thinking" and (thinking.thinking, thinking.signature) == ("\nI add.\n", "")
    assert use.type == "tool_use" and use.input == {"a": 1, "b": 2} and first.stop_reason == "tool_use"
    chat += [
        {"role": "assistant", "content": None, "reasoning_content": "\nI add.\n", "tool_calls": [chat_call(use)]},
        {"role": "tool", "tool_call_id": use.id, "content": "3"},
    ]
    sim.engine.add_script(tokenizer.render(chat, CHAT_TOOLS), tokenizer.encode("<think>\nSo 3.\n</think>\n\nIt is 3."))
    messages += [
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "3"}]},
    ]
    kinds: list[str] = []
    async with api.messages.stream(model=MODEL, max_tokens=64, tools=TOOLS, messages=messages) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                kinds.append(event.delta.type)
            elif event.type == "message_delta":
                second_rollout = rollout(event)["choices"][0]
        second = await stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in second.content] == [
        ("thinking", "\nSo 3.\n"),
        ("text", "\n\nIt is 3."),
    ]
    assert kinds.count("thinking_delta") > 1 and kinds == sorted(kinds, key=lambda k: k != "thinking_delta")
    assert second_rollout["sample_index"] == 0 and not second_rollout["new_sample"]
    out1, out2 = rollout(first)["choices"][0]["output_ids"], second_rollout["output_ids"]
    [sample] = await gw.services.store.load_samples("thinker")
    response = sample.response_ids.tolist()
    env = len(response) - len(out1) - len(out2)
    assert response[: len(out1)] == out1 and response[len(response) - len(out2) :] == out2 and env > 0
    assert sample.loss_mask.tolist() == [1] * len(out1) + [0] * env + [1] * len(out2)
    await api.close()


async def test_turns_of_chat_completions_and_messages_make_one_sample(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    header = {"X-Session-ID": "mixed"}
    chat_api = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, default_headers=header)
    api = agent(gw.url, **header)
    chat: list[Any] = [{"role": "user", "content": "one"}]
    first = await chat_api.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0)
    said = first.choices[0].message.content
    messages: list[Any] = [*chat, {"role": "assistant", "content": said}, {"role": "user", "content": "two"}]
    second = await api.messages.create(model=MODEL, max_tokens=6, messages=messages)
    chat = [*messages, {"role": "assistant", "content": second.content[0].text}, {"role": "user", "content": "3"}]
    third = await chat_api.chat.completions.create(model=MODEL, messages=chat, max_tokens=6, temperature=0)
    assert third.model_extra and third.model_extra["rollout"]["choices"][0]["sample_index"] == 0
    assert not rollout(second)["choices"][0]["new_sample"]
    meta = (await http.get(f"{gw.url}/v1/sessions/mixed")).json()
    assert [s["num_turns"] for s in meta["samples"]] == [3]
    await chat_api.close()
    await api.close()


async def test_metadata_user_id_names_the_session(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    api = agent(gw.url)
    hello: Any = [{"role": "user", "content": "hi"}]
    named = await api.messages.create(model=MODEL, max_tokens=3, messages=hello, metadata={"user_id": "u-5"})
    assert rollout(named)["session_id"] == "u-5"
    body = await api.messages.create(
        model=MODEL, max_tokens=3, messages=hello, metadata={"user_id": "u-5"}, extra_body={"session_id": "s-6"}
    )
    assert rollout(body)["session_id"] == "s-6"  # the body's session_id comes first, as over OpenAI's `user`
    await api.close()


async def test_stop_sequences_and_max_tokens(make_sim: SimFactory, make_gateway: GatewayFactory) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    api = agent(gw.url)
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "count"}]}
    cut = await api.messages.create(max_tokens=30, extra_body={"ignore_eos": True}, **ask)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 30
    full = cut.content[0].text
    stop = full[10:13]
    assert stop.strip(), full
    stopped = await api.messages.create(max_tokens=30, stop_sequences=["never there", stop], **ask)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == full[: full.index(stop)]
    async with api.messages.stream(max_tokens=30, stop_sequences=[stop], **ask) as stream:
        streamed = await stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert streamed.content[0].text == stopped.content[0].text
    await api.close()


async def test_a_weight_update_within_a_turn_is_invisible(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.003))
    gw = await make_gateway([sim])
    api = agent(gw.url, **{"X-Session-ID": "updated"})
    tokenizer = tokenizer_of(gw)
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "extra_body": {"ignore_eos": True}}

    # Streamed: the update lands while text arrives.
    async with api.messages.stream(messages=[{"role": "user", "content": "a long story"}], **ask) as stream:
        found: dict[str, Any] = {}
        async for event in stream:
            if event.type == "text" and not found and sim.engine.counters["generation_tokens"] > 40:
                found["published"] = (await publish(http, gw.url, 1)).status_code == 200
            if event.type == "message_delta":
                found["rollout"] = rollout(event)["choices"][0]
        streamed = await stream.get_final_message()
    assert found["published"] and streamed.stop_reason == "max_tokens" and streamed.usage.output_tokens == 200
    versions, output_ids = found["rollout"]["versions"], found["rollout"]["output_ids"]
    assert 0 in versions and 1 in versions and found["rollout"]["num_resumes"] == 1
    assert streamed.content[0].text == tokenizer.decode(output_ids, skip_special_tokens=True)

    # Whole: the update lands while the client waits for the answer.
    messages = [
        {"role": "user", "content": "a long story"},
        {"role": "assistant", "content": streamed.content},
        {"role": "user", "content": "another"},
    ]
    start = sim.engine.counters["generation_tokens"]
    task = asyncio.create_task(api.messages.create(messages=messages, **ask))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] > start + 40, what="tokens of the whole turn")
    assert (await publish(http, gw.url, 2)).status_code == 200
    whole = await task
    choice = rollout(whole)["choices"][0]
    assert whole.stop_reason == "max_tokens" and 1 in choice["versions"] and 2 in choice["versions"]
    assert choice["sample_index"] == 0 and choice["num_resumes"] == 1
    assert whole.content[0].text == tokenizer.decode(choice["output_ids"], skip_special_tokens=True)
    [sample] = await gw.services.store.load_samples("updated")
    assert sample.versions.tolist()[-200:] == choice["versions"]
    assert {0, 1, 2} <= set(sample.versions.tolist())
    await api.close()


async def test_errors_come_in_anthropic_shape(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")], sessions={"identity": "api_key"})
    api = agent(gw.url, "s-1")
    url, key = f"{gw.url}/v1/messages", {"x-api-key": "s-1", "anthropic-version": "2023-06-01"}
    hello = [{"role": "user", "content": "hi"}]

    def shape(answer: httpx.Response, status: int, error_type: str) -> str:
        assert answer.status_code == status, answer.text
        body = answer.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == error_type
        message: str = body["error"]["message"]
        return message

    assert "max_tokens" in shape(
        await http.post(url, json={"model": MODEL, "messages": hello}, headers=key), 400, "invalid_request_error"
    )
    with pytest.raises(anthropic.BadRequestError) as refused:
        await api.messages.create(model=MODEL, max_tokens=4, messages=[])
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await api.messages.create(model="claude-nope", max_tokens=4, messages=hello)
    assert "claude-nope" in missing.value.body["error"]["message"]  # type: ignore[index]
    shape(await http.post(url, json={"model": MODEL, "max_tokens": 4, "messages": hello}), 401, "authentication_error")
    shape(
        await http.post(url, content=b"{not json", headers=key | {"content-type": "application/json"}),
        400,
        "invalid_request_error",
    )
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    assert "text-only" in shape(
        await http.post(url, json={"model": MODEL, "max_tokens": 4, "messages": image}, headers=key),
        400,
        "invalid_request_error",
    )
    server_tool = [{"type": "web_search_20250305", "name": "web_search"}]
    body = {"model": MODEL, "max_tokens": 4, "messages": hello, "tools": server_tool}
    assert "server tools" in shape(await http.post(url, json=body, headers=key), 400, "invalid_request_error")
    prefill = [*hello, {"role": "assistant", "content": "Sure"}]
    body = {"model": MODEL, "max_tokens": 4, "messages": prefill}
    assert "prefill" in shape(await http.post(url, json=body, headers=key), 400, "invalid_request_error")
    body = {"model": MODEL, "max_tokens": 4, "messages": hello, "unknown_field": 1}
    assert "unknown_field" in shape(await http.post(url, json=body, headers=key), 400, "invalid_request_error")
    # The same refusals on the OpenAI routes keep OpenAI's shape.
    chat = await http.post(f"{gw.url}/v1/chat/completions", json={"model": "claude-nope", "messages": hello})
    assert chat.status_code == 401 and set(chat.json()["error"]) >= {"message", "type", "param", "code"}
    await api.close()


async def test_a_configured_key_by_x_api_key(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """With API keys configured, the header mode takes Anthropic's `x-api-key` as it takes a bearer token."""
    gw = await make_gateway([await make_sim("vllm")], server={"api_keys": ["sk-ant-test"]})
    api = agent(gw.url, "sk-ant-test")
    answer = await api.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert answer.usage.output_tokens > 0
    intruder = agent(gw.url, "sk-wrong")
    with pytest.raises(anthropic.PermissionDeniedError) as wrong:
        await intruder.messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert wrong.value.body["error"]["type"] == "permission_error"  # type: ignore[index]
    await intruder.close()
    await api.close()
