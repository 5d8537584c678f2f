"""Each family's tool calls through a served gateway: the tiny tokenizer dressed as the family (a chat template in
its format, its added tokens) is the gateway's `model.tokenizer` and the simulator's vocabulary; the simulator is
scripted to write the family's exact tool-call markup; the official `openai` client reads the calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.parsers.tool_families import FAMILIES, TOOLS, Family
from tests.gateway_helpers import client

ARGUMENTS = {"a": 1, "b": 2}
QUESTION: list[dict[str, Any]] = [{"role": "user", "content": "What is 1 + 2? Use the tool."}]
# Text that only tool-call markup holds: none of it may reach an agent's content.
MARKUP = ("<tool_call", "<function=", "<arg_", "[TOOL_CALLS", "<|tool", "<｜tool", '{"name"', "```json")


@pytest.fixture(params=sorted(FAMILIES), scope="module")
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def family_dir(family: Family, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return family.tokenizer_dir(tmp_path_factory.mktemp(family.name))


@pytest.fixture(scope="module")
def tokenizer(family_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.load(family_dir)


async def served(
    family: Family, family_dir: Path, tokenizer: ChatTokenizer, make_sim: SimFactory, make_gateway: GatewayFactory
) -> tuple[Any, RunningGateway]:
    """A simulator replica with the family's vocabulary and end-of-sequence token, behind a gateway serving the
    family's tokenizer and tool parser."""
    [eos] = tokenizer.encode(family.eos or "")
    shape = ModelShape(vocab_size=tokenizer.vocab_size, eos_token_id=eos)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape))
    model = {"tokenizer": str(family_dir), "tool_parser": family.name, "reasoning_parser": family.reasoning}
    gw = await make_gateway([sim], model=model)
    return sim, gw


def call_id(family: Family) -> str:
    """An id as the family's template takes it (Kimi writes back its own ids, Mistral wants 9 letters and digits)."""
    return "functions.add:0" if family.name == "kimi_k2" else "abcDEF123"


def script_reply(
    sim: Any, tokenizer: ChatTokenizer, family: Family, messages: list[dict[str, Any]], text: str | None = None
) -> list[int]:
    """Make the simulator answer `messages` with a call of `add`, in the text the family's template writes for it
    (through the end-of-turn token where the template writes one), or `text`: the ids of that reply."""
    function = {"name": "add", "arguments": json.dumps(ARGUMENTS)}
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": call_id(family), "type": "function", "function": function}],
    }
    prompt_text = tokenizer.render_text(messages, TOOLS)
    full_text = tokenizer.render_text([*messages, assistant], TOOLS, add_generation_prompt=False)
    if full_text.startswith(prompt_text):
        reply_text = full_text[len(prompt_text) :]
        end = tokenizer.decode([tokenizer.end_of_turn_id])
        reply_text = reply_text[: reply_text.index(end) + len(end)] if end in reply_text else reply_text
    else:  # DeepSeek-V3's template (vLLM's) indents a reply it writes: what the model writes after the prompt
        reply_text = family.markup([("add", ARGUMENTS)]) + (family.eos or "")
    reply = tokenizer.encode(text if text is not None else reply_text)
    sim.engine.add_script(tokenizer.render(messages, TOOLS)[-12:], reply)
    return reply


async def stream_turn(api: openai.AsyncOpenAI, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One streamed turn, folded: content, tool calls (each checked to come id and name first), finish reason,
    and the rollout's output ids."""
    stream = await api.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=max_tokens, temperature=0, stream=True
    )
    content, calls, finish, output = "", {}, None, None
    async for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:
                    assert delta.id and delta.function and delta.function.name
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += (delta.function.arguments if delta.function else None) or ""
            if choice.finish_reason:
                finish = choice.finish_reason
                output = chunk.model_extra["rollout"]["choices"][0]["output_ids"] if chunk.model_extra else None
    return {"content": content, "calls": [calls[i] for i in sorted(calls)], "finish": finish, "output": output}


async def test_tool_calls_whole_and_streamed(
    family: Family,
    family_dir: Path,
    tokenizer: ChatTokenizer,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
) -> None:
    sim, gw = await served(family, family_dir, tokenizer, make_sim, make_gateway)
    reply = script_reply(sim, tokenizer, family, QUESTION)
    async with client(gw) as api:
        whole = await api.chat.completions.create(
            model="tiny",
            messages=QUESTION,
            tools=TOOLS,
            max_tokens=64,
            temperature=0,  # type: ignore[arg-type]
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls or []
        assert call.function.name == "add" and json.loads(call.function.arguments) == ARGUMENTS
        assert not choice.message.content
        assert whole.model_extra and whole.model_extra["rollout"]["choices"][0]["output_ids"][: len(reply)] == reply
        streamed = await stream_turn(api, QUESTION, 64)
        assert streamed["finish"] == "tool_calls" and not streamed["content"]
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == [("add", ARGUMENTS)]
        if family.name == "kimi_k2":  # the model's own id, whole and streamed
            assert call.id == streamed["calls"][0]["id"] == "functions.add:0"


async def test_a_reply_cut_inside_its_call_ends_length_without_markup(
    family: Family,
    family_dir: Path,
    tokenizer: ChatTokenizer,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
) -> None:
    sim, gw = await served(family, family_dir, tokenizer, make_sim, make_gateway)
    reply = script_reply(sim, tokenizer, family, QUESTION)
    cut = len(reply) - 3  # inside the call: its end marker (and the end of the turn) never come
    async with client(gw) as api:
        whole = await api.chat.completions.create(
            model="tiny",
            messages=QUESTION,
            tools=TOOLS,
            max_tokens=cut,
            temperature=0,  # type: ignore[arg-type]
        )
        streamed = await stream_turn(api, QUESTION, cut)
        for finish, content, calls in (
            (whole.choices[0].finish_reason, whole.choices[0].message.content, whole.choices[0].message.tool_calls),
            (streamed["finish"], streamed["content"], streamed["calls"]),
        ):
            assert finish == "length" and not calls
            assert not any(m in (content or "") for m in MARKUP), content
            assert not (content or "").strip(), content  # the reply held nothing else


# Families whose template writes a reply as the model is prompted to write it (the generation prompt, then the
# reply): there, what the model saw before its second turn is the template's rendering of the whole conversation.
# The Mistral template (vLLM's) moves the system prompt to the last user message, and the DeepSeek-V3 one indents a
# reply's calls, so their next prompt is the exact earlier tokens plus what the tool result adds.
RENDERS_ITS_OWN_REPLY = {"qwen3_coder", "kimi_k2", "llama3_json", "glm45"}


async def test_a_tool_result_renders_through_the_familys_template_into_one_exact_sample(
    family: Family,
    family_dir: Path,
    tokenizer: ChatTokenizer,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
) -> None:
    """A streamed tool call, its result sent back: the session's one sample holds the exact sampled ids of both
    turns (mask 1) around the template's rendering of the tool result (mask 0). The Mistral model writes no id
    here: the one the gateway made and streamed is the one its recorded reply holds, which the template writes."""
    sim, gw = await served(family, family_dir, tokenizer, make_sim, make_gateway)
    no_id = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]</s>' if family.name == "mistral" else None
    script_reply(sim, tokenizer, family, QUESTION, no_id)
    async with client(gw, **{"X-Session-ID": "agent-1"}) as api:
        first = await stream_turn(api, QUESTION, 64)
        [call] = first["calls"]
        function = {"name": "add", "arguments": call["arguments"]}
        assistant = {
            "role": "assistant",
            "content": first["content"] or None,
            "tool_calls": [{"id": call["id"], "type": "function", "function": function}],
        }
        messages = [*QUESTION, assistant, {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
        second = await api.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=TOOLS,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        rollout = second.model_extra["rollout"]["choices"][0] if second.model_extra else {}
        assert rollout["sample_index"] == 0 and not rollout["new_sample"]
        [sample] = await gw.services.store.load_samples("agent-1")
        sampled1, sampled2 = first["output"], rollout["output_ids"]
        response, mask = sample.response_ids.tolist(), sample.loss_mask.tolist()
        assert sample.prompt_ids.tolist() == tokenizer.render(QUESTION, TOOLS)
        assert response[: len(sampled1)] == sampled1 and response[len(response) - len(sampled2) :] == sampled2
        env = response[len(sampled1) : len(response) - len(sampled2)]
        assert env and mask == [1] * len(sampled1) + [0] * len(env) + [1] * len(sampled2)
        rendered = tokenizer.render_text(messages, TOOLS)
        assert rendered.endswith(tokenizer.decode(env)) and "3" in tokenizer.decode(env)
        if family.name in RENDERS_ITS_OWN_REPLY:
            seen = sample.input_ids.tolist()[: len(sample.input_ids) - len(sampled2)]
            assert tokenizer.decode(seen) == rendered
