"""Whatever the model writes reaches the client, on every route that answers parsed model output: a tool call whose
argument is an integer far beyond 64 bits (RL policies write such things) is answered with its exact digits, whole
and streamed, on the chat, Responses and Messages routes; the agent can send the call back. Real simulator, gateway
and Redis; the client decodes with the stdlib, which reads integers of any size."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from gateway.assets import TINY_TOKENIZER_DIR
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory

BIG = int("7" * 2001)
ARGUMENTS = {"a": BIG, "b": -(10**40), "c": 2}
QUESTION = "What is a plus b? Use the tool."
PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": PARAMETERS}}
RESPONSES_TOOL = {"type": "function", "name": "add", "description": "Add.", "parameters": PARAMETERS}
MESSAGES_TOOL = {"name": "add", "description": "Add.", "input_schema": PARAMETERS}
USER = [{"role": "user", "content": QUESTION}]


def chat_body(stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "tools": [CHAT_TOOL], "max_tokens": 2100, "stream": stream}


def responses_body(stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "input": QUESTION, "tools": [RESPONSES_TOOL], "max_output_tokens": 2100, "stream": stream}


def messages_body(stream: bool) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "tools": [MESSAGES_TOOL], "max_tokens": 2100, "stream": stream}


def events(text: str) -> list[dict[str, Any]]:
    """The JSON of every `data:` line of a stream, decoded by the stdlib."""
    lines = [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(data) for data in lines if data != "[DONE]"]


def chat_whole(answer: str) -> Any:
    [call] = json.loads(answer)["choices"][0]["message"]["tool_calls"]
    return json.loads(call["function"]["arguments"])


def chat_streamed(answer: str) -> Any:
    deltas = [c["delta"] for e in events(answer) for c in e["choices"]]
    return json.loads("".join(t["function"].get("arguments") or "" for d in deltas for t in d.get("tool_calls") or []))


def responses_whole(answer: str) -> Any:
    [call] = [item for item in json.loads(answer)["output"] if item["type"] == "function_call"]
    return json.loads(call["arguments"])


def responses_streamed(answer: str) -> Any:
    [done] = [e for e in events(answer) if e["type"] == "response.function_call_arguments.done"]
    [completed] = [e for e in events(answer) if e["type"] == "response.completed"]
    [call] = [item for item in completed["response"]["output"] if item["type"] == "function_call"]
    assert call["arguments"] == done["arguments"]
    return json.loads(done["arguments"])


def messages_whole(answer: str) -> Any:
    [use] = [block for block in json.loads(answer)["content"] if block["type"] == "tool_use"]
    return use["input"]


def messages_streamed(answer: str) -> Any:
    deltas = [e["delta"] for e in events(answer) if e["type"] == "content_block_delta"]
    return json.loads("".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta"))


Route = tuple[str, Callable[[bool], dict[str, Any]], Callable[[str], Any]]
ROUTES: dict[str, Route] = {
    "chat": ("/v1/chat/completions", chat_body, chat_whole),
    "chat streamed": ("/v1/chat/completions", chat_body, chat_streamed),
    "responses": ("/v1/responses", responses_body, responses_whole),
    "responses streamed": ("/v1/responses", responses_body, responses_streamed),
    "messages": ("/v1/messages", messages_body, messages_whole),
    "messages streamed": ("/v1/messages", messages_body, messages_streamed),
}


async def served_tool_call(make_sim: SimFactory, make_gateway: GatewayFactory) -> RunningGateway:
    """A gateway over a simulator scripted to answer `QUESTION` with a hermes call of `add` with `ARGUMENTS`."""
    tokenizer = ChatTokenizer.load(TINY_TOKENIZER_DIR)
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])  # before the script: a gateway's start resets its replicas
    call = '<tool_call>\n{"name": "add", "arguments": ' + json.dumps(ARGUMENTS) + "}\n</tool_call>"
    reply = [*tokenizer.encode(call), tokenizer.end_of_turn_id]
    sim.engine.add_script(tokenizer.render(USER, [CHAT_TOOL])[-12:], reply)  # every route's prompt ends so
    return gw


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_integer_arguments_beyond_64_bits_reach_the_client(
    route: str, make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    gw = await served_tool_call(make_sim, make_gateway)
    path, body, arguments_of = ROUTES[route]
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        answer = await http.post(path, json=body(route.endswith("streamed")))
        assert answer.status_code == 200, answer.text[:300]
        assert arguments_of(answer.text) == ARGUMENTS
        assert (await http.get("/health")).status_code == 200  # on the same kept-alive connection
        assert answer.http_version == "HTTP/1.1" and answer.headers.get("connection") != "close"


async def test_a_messages_tool_use_with_such_an_integer_can_be_sent_back(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """The agent's next turn carries the model's call back as the model wrote it: taken, not a 400."""
    gw = await served_tool_call(make_sim, make_gateway)
    async with httpx.AsyncClient(base_url=gw.url, timeout=30) as http:
        first = await http.post("/v1/messages", json=messages_body(False), headers={"x-session-id": "big-ints"})
        assert first.status_code == 200, first.text[:300]
        [use] = [block for block in json.loads(first.text)["content"] if block["type"] == "tool_use"]
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": "0"}
        messages = [*USER, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
        body = json.dumps(messages_body(False) | {"messages": messages, "max_tokens": 4})
        second = await http.post(
            "/v1/messages", content=body, headers={"x-session-id": "big-ints", "content-type": "application/json"}
        )
        assert second.status_code == 200, second.text[:300]
        assert json.loads(second.text)["rollout"]["choices"][0]["sample_index"] == 0
