"""Issue 52 §3: the prompt bound over every text of a request, on every route, over real HTTP. Tools, their schemas,
tool calls' arguments, Anthropic's `tool_use.input`, `tool_result`, `system` and tools, and Responses' tools and
items were rendered and tokenized whole before their 400 (megabytes of tool descriptions: seconds of CPU and
gigabytes of memory), and `/v1/messages/count_tokens` answered 200 for a `system` of megabytes. Each is now refused
before rendering (OpenAI's error shape naming its field, Anthropic's naming none), and nothing of it reaches the
tokenizer's worker threads (which take every long text)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from gateway.server import RunningGateway
from gateway.turns.prompts import LIKELY_MAX_CHARS_PER_TOKEN
from tests.conftest import GatewayFactory, SimFactory

CONTEXT = 4096  # the tiny model's context length
WORDS = "word " * 80_000  # more characters than the context holds of the tiny vocabulary's longest token
USER = [{"role": "user", "content": "x"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
BIG_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string", "description": "word " * 100} for i in range(1000)},
}


def chat_tool(description: str = "adds", parameters: dict[str, Any] = SCHEMA, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def called(arguments: str | dict[str, Any]) -> list[dict[str, Any]]:
    """A conversation whose assistant called `f` with `arguments`, answered."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]


def anthropic_used(tool_input: dict[str, Any], result: Any = "3") -> list[dict[str, Any]]:
    """An Anthropic conversation whose assistant used `f` with `tool_input`, answered by `result`."""
    use = {"type": "tool_use", "id": "c1", "name": "f", "input": tool_input}
    return [
        *USER,
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": result}]},
    ]


def responses_called(arguments: str, output: str = "3") -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": output},
    ]


CHAT = {"model": "tiny", "max_tokens": 2, "messages": USER}
ANTHROPIC = {"model": "tiny", "max_tokens": 2, "messages": USER}
COUNT = {"model": "tiny", "messages": USER}
RESPONSES = {"model": "tiny", "max_output_tokens": 2, "input": "x"}
CHAT_PATH, MESSAGES_PATH, COUNT_PATH, RESPONSES_PATH = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)
ANSWERED = [*called("{}")[:2], {"role": "tool", "tool_call_id": "c1", "content": WORDS}]
TOOL_DESCRIBED = {"name": "f", "description": WORDS, "input_schema": SCHEMA}  # Anthropic's
TOOL_SCHEMA = {"name": "f", "input_schema": BIG_SCHEMA}
FUNCTION_DESCRIBED = {"type": "function", "name": "f", "description": WORDS}  # Responses'
FUNCTION_SCHEMA = {"type": "function", "name": "f", "parameters": BIG_SCHEMA}

OVERSIZED = [
    ("chat: tool descriptions", CHAT_PATH, CHAT | {"tools": [chat_tool(WORDS[:50_000])] * 8}, "tools"),
    ("chat: a parameters schema", CHAT_PATH, CHAT | {"tools": [chat_tool(parameters=BIG_SCHEMA)]}, "tools"),
    ("chat: arguments (text)", CHAT_PATH, CHAT | {"messages": called(WORDS)}, "messages"),
    ("chat: arguments (object)", CHAT_PATH, CHAT | {"messages": called({"a": WORDS})}, "messages"),
    ("chat: a tool's answer", CHAT_PATH, CHAT | {"messages": ANSWERED}, "messages"),
    ("anthropic: tool_use.input", MESSAGES_PATH, ANTHROPIC | {"messages": anthropic_used({"a": WORDS})}, None),
    ("anthropic: tool_result", MESSAGES_PATH, ANTHROPIC | {"messages": anthropic_used({}, WORDS)}, None),
    ("anthropic: system", MESSAGES_PATH, ANTHROPIC | {"system": WORDS}, None),
    ("anthropic: tools", MESSAGES_PATH, ANTHROPIC | {"tools": [TOOL_DESCRIBED]}, None),
    ("anthropic: input_schema", MESSAGES_PATH, ANTHROPIC | {"tools": [TOOL_SCHEMA]}, None),
    ("count_tokens: system", COUNT_PATH, COUNT | {"system": [{"type": "text", "text": WORDS}]}, None),
    ("count_tokens: tools", COUNT_PATH, COUNT | {"tools": [TOOL_DESCRIBED]}, None),
    ("count_tokens: tool_use.input", COUNT_PATH, COUNT | {"messages": anthropic_used({"a": WORDS})}, None),
    ("responses: tools", RESPONSES_PATH, RESPONSES | {"tools": [FUNCTION_DESCRIBED]}, "tools"),
    ("responses: a parameters schema", RESPONSES_PATH, RESPONSES | {"tools": [FUNCTION_SCHEMA]}, "tools"),
    ("responses: arguments", RESPONSES_PATH, RESPONSES | {"input": responses_called(WORDS)}, "messages"),
    (
        "responses: a function's output",
        RESPONSES_PATH,
        RESPONSES | {"input": responses_called("{}", WORDS)},
        "messages",
    ),
    ("responses: instructions", RESPONSES_PATH, RESPONSES | {"instructions": WORDS}, "messages"),
]


async def gateway_on(make_sim: SimFactory, make_gateway: GatewayFactory) -> RunningGateway:
    return await make_gateway([await make_sim("vllm")])


def refusal(response: httpx.Response, param: str | None) -> str:
    """The refusal's message, its shape checked: OpenAI's naming `param`, or Anthropic's (None) naming no field."""
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    if param is None:
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["param"] == param and body["error"]["code"] == "context_length_exceeded"
    message: str = body["error"]["message"]
    return message


@pytest.mark.parametrize(("path", "body", "param"), [case[1:] for case in OVERSIZED], ids=[c[0] for c in OVERSIZED])
async def test_every_text_of_a_request_is_bounded_before_rendering(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    path: str,
    body: dict[str, Any],
    param: str | None,
) -> None:
    gw = await gateway_on(make_sim, make_gateway)
    message = refusal(await http.post(f"{gw.url}{path}", json=body), param)
    assert f"cannot fit the context length of {CONTEXT} tokens" in message
    assert gw.services.turns.tokenizer.thread_encodes == 0  # by its length alone: nothing tokenized
    assert not [key async for key in redis.scan_iter(match="rg:{*")]


def dashes(tools: int, each: int) -> list[dict[str, Any]]:
    """`tools` tools of `each` dashes of description: many characters a token of the tiny vocabulary, so many
    characters for few tokens (a text the length bound lets through and only counting tells)."""
    return [chat_tool("-" * each, name=f"f{i}") for i in range(tools)]


async def test_tools_within_the_length_bound_but_over_the_context_are_counted_in_chunks(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Tools too short for the length bound alone but longer than the context: refused after counting their first
    chunk, not after rendering them."""
    gw = await gateway_on(make_sim, make_gateway)
    tools = [chat_tool(WORDS[:20_000], name=f"f{i}") for i in range(8)]  # within the length bound, not the context
    message = refusal(await http.post(f"{gw.url}/v1/chat/completions", json=CHAT | {"tools": tools}), "tools")
    assert f"counted up to the context length of {CONTEXT} tokens" in message
    assert gw.services.turns.tokenizer.thread_encodes == 1
    count = COUNT | {
        "tools": [{"name": f"f{i}", "description": WORDS[:20_000], "input_schema": SCHEMA} for i in range(8)]
    }
    message = refusal(await http.post(f"{gw.url}/v1/messages/count_tokens", json=count), None)
    assert f"counted up to the context length of {CONTEXT} tokens" in message


async def test_a_large_tool_set_within_the_context_is_served(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Tools of more characters than the count threshold (`LIKELY_MAX_CHARS_PER_TOKEN` a token of the context) whose
    rendering fits the context: counted, let through, rendered; the answer's prompt is theirs, and count_tokens says
    as much."""
    gw = await gateway_on(make_sim, make_gateway)
    tokenizer = gw.services.turns.tokenizer
    tools = dashes(16, 2_880)
    prompt = len(tokenizer.render(USER, tools))
    assert sum(len(t["function"]["description"]) for t in tools) > LIKELY_MAX_CHARS_PER_TOKEN * CONTEXT
    assert CONTEXT - 64 < prompt < CONTEXT  # just under the context
    body = CHAT | {"tools": tools, "max_tokens": CONTEXT - prompt}
    response = await http.post(f"{gw.url}/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text[:300]
    assert response.json()["usage"]["prompt_tokens"] == prompt
    assert tokenizer.thread_encodes >= 1  # counted before it was rendered
    anthropic = [
        {"name": t["function"]["name"], "description": t["function"]["description"], "input_schema": SCHEMA}
        for t in tools
    ]
    count = await http.post(f"{gw.url}/v1/messages/count_tokens", json=COUNT | {"tools": anthropic})
    assert count.status_code == 200 and count.json()["input_tokens"] == prompt
