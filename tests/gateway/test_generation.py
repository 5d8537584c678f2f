"""`gateway.generation`, the resume loop, over real simulator replicas and real HTTP: the resume invariants across
weight updates, preemptions and replica failures (no token lost or duplicated, versions that never decrease, routed
experts spliced or replaced), whole and streamed engine answers, the resume histograms, deadlines, the wait for a
replica and the retry budget, and a caller's disconnect aborting the engine request."""

from __future__ import annotations

import asyncio
import gc

import httpx
import numpy as np
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.routed_experts import decode_npy_b64
from backends.sim.engine import EngineSettings
from backends.sim.model import PREFIX_HASH_START, TokenModel, extend_prefix_hash, weights_key
from gateway.config import ReplicaConfig
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    SHAPE,
    expected_tokens,
    generate_body,
    publish,
    scrape,
    slow,
    stream_generate,
    streams_under_way,
    value,
    weights_of,
)
from tests.sim_helpers import sim_state, wait_for


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
@pytest.mark.parametrize("updates", [1, 3, 5])
async def test_abort_invisibility_across_k_updates(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str, updates: int
) -> None:
    d, engine = slow(dialect)
    sim = await make_sim(d, engine=engine)
    gw = await make_gateway([sim])
    total = 300
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, total), progress))
    for version in range(1, updates + 1):
        await wait_for(lambda v=version: progress[0] >= v * total // (updates + 1), what=f"progress before v{version}")
        assert (await publish(http, gw.url, version)).status_code == 200
    result = await task
    assert result.error is None
    final = result.final
    assert final["finish_reason"] == "length"
    assert len(result.output_ids) == total == len(final["versions"]) == len(result.logprobs)
    assert final["versions"] == sorted(final["versions"])  # never decrease
    assert set(final["versions"]) == set(range(updates + 1))  # every update landed inside this request
    assert result.output_ids == expected_tokens(PROMPT, final["versions"], total)
    assert final["num_resumes"] == updates


@pytest.mark.parametrize("replica", ["vllm", "vllm-scale-out", "sglang"])
async def test_a_caller_of_the_whole_answer_gets_one_engine_answer_per_segment(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, replica: str
) -> None:
    """A non-streamed `/generate` takes each segment from its engine in one answer (no event per token), and the
    resume invariants hold as for a stream: an aborted answer carries the partial tokens, which are kept."""
    dialect, scale_out = replica.removesuffix("-scale-out"), replica.endswith("-scale-out")
    d, engine = slow(dialect)
    sim = await make_sim(d, engine=engine, enable_scale_out=scale_out)
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect=d, scale_out=scale_out)])
    total, updates = 300, 2
    task = asyncio.create_task(http.post(f"{gw.url}/generate", json=generate_body(PROMPT, total)))
    for version in range(1, updates + 1):
        await wait_for(
            lambda v=version: sim.engine.counters["generation_tokens"] >= v * total // (updates + 1),
            what=f"progress before v{version}",
        )
        assert (await publish(http, gw.url, version)).status_code == 200
    answer = (await task).json()
    assert answer["finish_reason"] == "length" and answer["num_resumes"] == updates
    assert set(answer["versions"]) == set(range(updates + 1)) and answer["versions"] == sorted(answer["versions"])
    assert answer["output_ids"] == expected_tokens(PROMPT, answer["versions"], total)
    assert len(answer["logprobs"]) == total
    counters = sim.engine.counters
    assert (counters["requests_whole"], counters["requests_streamed"]) == (updates + 1, 0)
    # Each continuation was dispatched (and timed); none reports a first-token latency, which would be its whole run.
    assert await _resume_observations(http, gw.url) == (updates, 0)
    await stream_generate(http, gw.url, generate_body(PROMPT, 20))  # a streaming caller: a streamed engine request
    assert (counters["requests_whole"], counters["requests_streamed"]) == (updates + 1, 1)


async def _resume_observations(http: httpx.AsyncClient, url: str) -> tuple[float, float]:
    """(dispatch, first-token latency) observations of the gateway's resume histograms."""
    samples = await scrape(http, url)
    dispatch, latency = (f"rollout_gateway_resume_{name}_seconds_count" for name in ("dispatch", "latency"))
    return value(samples, dispatch), value(samples, latency)


async def test_a_replica_killed_under_a_whole_answer_caller(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The tokens of a non-streamed segment die with its replica; the continuation generates them again, and the
    answer is the same."""
    from backends.sim.server import SimProcess

    procs = [SimProcess(["--token-delay", "0.003"]) for _ in range(2)]
    for proc in procs:
        await asyncio.to_thread(proc.start)
    try:
        gw = await make_gateway([ReplicaConfig(url=p.url, backend="sim", dialect="vllm") for p in procs])
        body = generate_body(PROMPT, 400, session_id="crash-me")
        task = asyncio.create_task(http.post(f"{gw.url}/generate", json=body))
        await wait_for(lambda: "crash-me" in gw.services.pool.placements, what="placement")
        victim = gw.services.pool.placements["crash-me"]
        proc = next(p for p in procs if p.url.endswith(victim.split(":")[-1]))
        await wait_for(lambda: _generated(http, proc.url, 50), what="tokens before the kill")
        await asyncio.to_thread(proc.kill)
        answer = (await task).json()
        assert answer["finish_reason"] == "length" and answer["num_resumes"] >= 1
        assert answer["output_ids"] == expected_tokens(PROMPT, answer["versions"], 400)
        assert len(set(answer["replicas"])) == 2  # finished on the other replica
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.stop)


async def _generated(http: httpx.AsyncClient, url: str, at_least: int) -> bool:
    return bool((await sim_state(http, url))["counters"].get("generation_tokens", 0) >= at_least)


async def test_concurrent_streams_while_updates_fire(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim(*slow("vllm", 0.003)), await make_sim(*slow("sglang", 0.003))]
    gw = await make_gateway(sims)
    total, n = 120, 200
    progress = [0]
    # The streams get their own client: the shared one's pool (100 connections) must stay free for admin calls.
    streams = httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n))
    tasks = [
        asyncio.create_task(
            stream_generate(streams, gw.url, generate_body([7, i % 100, 3], total, session_id=f"s{i}"), progress)
        )
        for i in range(n)
    ]
    version = 0
    while not all(t.done() for t in tasks) and version < 4:
        await wait_for(lambda v=version: progress[0] >= (v + 1) * n * total // 6 or all(t.done() for t in tasks))
        version += 1
        assert (await publish(http, gw.url, version)).status_code == 200
    results = await asyncio.gather(*tasks)
    await streams.aclose()
    spanning = 0
    for i, result in enumerate(results):
        versions = result.final["versions"]
        assert result.error is None and result.final["finish_reason"] == "length"
        assert result.output_ids == expected_tokens([7, i % 100, 3], versions, total)
        assert versions == sorted(versions)
        spanning += len(set(versions)) > 1
    assert spanning > n // 2


async def test_each_preempted_request_reports_its_dispatch_once(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """One update preempts n streams: the dispatch histogram gets one observation per continuation, measured from
    the release of the held requests; the cyclic GC, deferred while they are re-sent, is back on afterwards."""
    sims = [await make_sim(*slow("vllm", 0.005)), await make_sim(*slow("sglang", 0.005))]
    gw = await make_gateway(sims)
    n, total = 30, 200
    prompts = [[9, i, 4] for i in range(n)]
    async with streams_under_way(gw, prompts, total, "d") as tasks:
        assert (await publish(http, gw.url, 1)).status_code == 200
        results = await asyncio.gather(*tasks)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None and result.final["num_resumes"] == 1
        assert result.output_ids == expected_tokens(prompt, result.final["versions"], total)
    assert gw.services.generator.preemptions_total == n
    observed = {
        s.name: s.value
        for family in text_string_to_metric_families(gw.services.metrics.render().decode())
        for s in family.samples
        if s.name.startswith("rollout_gateway_resume_dispatch_seconds_")
    }
    assert observed["rollout_gateway_resume_dispatch_seconds_count"] == n
    assert observed["rollout_gateway_resume_dispatch_seconds_sum"] >= 0
    assert gc.isenabled()


async def test_replica_killed_mid_generation_completes_elsewhere(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    from backends.sim.server import SimProcess

    procs = [SimProcess(["--token-delay", "0.003"]) for _ in range(2)]
    for proc in procs:
        await asyncio.to_thread(proc.start)
    try:
        gw = await make_gateway([ReplicaConfig(url=p.url, backend="sim", dialect="vllm") for p in procs])
        progress = [0]
        body = generate_body(PROMPT, 400, session_id="crash-me")
        task = asyncio.create_task(stream_generate(http, gw.url, body, progress))
        await wait_for(lambda: progress[0] >= 50, what="tokens before the kill")
        victim = gw.services.pool.placements["crash-me"]
        proc = next(p for p in procs if p.url.endswith(victim.split(":")[-1]))
        await asyncio.to_thread(proc.kill)
        result = await task
        assert result.error is None and result.final["finish_reason"] == "length"
        assert result.output_ids == expected_tokens(PROMPT, result.final["versions"], 400)
        assert len(set(result.final["replicas"])) == 2  # finished on the other replica
        assert result.final["num_resumes"] >= 1
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.stop)


def _expected_experts(prompt: list[int], output: list[int], wkeys: list[int]) -> np.ndarray:
    hashes, state = [], PREFIX_HASH_START
    for token in prompt + output:
        state = extend_prefix_hash(state, token)
        hashes.append(state)
    n = len(prompt) + len(output) - 1
    return TokenModel(SHAPE).routed_experts(hashes[:n], wkeys[:n])


@pytest.mark.parametrize("policy", ["splice", "replace"])
async def test_routed_experts_splice_and_replace(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, policy: str
) -> None:
    sim = await make_sim(*slow("vllm", routed_experts_output=True))
    config = ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", routed_experts=True)
    gw = await make_gateway([config], generation={"routed_experts": policy})
    total = 200
    task = asyncio.create_task(
        http.post(f"{gw.url}/generate", json=generate_body(PROMPT, total, return_routed_experts=True))
    )
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 60, what="tokens")
    assert (await publish(http, gw.url, 1)).status_code == 200
    body = (await task).json()
    versions, output = body["versions"], body["output_ids"]
    assert body["num_resumes"] == 1 and output == expected_tokens(PROMPT, versions, total)
    experts = decode_npy_b64(body["routed_experts"])
    assert experts.shape == (len(PROMPT) + total - 1, SHAPE.num_layers, SHAPE.top_k)
    cut = len(PROMPT) + versions.index(1) - 1  # the first position forwarded by the continuation
    old, new = weights_key(*weights_of(0)), weights_key(*weights_of(1))
    if policy == "splice":
        wkeys = [old] * cut + [new] * (len(PROMPT) + total - 1 - cut)
    else:
        wkeys = [new] * (len(PROMPT) + total - 1)  # the engine's latest view: everything re-prefilled under v1
    assert np.array_equal(experts, _expected_experts(PROMPT, output, wkeys))


@pytest.mark.parametrize("policy", ["splice", "replace"])
async def test_a_session_sample_keeps_one_experts_row_per_position_across_turns_and_updates(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, policy: str
) -> None:
    """Turns of one session, a weight update between them: "splice" keeps each position's experts from the turn
    that ran it; "replace" keeps the engine's latest view of every position. Either way one row per position."""
    sim = await make_sim("vllm", engine=EngineSettings(routed_experts_output=True))
    config = ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", routed_experts=True)
    gw = await make_gateway([config], generation={"routed_experts": policy})
    prompt, ran_before_update = list(PROMPT), 0
    for turn in range(3):
        if turn == 1:
            assert (await publish(http, gw.url, 1)).status_code == 200
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}
        reply = await http.post(f"{gw.url}/v1/completions", json=body, headers={"X-Session-ID": f"r3-{policy}"})
        assert reply.status_code == 200, reply.text
        ids = [*prompt, *reply.json()["rollout"]["choices"][0]["output_ids"]]
        if turn == 0:
            ran_before_update = len(ids) - 1  # every position but the last sampled token's ran under v0
        prompt = [*ids, 9, 10]
    [sample] = await gw.services.store.load_samples(f"r3-{policy}")
    ids = [*sample.prompt_ids.tolist(), *sample.response_ids.tolist()]
    old, new = weights_key(*weights_of(0)), weights_key(*weights_of(1))
    rows = len(ids) - 1
    if policy == "splice":
        wkeys = [old] * ran_before_update + [new] * (rows - ran_before_update)
    else:
        wkeys = [new] * rows
    assert sample.routed_experts is not None and sample.routed_experts.shape == (rows, SHAPE.num_layers, SHAPE.top_k)
    expected = _expected_experts(ids[: len(PROMPT)], ids[len(PROMPT) :], wkeys)
    assert np.array_equal(sample.routed_experts, expected)


async def test_a_whole_engine_answer_reports_no_first_token_latency(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """vLLM without scale-out sends routed experts only in whole answers, so even a streaming caller's segments
    come whole: the resume-latency histogram (first token after a break) gets nothing from them."""
    sim = await make_sim(*slow("vllm", routed_experts_output=True))
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", routed_experts=True)])
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 200)))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 60, what="tokens")
    assert (await publish(http, gw.url, 1)).status_code == 200
    result = await task
    assert result.final["num_resumes"] == 1 and sim.engine.counters["requests_whole"] == 2
    assert await _resume_observations(http, gw.url) == (1, 0)


@pytest.mark.parametrize("behaviour", ["block", "reject"])
async def test_engine_paused_behind_the_gateways_back(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, behaviour: str
) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(new_requests_while_paused=behaviour))  # type: ignore[arg-type]
    gw = await make_gateway([sim], routing={"failure_threshold": 100})
    await http.post(f"{sim.url}/pause", params={"mode": "abort"})  # an operator paused the engine directly
    task = asyncio.create_task(http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 5)))
    if behaviour == "block":
        await wait_for(lambda: sim.engine.held == 1, what="held in the engine")
    else:
        await wait_for(lambda: gw.services.generator.resumes_total >= 1, what="a 503 and a retry")
    await http.post(f"{sim.url}/resume")
    body = (await task).json()
    assert body["finish_reason"] == "length" and body["output_ids"] == expected_tokens(PROMPT, [0] * 5, 5)


async def test_client_disconnect_aborts_engine_request(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim(*slow("vllm"))
    gw = await make_gateway([sim])
    async with http.stream("POST", f"{gw.url}/generate", json=generate_body(PROMPT, 2000, stream=True)) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and sim.engine.counters["generation_tokens"] > 20:
                break
    await wait_for(lambda: sim.engine.counters["finished_abort"] == 1, what="engine abort after a stream disconnect")
    impatient = httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.3))
    with pytest.raises(httpx.ReadTimeout):
        await impatient.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2000))
    await impatient.aclose()
    await wait_for(lambda: sim.engine.counters["finished_abort"] == 2, what="engine abort after a disconnect")
    await wait_for(lambda: gw.services.pool.all()[0].in_flight == 0, what="lease released")


async def test_a_preempted_stream_whose_replica_left_the_pool_continues_on_another(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A preempted request builds its continuation for the replica it ran on before it waits to resume; when that
    replica is out of the pool by then, the continuation goes to another replica, built for that one. The replica is
    taken out without failing (it drains, as before a cache flush): one the probe marks down has its requests
    interrupted at once (`test_hung_replica.py`), before any preemption."""
    sims = [await make_sim(*slow("vllm", 0.005)) for _ in range(2)]
    gw = await make_gateway(sims, routing={"balance_factor": 0.0})
    n, total = 6, 200
    prompts = [[7, i, 5] for i in range(n)]
    bad, good = sims
    bad_id, good_id = bad.url.removeprefix("http://"), good.url.removeprefix("http://")
    pool = gw.services.pool
    async with streams_under_way(gw, prompts, total, "m") as tasks:
        assert all(r.in_flight for r in pool.all())  # both replicas hold some
        out = pool.engine(bad_id)
        assert out is not None
        out.draining = True  # takes no new request; its streams go on
        await wait_for(lambda: len(pool.candidates()) == 1, what="ejection")
        await http.post(f"{bad.url}/sim/faults", json={"abort_all": True})  # its streams end in abort: preempted
        results = await asyncio.gather(*tasks)
    moved = 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None and result.final["finish_reason"] == "length"
        assert result.output_ids == expected_tokens(prompt, result.final["versions"], total)
        assert result.final["replicas"] in ([good_id], [bad_id, good_id])
        moved += result.final["replicas"] == [bad_id, good_id]
        assert result.final["num_resumes"] == (1 if result.final["replicas"] == [bad_id, good_id] else 0)
    assert moved >= 1
    assert gw.services.generator.preemptions_total == moved


async def test_all_replicas_down_is_503_after_max_wait(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim], generation={"max_wait_s": 0.3})
    await http.post(f"{sim.url}/sim/faults", json={"ready": False})
    await wait_for(lambda: not gw.services.pool.candidates(), what="ejection")
    response = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3))
    assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"


async def test_a_whole_answer_may_outlast_the_read_timeout(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A request that waits for its whole answer gets it in one engine answer, which comes after the whole
    generation: that wait is bounded by the request deadline, not by the read gap of a stream."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.02))
    gw = await make_gateway([sim], generation={"read_timeout_s": 0.1, "stream_pacing_s": 0.05})
    response = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 20))  # 0.4 s of generation
    assert response.status_code == 200, response.text
    result = response.json()
    assert len(result["output_ids"]) == 20 and result["num_resumes"] == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_past_its_deadline_is_504_and_blames_no_replica(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, stream: bool
) -> None:
    """The request's own deadline is no replica's failure: the engine request is aborted, the caller gets 504 at
    once (no resume elsewhere), and the replica keeps serving."""
    sim = await make_sim(*slow("vllm", delay=0.01))
    gw = await make_gateway([sim], generation={"request_timeout_s": 0.3})
    response = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2000, stream=stream))
    if stream:  # the head went out with 200 before the deadline: the error is the stream's last event
        error = orjson.loads(response.text.strip().rpartition("data: ")[2])["error"]
        assert error["code"] == 504
    else:
        assert response.status_code == 504
        error = response.json()["error"]
    assert error["type"] == "timeout_error" and "request deadline of 0.3s passed" in error["message"]
    await wait_for(lambda: sim.engine.counters["finished_abort"] == 1, what="engine abort at the deadline")
    pool = gw.services.pool
    assert [r.id for r in pool.candidates()] == [r.id for r in pool.all()]  # not marked down, no circuit opened
    assert gw.services.generator.resumes_total == 0
    assert (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3))).status_code == 200


async def test_retry_budget_gives_a_clear_error(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm", error_rate=1.0)  # every generation answers 500
    gw = await make_gateway([sim], generation={"max_resumes": 2}, routing={"failure_threshold": 100})
    response = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 5))
    assert response.status_code == 503
    assert "gave up after 2 resumes" in response.json()["error"]["message"]


async def test_accumulated_experts_are_replayed_to_engines_that_accept_them(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim(*slow("vllm", routed_experts_output=True, routed_experts_input=True))
    config = ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", routed_experts=True, routed_experts_input=True)
    gw = await make_gateway([config], generation={"routed_experts": "replace"})
    body = generate_body(PROMPT, 200, return_routed_experts=True)
    task = asyncio.create_task(http.post(f"{gw.url}/generate", json=body))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 60, what="tokens")
    assert (await publish(http, gw.url, 1)).status_code == 200
    result = (await task).json()
    versions, output = result["versions"], result["output_ids"]
    cut = len(PROMPT) + versions.index(1) - 1
    old, new = weights_key(*weights_of(0)), weights_key(*weights_of(1))
    # Even the engine's whole-sequence view (replace) keeps the old routing: the engine replayed what it was sent.
    wkeys = [old] * cut + [new] * (len(PROMPT) + 200 - 1 - cut)
    assert np.array_equal(decode_npy_b64(result["routed_experts"]), _expected_experts(PROMPT, output, wkeys))


async def test_experts_kept_when_the_first_segment_fails_before_any_token(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by the chaos soak): when a request's first engine request failed before its first token (a
    replica killed, answering 500) the continuation was spliced onto experts that did not exist, and the sample
    was stored without routed experts. A continuation with no tokens before it is a first segment."""
    from backends.routed_experts import decode_npy_b64
    from backends.sim.engine import EngineSettings

    engine = EngineSettings(block_size=16, routed_experts_output=True)
    broken = await make_sim("vllm", engine=engine, error_rate=1.0)  # every generation answers 500
    healthy = await make_sim("vllm", engine=engine)
    replicas = [ReplicaConfig(url=s.url, backend="sim", dialect="vllm", routed_experts=True) for s in (broken, healthy)]
    gw = await make_gateway(replicas, routing={"failure_threshold": 100})
    resumed = 0
    for i in range(32):  # placement hashes the session over two replicas: all 32 on the healthy one is 2**-32
        body = generate_body(PROMPT, 6, session_id=f"s{i}", return_routed_experts=True)
        result = (await http.post(f"{gw.url}/generate", json=body)).json()
        resumed += result["num_resumes"] > 0
        experts = decode_npy_b64(result["routed_experts"])
        assert experts.shape[0] == len(PROMPT) + 6 - 1, result
    assert resumed  # some requests did start on the broken replica
