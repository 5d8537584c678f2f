"""A reasoning tool agent on the tier's engine (issue 49 §4), both tiers: the `think` tiny model
(scripts/think_model.py: the tiny tokenizer dressed as Qwen3 in its own 2,048 ids, a model of the dense models'
shape trained to write a think block and a tool call after a user message, a think block and an answer after a tool
result), loaded into the tier's server as a weight update, behind a gateway with `model.reasoning_parser: qwen3`
and `model.tool_parser: hermes`. Three turns whose agent never sends the reasoning back, an abort update (to
`think_v2`, the same weights) between the first two:

- `sessions.history: tokens`: one sample; each turn's prompt is the sample's ids so far plus what the template
  writes after a reply;
- `template`: Qwen3's template drops the reasoning, so each turn starts a new sample (one per turn).

In both, the engine got exactly each turn's stored prompt: the prompt ids the engine logged it received for the
session's requests (`tests.engines.received`; the gateway's request id, which names the session, reaches the
engine) are the three turns' prompts, in order, and nothing else; its prompt-token counter rose by each prompt's
length; and the engine run alone on each prompt gives the turn's tokens and log-probabilities. (A server the tier
did not start, `RG_<KIND>_URL`, has no log here: the counter and the rerun alone prove it there.)
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from gateway.config import ReplicaConfig
from scripts.think_model import TOOLS  # the tools the model was trained with
from tests.conftest import ADMIN, GatewayFactory
from tests.engines.direct import greedy, metric
from tests.engines.received import received_prompts
from tests.engines.servers import EngineServer
from tests.gateway_helpers import client

PROMPT_TOKENS = {"vllm": "vllm:prompt_tokens_total", "sglang": "sglang:prompt_tokens_total"}


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


async def update(http: httpx.AsyncClient, url: str, version: int, path: str) -> None:
    body = {"version": version, "path": path, "mode": "abort"}
    answer = await http.post(f"{url}/admin/weights", json=body, headers=ADMIN, timeout=300)
    assert answer.status_code == 200, answer.text


async def reasoning_agent_episode(
    http: httpx.AsyncClient, make_gateway: GatewayFactory, server: EngineServer, replica: dict[str, Any], history: str
) -> None:
    """The episode in `history` mode on `server` (restored by the caller, before and after)."""
    think = server.models / "think"
    model = {"tokenizer": str(think), "max_model_len": 4096, "reasoning_parser": "qwen3", "tool_parser": "hermes"}
    gw = await make_gateway(
        [ReplicaConfig(url=server.url, backend=server.kind, **replica)],
        model=model,
        sessions={"history": history},
        generation={"request_timeout_s": 300},
    )
    await update(http, gw.url, 1, str(think))  # the tier's server, its weights the agent's
    session = f"agent-{history}"
    api = client(gw, **{"X-Session-ID": session})
    messages: list[Any] = [{"role": "user", "content": "Is it warm in Paris today?"}]
    first, rollout1, counted1 = await turn(http, server, api, messages)
    reply = called(first)
    await update(http, gw.url, 2, str(server.models / "think_v2"))  # the episode spans two versions
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "18 C, sunny"}]
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
        assert sorted(set(sample.versions[sample.loss_mask == 1].tolist())) == [1, 2]
        spans = zip(starts, ends, strict=True)
        sampled = [(sample.response_ids[a:b].tolist(), sample.logprobs[a:b]) for a, b in spans]
    else:
        assert [(r["sample_index"], r["new_sample"]) for r in rollouts] == [(0, True), (1, True), (2, True)]
        prompts = [s.prompt_ids.tolist() for s in samples]
        sampled = [(s.response_ids.tolist(), s.logprobs) for s in samples]
    if server.logs_received_prompts:  # what the engine logged it received for this session, whole and in order
        received = [ids for engine_id, ids in received_prompts(server) if f"{session}-" in engine_id]
        assert received == prompts, [len(ids) for ids in received]
    assert [len(prompt) for prompt in prompts] == [counted1, counted2, counted3]  # what the engine counted
    for prompt, (output, logprobs), rollout in zip(prompts, sampled, rollouts, strict=True):
        assert output == rollout["output_ids"]
        alone, alone_logprobs = await greedy(http, server, prompt, len(output))  # the engine run on that prompt alone
        assert alone == output and np.allclose(alone_logprobs, logprobs, atol=1e-4)
    await gw.stop()
