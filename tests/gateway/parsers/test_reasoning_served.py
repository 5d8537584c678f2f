"""Reasoning through a served gateway: each family's tokenizer and chat template (`model.tokenizer`), its parser
(`model.reasoning_parser`, or `auto`), simulator replicas scripted to sample the family's exact reasoning markup, the
official `openai` client. The reasoning arrives as `reasoning_content` (whole) or `delta.reasoning_content`
(streamed), the content without the markup, and the session's sample in Redis keeps every sampled id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway.parsers.reasoning_families import DEEPSEEK_R1, FAMILIES, GLM45, KIMI_K2, QWEN3, Family
from tests.gateway_helpers import client

MESSAGES: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]

# What each family's model samples after the generation prompt (DeepSeek-R1's prompt opened `<think>\n` already).
REPLIES = {
    QWEN3.parser: ("<think>\nAdd them.\n</think>\n\nIt is 4.", "\nAdd them.\n", "\n\nIt is 4."),
    DEEPSEEK_R1.parser: ("Add them.\n</think>\n\nIt is 4.", "Add them.\n", "\n\nIt is 4."),
    GLM45.parser: ("\n<think>Add them.</think>\nIt is 4.", "Add them.", "\nIt is 4."),
    KIMI_K2.parser: ("<think>Add them.</think>It is 4.", "Add them.", "It is 4."),
}


async def served(
    family: Family,
    folder: Path,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    parser: str | None = None,
    history: str = "tokens",
) -> tuple[RunningGateway, ChatTokenizer, str]:
    """A gateway serving `family` over one simulator with the same vocabulary and end-of-sequence token, its
    sessions' history in `history` mode; the replica's URL, to script it."""
    tokenizer_dir = family.tokenizer_dir(folder)
    tokenizer = ChatTokenizer.load(tokenizer_dir)
    shape = ModelShape(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_token_id)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape))
    model = {"tokenizer": str(tokenizer_dir), "reasoning_parser": parser or family.parser}
    return await make_gateway([sim], model=model, sessions={"history": history}), tokenizer, sim.url


async def script(http: httpx.AsyncClient, sim_url: str, tokenizer: ChatTokenizer, output: str) -> list[int]:
    """Make the replica sample `output` (then its EOS) for MESSAGES; the scripted ids."""
    ids = tokenizer.encode(output)
    answer = await http.post(f"{sim_url}/sim/script", json={"prompt_suffix": tokenizer.render(MESSAGES), "output": ids})
    assert answer.status_code == 200, answer.text
    return ids


async def sampled_ids(gw: RunningGateway, session: str) -> list[int]:
    [sample] = await gw.services.store.load_samples(session)
    ids: list[int] = sample.response_ids.tolist()
    return ids


def reasoning_of(message: Any) -> str | None:
    """`reasoning_content`, a field the openai client does not know: it keeps it as an extra."""
    value: str | None = (message.model_extra or {}).get("reasoning_content")
    return value


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.parser)
async def test_a_whole_answer_carries_the_reasoning_apart(
    family: Family, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, tokenizer, sim_url = await served(family, tmp_path, make_sim, make_gateway)
    output, reasoning, content = REPLIES[family.parser]
    ids = await script(http, sim_url, tokenizer, output)
    api = client(gw, **{"X-Session-ID": f"whole-{family.parser}"})
    chat = await api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    message = chat.choices[0].message
    assert (reasoning_of(message), message.content) == (reasoning, content)
    assert chat.choices[0].finish_reason == "stop"
    assert (await sampled_ids(gw, f"whole-{family.parser}"))[: len(ids)] == ids  # reasoning included
    await api.close()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.parser)
async def test_a_streamed_answer_sends_reasoning_deltas(
    family: Family, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, tokenizer, sim_url = await served(family, tmp_path, make_sim, make_gateway)
    output, reasoning, content = REPLIES[family.parser]
    ids = await script(http, sim_url, tokenizer, output)
    api = client(gw, **{"X-Session-ID": f"stream-{family.parser}"})
    stream = await api.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=64, temperature=0, stream=True
    )
    reasoning_parts: list[str] = []
    content_parts: list[str] = []
    async for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning_parts.append((delta.model_extra or {}).get("reasoning_content") or "")
        content_parts.append(delta.content or "")
    assert ("".join(reasoning_parts), "".join(content_parts)) == (reasoning, content)
    assert sum(bool(p) for p in reasoning_parts) > 1  # streamed as it was sampled, not in one piece at the end
    assert (await sampled_ids(gw, f"stream-{family.parser}"))[: len(ids)] == ids
    await api.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_reply_cut_inside_the_reasoning_is_all_reasoning(
    stream: bool, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, tokenizer, sim_url = await served(QWEN3, tmp_path, make_sim, make_gateway)
    ids = await script(http, sim_url, tokenizer, "<think>\nFirst add two and two, then check.\n</think>\n\nIt is 4.")
    cut = 6
    api = client(gw, **{"X-Session-ID": "cut"})
    body: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": cut, "temperature": 0}
    if stream:
        reasoning, content, finish = "", "", None
        async for chunk in await api.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
    else:
        chat = await api.chat.completions.create(**body)
        reasoning, content, finish = (
            reasoning_of(chat.choices[0].message) or "",
            chat.choices[0].message.content,
            (chat.choices[0].finish_reason),
        )
    assert finish == "length"
    assert reasoning == tokenizer.decode(ids[1:cut]) and not content  # `<think>` is markup, the rest reasoning
    assert await sampled_ids(gw, "cut") == ids[:cut]
    await api.close()


async def test_a_reply_without_reasoning_is_all_content(
    tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, tokenizer, sim_url = await served(GLM45, tmp_path, make_sim, make_gateway)
    await script(http, sim_url, tokenizer, "\nIt is 4.")
    api = client(gw)
    chat = await api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    assert (reasoning_of(chat.choices[0].message), chat.choices[0].message.content) == (None, "\nIt is 4.")
    await api.close()


@pytest.mark.parametrize("family", [DEEPSEEK_R1, KIMI_K2], ids=lambda f: f.parser)
async def test_auto_picks_the_parser_from_the_template(
    family: Family, tmp_path: Path, make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw, tokenizer, sim_url = await served(family, tmp_path, make_sim, make_gateway, parser="auto")
    output, reasoning, content = REPLIES[family.parser]
    await script(http, sim_url, tokenizer, output)
    api = client(gw)
    chat = await api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    assert (reasoning_of(chat.choices[0].message), chat.choices[0].message.content) == (reasoning, content)
    await api.close()


async def two_turns(api: Any, echo_reasoning: bool) -> tuple[list[Any], dict[str, Any]]:
    """MESSAGES, then the reply (its reasoning sent back or not) and the user message "And 3 + 3?": the second
    turn's messages and its rollout choice."""
    first = await api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=64, temperature=0)
    reply: dict[str, Any] = {"role": "assistant", "content": first.choices[0].message.content}
    if echo_reasoning:
        reply["reasoning_content"] = reasoning_of(first.choices[0].message)
    messages = [*MESSAGES, reply, {"role": "user", "content": "And 3 + 3?"}]
    second = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    return messages, (second.model_extra or {})["rollout"]["choices"][0]


# What each family's template writes after a reply for the user message "And 3 + 3?" (its published template's
# renders: tests/gateway/history/goldens/), tokenized after the sampled EOS.
NEXT_USER = {
    QWEN3.parser: "\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n",
    DEEPSEEK_R1.parser: "<｜User｜>And 3 + 3?<｜Assistant｜><think>\n",
    GLM45.parser: "<|user|>And 3 + 3?<|assistant|>",
    KIMI_K2.parser: "<|im_user|>user<|im_middle|>And 3 + 3?<|im_end|><|im_assistant|>assistant<|im_middle|>",
}


@pytest.mark.parametrize("family", [QWEN3, DEEPSEEK_R1, GLM45, KIMI_K2], ids=lambda f: f.parser)
@pytest.mark.parametrize("echo_reasoning", [True, False], ids=["reasoning-echoed", "reasoning-dropped"])
async def test_a_template_that_drops_earlier_reasoning_keeps_one_sample_in_tokens_mode(
    family: Family,
    echo_reasoning: bool,
    tmp_path: Path,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
) -> None:
    """`sessions.history: tokens` (the default): the next user turn goes on from the first turn's exact ids, its
    reasoning and EOS as sampled, whether or not the agent sends the reasoning back; only what the template writes
    after a reply is new (loss mask 0), and the engine is prompted with exactly the sample's ids."""
    gw, tokenizer, sim_url = await served(family, tmp_path, make_sim, make_gateway)
    output, reasoning, content = REPLIES[family.parser]
    first_ids = await script(http, sim_url, tokenizer, output)
    (await http.post(f"{sim_url}/sim/prompt_log", json={"head": 64})).raise_for_status()
    api = client(gw, **{"X-Session-ID": "one-sample"})
    messages, rollout = await two_turns(api, echo_reasoning)
    assert not rollout["new_sample"] and rollout["sample_index"] == 0
    [sample] = await gw.services.store.load_samples("one-sample")
    env = tokenizer.encode(NEXT_USER[family.parser])
    first_turn = [*first_ids, tokenizer.eos_token_id]
    assert sample.response_ids.tolist() == first_turn + env + rollout["output_ids"]
    assert sample.loss_mask.tolist() == [1] * len(first_turn) + [0] * len(env) + [1] * 8
    assert sample.prompt_ids.tolist() == tokenizer.render(MESSAGES) and sample.num_turns == 2
    head, length, _ = (await http.get(f"{sim_url}/sim/prompt_log")).json()["requests"][-1]
    prompted = sample.prompt_ids.tolist() + first_turn + env  # what the engine was prompted with
    assert (head, length) == (prompted[:64], len(prompted))
    await api.close()


@pytest.mark.parametrize("echo_reasoning", [True, False], ids=["reasoning-echoed", "reasoning-dropped"])
async def test_a_template_that_drops_earlier_reasoning_makes_one_sample_per_turn_in_template_mode(
    echo_reasoning: bool,
    tmp_path: Path,
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
) -> None:
    """`sessions.history: template`: Qwen3's template drops an assistant turn's reasoning once a new user message
    follows it, so the next prompt does not extend the sampled ids (which hold the reasoning): the turn starts a new
    sample with the rendered history, each sample keeps its exact sampled ids, and `rewritten_from` chains the new
    one to the old."""
    gw, tokenizer, sim_url = await served(QWEN3, tmp_path, make_sim, make_gateway, history="template")
    output, reasoning, content = REPLIES[QWEN3.parser]
    first_ids = await script(http, sim_url, tokenizer, output)
    api = client(gw, **{"X-Session-ID": "chained"})
    messages, rollout = await two_turns(api, echo_reasoning)
    assert rollout["new_sample"] and rollout["sample_index"] == 1
    old, new = await gw.services.store.load_samples("chained")
    assert old.response_ids.tolist()[: len(first_ids)] == first_ids and old.rewritten_from is None
    assert "Add them." not in tokenizer.decode(new.prompt_ids.tolist())  # the template dropped it
    assert new.prompt_ids.tolist() == tokenizer.render(messages) and new.rewritten_from == 0
    assert new.response_ids.tolist() == rollout["output_ids"] and new.loss_mask.tolist() == [1] * 8
    await api.close()
