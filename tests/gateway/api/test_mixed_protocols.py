"""One session, three wire protocols (issue 36 §2): an agent that speaks OpenAI chat, then Anthropic Messages, then
the OpenAI Responses API, each echoing the conversation in its own shapes, stays one exact token sequence: one
sample, every turn's sampled ids in it (loss mask 1), the template's tokens between them (mask 0). Real simulator,
gateway and Redis; the official clients, configured with a base URL only."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai

from tests.conftest import GatewayFactory, SimFactory


async def test_a_session_mixing_chat_messages_and_responses_is_one_exact_sample(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    base = f"{gw.url}/sessions/mixed"
    chat_api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0)
    messages_api = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0)
    sampled: list[list[int]] = []

    first = await chat_api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "one"}], max_tokens=6, temperature=0
    )
    reply_1 = first.choices[0].message.content or ""
    sampled.append((first.model_extra or {})["rollout"]["choices"][0]["output_ids"])

    history: list[Any] = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": reply_1},
        {"role": "user", "content": "two"},
    ]
    second = await messages_api.messages.create(model="tiny", max_tokens=6, messages=history)
    reply_2 = "".join(block.text for block in second.content if block.type == "text")
    sampled.append((second.model_extra or {})["rollout"]["choices"][0]["output_ids"])

    items: list[Any] = [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": reply_1},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": reply_2},
        {"role": "user", "content": "three"},
    ]
    third = await chat_api.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    rollout = (third.model_extra or {})["rollout"]["choices"][0]
    assert rollout["sample_index"] == 0 and not rollout["new_sample"]
    sampled.append(rollout["output_ids"])

    [sample] = await gw.services.store.load_samples("mixed")
    response, mask = sample.response_ids.tolist(), sample.loss_mask.tolist()
    assert sample.num_turns == 3
    # The sampled ids are the mask-1 ids, turn after turn; what lies between is the template's (mask 0).
    assert [token for token, m in zip(response, mask, strict=True) if m] == [t for turn in sampled for t in turn]
    assert response[: len(sampled[0])] == sampled[0] and response[len(response) - len(sampled[2]) :] == sampled[2]
    await chat_api.close()
    await messages_api.close()
