"""Several gateway processes on one Redis and one set of replicas: one coordinator per update, the rest follow."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    client,
    expected_tokens,
    generate_body,
    publish,
    scrape,
    slow,
    stream_generate,
    value,
)
from tests.sim_helpers import wait_for


async def test_follower_resumes_its_requests_under_the_new_version(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim(*slow("vllm")), await make_sim(*slow("sglang"))]
    leader, follower = await make_gateway(sims), await make_gateway(sims)
    progress = [0]
    tasks = [
        asyncio.create_task(
            stream_generate(http, follower.url, generate_body(PROMPT, 200, session_id=f"f{i}"), progress)
        )
        for i in range(4)
    ]
    await wait_for(lambda: progress[0] >= 200, what="progress on the follower")
    assert (await publish(http, leader.url, 1)).status_code == 200
    results = await asyncio.gather(*tasks)
    for result in results:
        versions = result.final["versions"]
        assert result.error is None and 0 in versions and 1 in versions
        assert result.output_ids == expected_tokens(PROMPT, versions, 200)
    await wait_for(lambda: follower.services.weights.version == 1, what="the follower adopting v1")
    status = (await http.get(f"{follower.url}/admin/status", headers=ADMIN)).json()
    assert status["version"] == 1 and all(r["version"] == 1 for r in status["replicas"])


async def test_one_coordinator_per_version(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim("vllm"), await make_sim("vllm")]
    a, b = await make_gateway(sims), await make_gateway(sims)
    first, second = await asyncio.gather(publish(http, a.url, 1), publish(http, b.url, 1))
    assert sorted([first.status_code, second.status_code]) == [200, 409]
    await wait_for(lambda: a.services.weights.version == b.services.weights.version == 1, what="both on v1")
    stale = await publish(http, b.url, 1)
    assert stale.status_code == 409


async def test_followers_hold_new_requests_during_an_out_of_band_sync(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    leader, follower = await make_gateway([sim]), await make_gateway([sim])
    assert (await http.post(f"{leader.url}/admin/pause", json={"mode": "abort"}, headers=ADMIN)).status_code == 200
    await wait_for(lambda: not follower.services.weights.serving, what="the follower to stop dispatching")
    task = asyncio.create_task(http.post(f"{follower.url}/generate", json=generate_body(PROMPT, 4)))
    await asyncio.wait({task}, timeout=0.3)
    assert not task.done() and sim.engine.counters["prompt_tokens"] == 0
    resumed = await http.post(f"{leader.url}/admin/resume", json={"version": 3}, headers=ADMIN)
    assert resumed.status_code == 200
    body = (await task).json()
    assert body["versions"] == [3] * 4 and body["finish_reason"] == "length"


async def test_a_sessions_turns_may_alternate_between_gateway_processes(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Each process keeps the sessions it served in memory; a turn that another process served since must not be
    lost or recorded as environment tokens, and a new sample must not take the index of one stored meanwhile."""
    sims = [await make_sim("vllm")]
    a, b = await make_gateway(sims), await make_gateway(sims)
    apis = {gw.url: client(gw, **{"X-Session-ID": "roaming"}) for gw in (a, b)}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count to three"}]
    rollouts, replies = [], []
    try:
        for gw in (a, b, a):  # the third turn finds `a`'s memory of the session one turn behind
            reply = await apis[gw.url].chat.completions.create(model="tiny", messages=messages, max_tokens=6)
            rollouts.append(reply.model_extra["rollout"]["choices"][0])
            replies.append(rollouts[-1]["output_ids"])
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        for gw, text in ((a, "another story"), (b, "a third story")):  # history rewrites: new samples, one each
            reply = await apis[gw.url].chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": text}], max_tokens=4
            )
            rollouts.append(reply.model_extra["rollout"]["choices"][0])
    finally:
        for api in apis.values():
            await api.close()
    expected = [(0, True), (0, False), (0, False), (1, True), (2, True)]
    assert [(r["sample_index"], r["new_sample"]) for r in rollouts] == expected
    session = (await http.get(f"{b.url}/v1/sessions/roaming")).json()
    assert [s["num_turns"] for s in session["samples"]] == [3, 1, 1]
    sample = (await b.services.store.load_samples("roaming"))[0]
    sampled = sample.response_ids[sample.loss_mask == 1].tolist()
    assert sampled == [token for reply in replies for token in reply]


async def test_turns_of_one_session_on_two_processes_at_once_are_both_kept(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Two turns continuing the same conversation reach two processes at once (an agent's parallel requests behind
    a load balancer): neither overwrites the other; the one recorded second becomes a sample of its own."""
    sims = [await make_sim(*slow("vllm", delay=0.02))]  # the turns overlap: both begin before either is recorded
    a, b = await make_gateway(sims), await make_gateway(sims)
    apis = {gw.url: client(gw, **{"X-Session-ID": "forked"}) for gw in (a, b)}
    opening: list[dict[str, Any]] = [{"role": "user", "content": "pick a door"}]
    try:
        first = await apis[a.url].chat.completions.create(model="tiny", messages=opening, max_tokens=4)
        opening.append(first.choices[0].message.model_dump(exclude_none=True))
        replies = await asyncio.gather(
            *(
                apis[gw.url].chat.completions.create(
                    model="tiny", messages=[*opening, {"role": "user", "content": door}], max_tokens=6
                )
                for gw, door in ((a, "the left one"), (b, "the right one"))
            )
        )
    finally:
        for api in apis.values():
            await api.close()
    rollouts = [reply.model_extra["rollout"]["choices"][0] for reply in replies]
    assert not any(r["new_sample"] for r in rollouts)  # both continued sample 0 when they began
    assert sorted(r["sample_index"] for r in rollouts) == [0, 1]
    moved = [value(await scrape(http, gw.url), "rollout_gateway_samples_moved_total") for gw in (a, b)]
    assert sorted(moved) == [0, 1]
    first_ids = first.model_extra["rollout"]["choices"][0]["output_ids"]
    samples = await a.services.store.load_samples("forked")
    assert [s.num_turns for s in samples] == [2, 2]
    for rollout in rollouts:
        sample = samples[rollout["sample_index"]]
        assert sample.response_ids[sample.loss_mask == 1].tolist() == first_ids + rollout["output_ids"]
