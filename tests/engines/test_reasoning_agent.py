"""A reasoning tool agent on the real engines (issue 49 §4): the `think` tiny model (scripts/think_model.py: the tiny
tokenizer dressed as Qwen3, trained to write a think block and a tool call after a user message, a think block and
an answer after a tool result) behind a gateway with `model.reasoning_parser: qwen3` and `model.tool_parser: hermes`.
Three turns whose agent never sends the reasoning back, an abort weight update between the first two:

- `sessions.history: tokens`: one sample; each turn's prompt is the sample's ids so far plus what the template writes
  after a reply, and the engine got exactly that prompt (its prompt-token counter rose by its length, and the engine
  run alone on it gives the turn's tokens and log-probabilities);
- `template`: Qwen3's template drops the reasoning, so each turn starts a new sample (one per turn).

One engine server per kind for the module (started after the tier's own, never two at once)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from gateway.config import ReplicaConfig
from tests.conftest import ADMIN, GatewayFactory
from tests.engines.direct import greedy, metric, restore
from tests.engines.servers import EngineServer, engine_server
from tests.gateway_helpers import client

pytestmark = [pytest.mark.timeout(300)]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
PROMPT_TOKENS = {"vllm": "vllm:prompt_tokens_total", "sglang": "sglang:prompt_tokens_total"}


@pytest.fixture(
    scope="module",
    params=[pytest.param("vllm", marks=pytest.mark.vllm), pytest.param("sglang", marks=pytest.mark.sglang)],
)
def think_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with engine_server(request.param, tmp_path_factory.mktemp(f"think-{request.param}"), model="think") as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_keepalive_connections=0)  # as tests/engines/conftest.py: a busy engine drops idle ones
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as answer:
        yield answer


async def turn(
    http: httpx.AsyncClient, server: EngineServer, api: Any, messages: list[Any]
) -> tuple[Any, dict[str, Any], float]:
    """One turn: the choice, its rollout record and how many prompt tokens the engine counted for it."""
    before = await metric(http, server, PROMPT_TOKENS[server.kind])
    answer = await api.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=64, temperature=0
    )
    counted = await metric(http, server, PROMPT_TOKENS[server.kind]) - before
    choice = answer.choices[0]
    assert ((choice.message.model_extra or {}).get("reasoning_content") or "").strip(), choice.message  # it thought
    return choice, (answer.model_extra or {})["rollout"]["choices"][0], counted


def called(choice: Any) -> dict[str, Any]:
    """The reply as the agent sends it back: its call, no reasoning."""
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"], choice.message
    return {"role": "assistant", "content": choice.message.content, "tool_calls": [c.model_dump() for c in calls]}


@pytest.mark.parametrize("history", ["tokens", "template"])
async def test_a_reasoning_tool_agent_is_one_sample_in_tokens_mode(
    think_server: EngineServer, make_gateway: GatewayFactory, http: httpx.AsyncClient, history: str
) -> None:
    server = think_server
    await restore(http, server)
    model = {"tokenizer": str(server.model_path), "max_model_len": 4096, "reasoning_parser": "qwen3"}
    gw = await make_gateway(
        [ReplicaConfig(url=server.url, backend=server.kind)],
        model={**model, "tool_parser": "hermes"},
        sessions={"history": history},
        generation={"request_timeout_s": 300},
    )
    session = f"agent-{history}"
    api = client(gw, **{"X-Session-ID": session})
    messages: list[Any] = [{"role": "user", "content": "Is it warm in Paris today?"}]
    first, rollout1, counted1 = await turn(http, server, api, messages)
    reply = called(first)
    update = {"version": 1, "path": server.second_checkpoint, "mode": "abort"}  # the episode spans two versions
    assert (await http.post(f"{gw.url}/admin/weights", json=update, headers=ADMIN, timeout=300)).status_code == 200
    call_id = reply["tool_calls"][0]["id"]
    messages += [reply, {"role": "tool", "tool_call_id": call_id, "content": "18 C, sunny"}]
    second, rollout2, counted2 = await turn(http, server, api, messages)
    assert not second.message.tool_calls and (second.message.content or "").strip() == "Here is the weather."
    messages += [{"role": "assistant", "content": second.message.content}, {"role": "user", "content": "And tomorrow?"}]
    third, rollout3, counted3 = await turn(http, server, api, messages)
    called(third)
    await api.close()

    rollouts = [rollout1, rollout2, rollout3]
    samples = await gw.services.store.load_samples(session)
    if history == "tokens":
        assert [(r["sample_index"], r["new_sample"]) for r in rollouts] == [(0, True), (0, False), (0, False)]
        [sample] = samples
        mask = sample.loss_mask.tolist()
        starts = [i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])]
        ends = [*[i for i in range(1, len(mask)) if not mask[i] and mask[i - 1]], len(mask)]
        prompts = [sample.input_ids[: sample.prompt_ids.size + start].tolist() for start in starts]
        turns = [(start, end) for start, end in zip(starts, ends, strict=True)]
        assert sorted(set(sample.versions[sample.loss_mask == 1].tolist())) == [0, 1]
        sampled = [(sample.response_ids[a:b].tolist(), sample.logprobs[a:b]) for a, b in turns]
    else:
        assert [(r["sample_index"], r["new_sample"]) for r in rollouts] == [(0, True), (1, True), (2, True)]
        prompts = [s.prompt_ids.tolist() for s in samples]
        sampled = [(s.response_ids.tolist(), s.logprobs) for s in samples]
    assert [len(prompt) for prompt in prompts] == [counted1, counted2, counted3]  # what the engine counted
    for prompt, (output, logprobs), rollout in zip(prompts, sampled, rollouts, strict=True):
        assert output == rollout["output_ids"]
        alone, alone_logprobs = await greedy(http, server, prompt, len(output))  # the engine run on that prompt alone
        assert alone == output and np.allclose(alone_logprobs, logprobs, atol=1e-4)
    await gw.stop()
    await restore(http, server)
