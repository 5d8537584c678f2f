"""Version-salted prefix caches (issue 50 §1), over real simulator replicas and real HTTP.

Every engine request carries a salt derived from the weight version its replica serves (vLLM `cache_salt`, SGLang
`extra_key`), so a prefix cached under old weights is never reused under new ones and no update flushes a cache:
a `keep` update preempts nothing (vLLM) and drains no replica (SGLang `in_place`). The simulator keys its prefix
cache by the salt and draws, for a request that reuses KV of other weights, tokens no version draws (its
`stale_key`): a stale hit shows as wrong tokens. `weights.kv_after_update: recompute` (or `cache_salt: false`)
keeps the flush, and with it the preemptions.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from backends.sim.engine import EngineSettings
from backends.sim.server import SimReplica
from gateway.config import ReplicaConfig, Settings
from gateway.embedded_redis import EmbeddedRedis
from gateway.server import RunningGateway, serve_gateway
from gateway.weights import cache_salt
from tests.conftest import ADMIN_TOKEN, GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    expected_tokens,
    generate_body,
    publish,
    slow,
    stream_generate,
    streams_under_way,
    weights_of,
)
from tests.sim_helpers import wait_for

STREAMS = 8
BLOCKS_PROMPT = list(range(10, 58))  # three full vLLM-dialect cache blocks of 16


def prompts(n: int) -> list[list[int]]:
    return [[*PROMPT, 100 + i] for i in range(n)]


@pytest.mark.parametrize(("kv", "preempted"), [("keep", 0), ("recompute", STREAMS)])
async def test_a_keep_update_preempts_no_request_unless_kv_is_recomputed(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, kv: str, preempted: int
) -> None:
    """The issue's reproduction: a `keep` update with 8 requests in flight on a vLLM-dialect replica preempted all
    8 (the flush with `reset_running_requests`). Salted, nothing is flushed: none is preempted, each goes on in
    the engine (no resume) with the versions that sampled its tokens."""
    sim = await make_sim(*slow("vllm", delay=0.004))
    gw = await make_gateway([sim], weights={"kv_after_update": kv})
    async with streams_under_way(gw, prompts(STREAMS), 150, "k") as tasks:
        response = await publish(http, gw.url, 1, mode="keep")
        assert response.status_code == 200, response.text
        results = await asyncio.gather(*tasks)
    assert sim.engine.counters["retractions"] == preempted
    for prompt, result in zip(prompts(STREAMS), results, strict=True):
        versions = result.final["versions"]
        assert result.error is None and result.final["num_resumes"] == 0
        assert versions[0] == 0 and versions[-1] == 1
        assert result.output_ids == expected_tokens(prompt, versions, 150)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_after_an_update_no_request_reuses_the_old_versions_prefix_and_a_session_reuses_its_own(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    """A prompt cached under version 0 is a miss under version 1 (the engine draws the new version's tokens, not
    the stale ones), and a hit again for the next request under version 1."""
    sim = await make_sim(dialect)
    gw = await make_gateway([sim])
    first = await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 4, session_id="s"))
    assert first.status_code == 200
    assert (await publish(http, gw.url, 1, mode="keep")).status_code == 200
    hits = sim.engine.counters["prefix_cache_hits"]
    after = (await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 4, session_id="s"))).json()
    assert sim.engine.counters["prefix_cache_hits"] == hits  # nothing of version 0's prefix reused
    assert after["output_ids"] == expected_tokens(BLOCKS_PROMPT, [1] * 4, 4) and after["versions"] == [1] * 4
    again = (await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 4, session_id="s"))).json()
    assert sim.engine.counters["prefix_cache_hits"] > hits  # version 1's own prefix is reused
    assert again["output_ids"] == after["output_ids"]


async def test_without_a_salt_the_update_flushes_the_cache_instead(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """`weights.cache_salt: false`: the requests carry no salt, and the update flushes the cache (else the next
    request would reuse version 0's KV and draw tokens no version draws)."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim], weights={"cache_salt": False})
    assert (await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 4))).status_code == 200
    assert (await publish(http, gw.url, 1, mode="keep")).status_code == 200
    after = (await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 4))).json()
    assert after["output_ids"] == expected_tokens(BLOCKS_PROMPT, [1] * 4, 4)
    assert sim.engine.counters["prefix_cache_hits"] == 0


@pytest.mark.parametrize(("kv", "drains"), [("keep", False), ("recompute", True)])
async def test_an_in_place_update_on_sglang_drains_no_replica_unless_kv_is_recomputed(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, kv: str, drains: bool
) -> None:
    """SGLang's `in_place` keeps the paused requests' KV, so its update cannot flush the radix cache: unsalted,
    the replica was taken out of rotation until they finished (`flush_pending`). Salted, the update asks for no
    flush and the replica takes new work at once; a new request misses the old version's prefix."""
    sim = await make_sim(*slow("sglang", delay=0.004))
    config = ReplicaConfig(url=sim.url, backend="sim", dialect="sglang", keep_mode="in_place")
    gw = await make_gateway([config], weights={"kv_after_update": kv})
    assert (
        await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 2, session_id="w"))
    ).status_code == 200
    async with streams_under_way(gw, prompts(2), 300, "i") as tasks:
        report = (await publish(http, gw.url, 1, mode="keep")).json()
        assert bool(report["flush_pending"]) is drains, report
        [replica] = gw.services.pool.all()
        assert replica.draining is drains
        if not drains:  # served beside the kept requests, on version 1, without version 0's KV
            fresh = (await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 4))).json()
            assert fresh["output_ids"] == expected_tokens(BLOCKS_PROMPT, [1] * 4, 4)
            assert not all(task.done() for task in tasks)
        results = await asyncio.gather(*tasks)
    assert all(r.error is None and r.final["num_resumes"] == 0 for r in results)
    await wait_for(lambda: not replica.draining, what="the replica back in rotation")


async def test_a_continuation_built_during_an_update_carries_the_new_versions_salt(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """An `abort` update: the gateway builds each preempted request's continuation while the update runs, under
    the old version's salt. Sent as built, it would reuse its own prefix cached under version 0 (the aborted
    segment's KV, which SGLang's abort keeps; vLLM's pause clears the cache): it is rebuilt with version 1's salt,
    recomputes, and draws version 1's tokens."""
    sim = await make_sim(*slow("sglang", delay=0.004))
    gw = await make_gateway([sim])
    await http.post(f"{sim.url}/sim/faults", json={"load_delay": 0.3})  # the continuation is built before the load
    async with streams_under_way(gw, [BLOCKS_PROMPT], 200, "c") as [task]:
        assert (await publish(http, gw.url, 1, mode="abort")).status_code == 200
        result = await task
    versions = result.final["versions"]
    assert result.final["num_resumes"] == 1 and versions[0] == 0 and versions[-1] == 1
    assert result.output_ids == expected_tokens(BLOCKS_PROMPT, versions, 200)
    assert sim.engine.counters["prefix_cache_hits"] == 0  # the aborted segment's KV (version 0's) not reused


async def test_the_simulator_refuses_a_salt_vllm_refuses(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings())
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
    for bad in ("", "a/b", "x" * 129):
        response = await http.post(f"{sim.url}/v1/completions", json=body | {"cache_salt": bad})
        assert response.status_code == 400, (bad, response.text)
    assert (await http.post(f"{sim.url}/v1/completions", json=body | {"cache_salt": cache_salt(7)})).status_code == 200


@pytest.mark.parametrize("mode", ["abort", "wait"])
async def test_an_abort_or_wait_update_still_flushes_for_requests_that_reached_the_paused_engine(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, mode: str
) -> None:
    """A request on its way when the pause began (another gateway process's, with version 0's salt) waits at the
    paused engine. After an `abort` or `wait` update nothing holds KV, so the update flushes: admitted on resume,
    that request finds none of version 0's KV and draws version 1's tokens (unflushed, it would reuse the cached
    prompt computed under version 0)."""
    sim = await make_sim("sglang")
    gw = await make_gateway([sim])
    assert (await http.post(f"{gw.url}/generate", json=generate_body(BLOCKS_PROMPT, 2))).status_code == 200
    await http.post(f"{sim.url}/sim/faults", json={"load_delay": 0.5})
    update = asyncio.create_task(publish(http, gw.url, 1, mode=mode))
    await wait_for(lambda: sim.engine.paused, what="the engine paused")
    body = {"input_ids": BLOCKS_PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    queued = asyncio.create_task(http.post(f"{sim.url}/generate", json=body | {"extra_key": cache_salt(0)}))
    await wait_for(lambda: sim.engine.held == 1, what="the request waiting at the paused engine")
    assert (await update).status_code == 200
    answer = (await queued).json()
    assert answer["output_ids"] == expected_tokens(BLOCKS_PROMPT, [1] * 4, 4)


@contextlib.asynccontextmanager
async def on_a_redis_of_its_own(sim: SimReplica) -> AsyncIterator[RunningGateway]:
    """A gateway over `sim` that hears no other gateway's updates (its own Redis server), and probes its replica's
    health only every 30 s: what it learns of a weight update between, it learns from its requests."""
    redis = EmbeddedRedis()
    await redis.astart()
    try:
        settings = Settings(
            server={"port": 0, "admin_token": ADMIN_TOKEN},
            redis={"url": redis.url},
            replicas=[ReplicaConfig(url=sim.url, backend="sim", dialect=sim.dialect)],
            routing={"health_interval_s": 30},
        )
        async with serve_gateway(settings) as gateway:
            yield gateway
    finally:
        await redis.astop()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_a_process_that_missed_a_keep_update_redoes_a_segment_begun_under_the_new_weights(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str, stream: bool
) -> None:
    """A second gateway over the same replica on another Redis never hears the first's updates, as a process whose
    subscription was down when one ended (its result is in its Redis: the event was missed, not the record). Its
    first request caches the prompt under version 0's salt; after a `keep` update through the first gateway (no
    flush), its next one goes salted for version 0 to a replica that runs version 1, and would reuse version 0's
    KV under version 1's weights (tokens no version draws). The engine labels its first token 1. Where that label
    comes before any token is handed out (a whole answer; SGLang labels every chunk), the segment is refused, the
    process adopts the recorded version and redoes it under version 1's salt: version 1's tokens. Where it comes
    with the last chunk (a vLLM stream) the tokens stand, as a request kept through the update's pause would; the
    process catches up all the same, at once, not at its next health probe 30 s later."""
    sim = await make_sim(dialect)
    leader = await make_gateway([sim])
    refused = not stream or dialect == "sglang"
    async with on_a_redis_of_its_own(sim) as lagging:

        async def generate() -> dict[str, object]:
            body = generate_body(BLOCKS_PROMPT, 8, session_id="lag")
            if stream:
                streamed = await stream_generate(http, lagging.url, body)
                assert streamed.error is None, streamed.error
                return {"output_ids": streamed.output_ids} | streamed.final
            response = await http.post(f"{lagging.url}/generate", json=body)
            assert response.status_code == 200, response.text
            return dict(response.json())

        assert (await generate())["output_ids"] == expected_tokens(BLOCKS_PROMPT, [0] * 8, 8)
        assert (await publish(http, leader.url, 1, mode="keep")).status_code == 200
        weights = lagging.services.weights
        [replica] = lagging.services.pool.engines()
        assert weights.bus is not None
        await weights.bus.record(1, "serving", weights_of(1)[0], [replica.id], [])  # its `serving` event missed
        after = await generate()
        assert after["versions"] == [1] * 8
        assert weights.version == 1 and replica.version == 1 and not replica.stale
        assert lagging.services.generator.engine_ahead_total == 1
        if refused:
            assert after["output_ids"] == expected_tokens(BLOCKS_PROMPT, [1] * 8, 8)
        again = await generate()
        assert again["output_ids"] == expected_tokens(BLOCKS_PROMPT, [1] * 8, 8) and again["versions"] == [1] * 8
