"""A session as a tree, through a served gateway (the tiny tokenizer in tokens mode, the simulator, real Redis, the
trainer's consumer): a retried turn branches from the ids that turn was prompted with and leaves its first try
`superseded`; an edit branches from the sample it shares the most leading ids with; Redis holds each shared prefix
once (in the parent), and the trainer receives every sample whole with its parent and branch point."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
from redis.asyncio import Redis

from gateway.store import Keys
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import client

U1 = {"role": "user", "content": "Count to three."}
U2 = {"role": "user", "content": "Now backwards."}
U2_EDITED = {"role": "user", "content": "Now in French."}


async def chat(api: Any, messages: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One turn: the reply as a message to send back, and the turn's rollout choice."""
    answer = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    rollout = (answer.model_extra or {})["rollout"]["choices"][0]
    return {"role": "assistant", "content": answer.choices[0].message.content}, rollout


async def test_a_retry_and_an_edit_branch_the_session_and_share_their_prefix(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis, redis_server: Any
) -> None:
    from gateway.trainer import TrajectoryConsumer

    gw = await make_gateway([await make_sim("vllm")], sessions={"history": "tokens"})
    api = client(gw, **{"X-Session-ID": "tree"})
    a1, _ = await chat(api, [U1])
    _, second = await chat(api, [U1, a1, U2])
    assert (second["sample_index"], second["new_sample"]) == (0, False)
    [trunk] = await gw.services.store.load_samples("tree")
    second_start = trunk.input_ids.size - len(second["output_ids"])  # where turn 2's reply began

    _, retry = await chat(api, [U1, a1, U2])  # the same request again: turn 2 retried
    assert (retry["sample_index"], retry["new_sample"]) == (1, True)
    _, edit = await chat(api, [U1, a1, U2_EDITED])
    assert (edit["sample_index"], edit["new_sample"]) == (2, True)

    trunk, retried, edited = await gw.services.store.load_samples("tree")
    assert (retried.parent, retried.branch_point, retried.retry) == (0, second_start, True)
    assert retried.prompt_ids.tolist() == trunk.input_ids[:second_start].tolist()  # turn 2's prompt, exactly
    assert trunk.superseded and not retried.superseded and not edited.superseded
    shared = edited.branch_point
    assert edited.parent == 1 and not edited.retry  # the most recent of the two it shares as much with
    assert 0 < shared < second_start  # up to where U2's text and the edited one part
    assert edited.prompt_ids[:shared].tolist() == retried.input_ids[:shared].tolist()
    assert edited.prompt_ids[shared] != retried.input_ids[shared]
    keys = Keys()
    for index, sample in ((1, retried), (2, edited)):  # Redis holds a branch's prompt after its branch point only
        stored = await redis.hstrlen(keys.sample("tree", index), "prompt_ids")
        assert stored == 4 * (sample.prompt_ids.size - sample.branch_point)

    assert (await http.post(f"{gw.url}/v1/sessions/tree/finish", json={"rewards": [0.0, 1.0, 0.5]})).status_code == 200
    async with TrajectoryConsumer(redis_server.url, "trainers", "t0") as consumer:
        [trajectory] = (await consumer.next_batch(1, timeout=5)).trajectories
        delivered = trajectory.samples
        assert [(s.parent, s.branch_point, s.superseded) for s in delivered] == [
            (None, 0, True),
            (0, second_start, False),
            (1, shared, False),
        ]
        for got, want in zip(delivered, (trunk, retried, edited), strict=True):
            assert np.array_equal(got.input_ids, want.input_ids)
    await api.close()
