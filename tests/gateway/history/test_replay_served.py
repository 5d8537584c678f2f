"""Loose replays through a served gateway: a Qwen3-style reasoning agent (the family's tokenizer and template,
`model.reasoning_parser: qwen3`, `model.tool_parser: hermes`) whose framework sends the conversation back its own way
(no reasoning, arguments re-serialized, its own tool-call id, a text as parts, other whitespace) keeps one sample
under `sessions.replay_match: loose`, each kind counted in `rollout_gateway_replays_forgiven_total`; `strict` makes
the same replay a new sample, and a real edit is a new sample in both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.parsers.reasoning_families import QWEN3
from tests.gateway_helpers import client, scrape, value

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "n": {"type": "integer"}}},
        },
    }
]
MESSAGES: list[dict[str, Any]] = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Paris?"}]
REPLY = (
    '<think>\nLook it up.\n</think>\n\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "n": 2}}\n'
    "</tool_call>"
)


async def served(
    folder: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, match: str
) -> tuple[RunningGateway, ChatTokenizer]:
    """A gateway in tokens mode with `sessions.replay_match: match`, its replica scripted to answer MESSAGES with
    REPLY (then its EOS)."""
    tokenizer_dir = QWEN3.tokenizer_dir(folder)
    tokenizer = ChatTokenizer.load(tokenizer_dir)
    shape = ModelShape(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape))
    model = {"tokenizer": str(tokenizer_dir), "reasoning_parser": "qwen3", "tool_parser": "hermes"}
    gw = await make_gateway([sim], model=model, sessions={"history": "tokens", "replay_match": match})
    prompt = tokenizer.render(MESSAGES, TOOLS)
    script = {"prompt_suffix": prompt, "output": tokenizer.encode(REPLY)}
    (await http.post(f"{sim.url}/sim/script", json=script)).raise_for_status()
    return gw, tokenizer


async def first_then_replay(gw: RunningGateway, session: str, edit: bool = False) -> dict[str, Any]:
    """The tool-call turn, then the conversation as the agent's framework sends it back with the tool's result (the
    call's arguments changed too, if `edit`): the second turn's rollout choice."""
    api = client(gw, **{"X-Session-ID": session})
    first = await api.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=64,
        temperature=0,  # type: ignore[arg-type]
    )
    [call] = first.choices[0].message.tool_calls or []
    arguments = json.loads(call.function.arguments)
    assert arguments == {"city": "Paris", "n": 2}
    if edit:
        arguments["city"] = "Rome"
    replay = [
        {"role": "system", "content": "Be terse.\n"},
        {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "agent-call-1",
                    "type": "function",
                    "function": {
                        "name": "weather",
                        "arguments": json.dumps(dict(reversed(arguments.items())), separators=(",", ":")),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "agent-call-1", "content": "18 C"},
    ]
    second = await api.chat.completions.create(
        model="tiny",
        messages=replay,
        tools=TOOLS,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    await api.close()
    rollout: dict[str, Any] = (second.model_extra or {})["rollout"]["choices"][0]
    return rollout


FORGIVEN = ("reasoning", "arguments", "tool_call_id", "content_parts", "whitespace")


async def test_a_replay_in_the_frameworks_own_serialization_keeps_one_sample_when_loose(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, tokenizer = await served(tmp_path, make_sim, make_gateway, http, "loose")
    rollout = await first_then_replay(gw, "loose")
    assert not rollout["new_sample"] and rollout["sample_index"] == 0
    [sample] = await gw.services.store.load_samples("loose")
    response = sample.response_ids.tolist()
    first_turn = [*tokenizer.encode(REPLY), tokenizer.eos_token_id]
    env = tokenizer.encode(
        "\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert response == first_turn + env + rollout["output_ids"]  # the model's reply as sampled, then the result
    samples = await scrape(http, gw.url)
    for kind in FORGIVEN:
        assert value(samples, "rollout_gateway_replays_forgiven_total", kind=kind) == 1.0, kind
    assert value(samples, "rollout_gateway_chat_turns_total", history="tokens") == 1.0


@pytest.mark.parametrize(("match", "edit"), [("strict", False), ("loose", True)], ids=["strict", "loose-edited"])
async def test_the_same_replay_when_strict_and_an_edit_start_a_new_sample(
    match: str, edit: bool, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, _ = await served(tmp_path, make_sim, make_gateway, http, match)
    rollout = await first_then_replay(gw, "other", edit=edit)
    assert rollout["new_sample"] and rollout["sample_index"] == 1
    samples = await scrape(http, gw.url)
    assert value(samples, "rollout_gateway_chat_turns_total", history="rewritten") == 1.0
    assert value(samples, "rollout_gateway_chat_turns_total", history="tokens") == 0.0
    assert all(value(samples, "rollout_gateway_replays_forgiven_total", kind=kind) == 0.0 for kind in FORGIVEN)
