"""`gateway.routing`, the replica pool, over real simulator replicas and real HTTP: health probes that eject and
readmit replicas (and hold out one that restarted on old weights until it is caught up), sticky sessions and the
bounded-load spread of new ones, replicas added and removed at run time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    expected_tokens,
    generate_body,
    publish,
    slow,
    stream_generate,
    streams_under_way,
)
from tests.scripted_server import Answer, Seen, scripted_server
from tests.sim_helpers import wait_for


async def test_health_ejects_and_readmits(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    a, b = await make_sim("vllm"), await make_sim("vllm")
    gw = await make_gateway([a, b])
    pool = gw.services.pool
    await http.post(f"{a.url}/sim/faults", json={"ready": False})  # /health answers 503
    await wait_for(lambda: len(pool.candidates()) == 1, what="ejection")
    for i in range(10):
        body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2, session_id=f"h{i}"))).json()
        assert body["replicas"] == [b.url.removeprefix("http://")]
    await http.post(f"{a.url}/sim/faults", json={"ready": True})
    await wait_for(lambda: len(pool.candidates()) == 2, what="readmission")


async def test_one_failed_probe_keeps_the_requests_in_flight_two_in_a_row_cut_them(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A replica that misses one probe (busy for a moment: an engine pause, a weight load) takes no new requests but
    keeps those in flight (a real SGLang replica missed a probe in a 0.5 s pause, and a whole answer was redone
    elsewhere); at the second failed probe in a row they are cut and resume on the other replica, tokens kept. The
    test probes by hand (`check_health`)."""
    a, b = await make_sim(*slow("vllm", delay=0.004)), await make_sim(*slow("vllm", delay=0.004))
    gw = await make_gateway([a, b], routing={"health_interval_s": 3600.0})
    pool = gw.services.pool
    victim, other = (pool.get(sim.url.removeprefix("http://")) for sim in (a, b))
    assert victim is not None and other is not None
    pool.remember("held", victim.id)
    total, progress = 1_500, [0]
    held = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, total, session_id="held"), progress))
    await wait_for(lambda: progress[0] >= 30, what="the stream under way")

    async def probe_with(ready: bool) -> None:
        assert (await http.post(f"{a.url}/sim/faults", json={"ready": ready})).status_code == 200
        await pool.check_health()

    await probe_with(ready=False)
    assert not victim.healthy and pool.candidates() == [other]
    now = progress[0]
    await wait_for(lambda: progress[0] >= now + 30, what="the stream going on after one failed probe")
    assert victim.in_flight == 1 and gw.services.generator.interrupted_total == 0  # still there, not cut
    await probe_with(ready=True)
    assert victim.healthy
    await probe_with(ready=False)
    await probe_with(ready=False)
    result = await held
    assert gw.services.generator.interrupted_total == 1
    assert result.error is None and result.final["num_resumes"] == 1
    assert result.final["replicas"] == [victim.id, other.id]
    assert result.output_ids == expected_tokens(PROMPT, result.final["versions"], total)


async def test_sessions_stick_and_new_sessions_spread(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim("vllm") for _ in range(3)]
    gw = await make_gateway(sims)
    homes = {}
    for session in ("alpha", "beta", "gamma", "delta"):
        seen = set()
        for _ in range(5):
            body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 2, session_id=session))).json()
            seen.update(body["replicas"])
        assert len(seen) == 1
        homes[session] = seen.pop()
    assert gw.services.pool.affinity.ratio == 1.0
    # Bounded load: while one replica is busy, new sessions avoid it even where HRW prefers it.
    # Both replicas slow: all four requests are in flight together, however long each takes to be dispatched (a
    # turn of a session reads and creates it in Redis first; a fast replica could finish one before the last starts).
    replicas = [await make_sim(*slow("vllm", 0.01)) for _ in range(2)]
    gw2 = await make_gateway(replicas, routing={"balance_factor": 0.0})
    busy = [
        asyncio.create_task(http.post(f"{gw2.url}/generate", json=generate_body(PROMPT, 300, session_id=f"b{i}")))
        for i in range(4)
    ]
    await wait_for(lambda: sum(r.in_flight for r in gw2.services.pool.all()) == 4, what="4 in flight")
    loads = sorted(r.in_flight for r in gw2.services.pool.all())
    assert loads[0] >= 1  # spread over both replicas rather than piled on one
    for task in busy:
        task.cancel()


async def test_replicas_added_and_removed_at_run_time(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    first = await make_sim("vllm")
    gw = await make_gateway([first])
    await publish(http, gw.url, 1)
    newcomer = await make_sim("sglang")
    added = await http.post(
        f"{gw.url}/admin/replicas", json={"url": newcomer.url, "backend": "sim", "dialect": "sglang"}, headers=ADMIN
    )
    assert added.status_code == 201
    assert added.json()["version"] == 1 and added.json()["stale"] is False  # caught up from the last checkpoint
    assert newcomer.engine.version == "1"
    duplicate = await http.post(f"{gw.url}/admin/replicas", json={"url": newcomer.url, "backend": "sim"}, headers=ADMIN)
    assert duplicate.status_code == 409
    first_id = first.url.removeprefix("http://")
    assert (await http.delete(f"{gw.url}/admin/replicas/{first_id}", headers=ADMIN)).status_code == 204
    assert (await http.delete(f"{gw.url}/admin/replicas/{first_id}", headers=ADMIN)).status_code == 404
    body = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3))).json()
    assert body["replicas"] == [newcomer.url.removeprefix("http://")]


async def test_streams_of_a_replica_removed_at_run_time_finish_on_another(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Removing a replica closes its client; its streams fail at once (they waited out the read timeout, 600 s by
    default, before the fix) and continue on the replica left, with every token."""
    sims = [await make_sim(*slow("vllm", 0.005)) for _ in range(2)]
    gw = await make_gateway(sims, routing={"balance_factor": 0.0})
    n, total = 6, 300
    prompts = [[9, i, 4] for i in range(n)]
    gone_id = sims[0].url.removeprefix("http://")
    async with streams_under_way(gw, prompts, total, "rm") as tasks:
        assert gw.services.pool.replicas[gone_id].in_flight > 0
        assert (await http.delete(f"{gw.url}/admin/replicas/{gone_id}", headers=ADMIN)).status_code == 204
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    moved = 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None and result.final["finish_reason"] == "length"
        assert result.output_ids == expected_tokens(prompt, result.final["versions"], total)
        moved += gone_id in result.final["replicas"]
    assert moved >= 1


async def test_restarted_replica_is_caught_up_before_it_serves(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug: a replica that crashed and restarted (on its initial weights) between two weight updates was
    re-admitted by the health probe as soon as it answered, and sampled under the wrong weights while labelled
    with the current version. Now it is held out until it reports the current version (loaded from the path)."""
    procs = [SimProcess() for _ in range(2)]
    for proc in procs:
        await asyncio.to_thread(proc.start)
    try:
        gw = await make_gateway([ReplicaConfig(url=p.url, backend="sim", dialect="vllm") for p in procs])
        assert (await publish(http, gw.url, 1)).status_code == 200
        victim, survivor = (gw.services.pool.get(p.url.removeprefix("http://")) for p in procs)
        assert victim is not None and survivor is not None
        await asyncio.to_thread(procs[0].kill)
        await wait_for(lambda: not victim.healthy, what="the crash noticed")
        await asyncio.to_thread(procs[0].start)  # same port, initial weights
        await wait_for(lambda: victim in gw.services.pool.candidates(), timeout=20, what="re-admission")
        assert victim.version == 1 and not victim.stale
        assert (await http.delete(f"{gw.url}/admin/replicas/{survivor.id}", headers=ADMIN)).status_code == 204
        result = (await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 24))).json()
        assert result["replicas"] == [victim.id] and result["versions"] == [1] * 24
        assert result["output_ids"] == expected_tokens(PROMPT, [1] * 24, 24)
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.stop)


@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_replica_restarted_between_probes_never_serves_old_weights(
    make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str
) -> None:
    """Bug (found by the chaos soak): a replica killed and restarted between two health probes never looked
    down, so it served on its initial weights while the pool ran a later version, and versions went backwards
    inside samples. Now every probe checks the reported version (vLLM labels only its last chunk, so the probe
    is what protects it), and a chunk labelled older than the replica's known version is refused (SGLang labels
    every chunk, so not even one token is taken from it)."""
    procs = [SimProcess(["--dialect", dialect]) for _ in range(2)]
    for proc in procs:
        await asyncio.to_thread(proc.start)
    try:
        shape = [2, 2] if dialect == "sglang" else None
        replicas = [
            ReplicaConfig(url=p.url, backend="sim", dialect=dialect, routed_experts_shape=shape)  # type: ignore[arg-type]
            for p in procs
        ]
        gw = await make_gateway(replicas, routing={"health_interval_s": 3600})  # no probe between the steps
        assert (await publish(http, gw.url, 1)).status_code == 200
        await asyncio.to_thread(procs[0].kill)
        await asyncio.to_thread(procs[0].start)  # back on the same port with its initial weights, unseen
        restarted = gw.services.pool.get(procs[0].url.removeprefix("http://"))
        assert restarted is not None and restarted.healthy and restarted.version == 1
        if dialect == "vllm":
            await gw.services.pool.check_health()  # the next probe round holds it out...
            assert restarted.stale or restarted.version == 1
            await wait_for(lambda: not restarted.stale, what="the catch-up")  # ...until it runs version 1
            assert restarted.version == 1
        for i in range(8):
            body = generate_body(PROMPT, 12, session_id=f"s{i}")
            result = (await http.post(f"{gw.url}/generate", json=body)).json()
            assert result["versions"] == [1] * 12, result
            assert result["output_ids"] == expected_tokens(PROMPT, [1] * 12, 12)
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.stop)


async def test_a_replica_restarted_unseen_is_caught_up_with_its_cache_flushed(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by the chaos soak): requests sent to a replica that restarted unseen are salted for the pool's
    version but prefilled under the engine's initial weights, and their blocks stay in its prefix cache after the
    gateway refuses their tokens. The catch-up loaded the pool's version without a flush (the salt was taken to keep
    versions apart), so later requests with that salt reused KV of the wrong weights. A catch-up flushes now."""
    procs = [SimProcess() for _ in range(2)]
    for proc in procs:
        await asyncio.to_thread(proc.start)
    try:
        replicas = [ReplicaConfig(url=p.url, backend="sim", dialect="vllm") for p in procs]
        gw = await make_gateway(replicas, routing={"health_interval_s": 3600})  # no probe between the steps
        assert (await publish(http, gw.url, 1)).status_code == 200
        await asyncio.to_thread(procs[0].kill)
        await asyncio.to_thread(procs[0].start)  # back on the same port with its initial weights, unseen
        restarted = gw.services.pool.get(procs[0].url.removeprefix("http://"))
        survivor = gw.services.pool.get(procs[1].url.removeprefix("http://"))
        assert restarted is not None and survivor is not None
        prompt = list(range(200, 240))  # two full blocks of the prefix cache
        reached: list[str] = []
        for i in range(8):  # sessions spread over both replicas: those on the restarted one resume on the other
            result = (await http.post(f"{gw.url}/generate", json=generate_body(prompt, 4, session_id=f"s{i}"))).json()
            assert result["output_ids"] == expected_tokens(prompt, [1] * 4, 4)
            reached += result["replicas"]
        assert restarted.id in reached
        await gw.services.pool.check_health()  # the probe holds it out...
        await wait_for(lambda: not restarted.stale and restarted.version == 1, what="the catch-up")  # ...until v1
        assert (await http.delete(f"{gw.url}/admin/replicas/{survivor.id}", headers=ADMIN)).status_code == 204
        result = (await http.post(f"{gw.url}/generate", json=generate_body(prompt, 4))).json()
        assert result["replicas"] == [restarted.id] and result["versions"] == [1] * 4
        assert result["output_ids"] == expected_tokens(prompt, [1] * 4, 4)
    finally:
        for proc in procs:
            await asyncio.to_thread(proc.stop)


def version_zero_engine(reads: dict[str, int], failing: tuple[int, ...] = ()) -> Callable[[Seen], Answer]:
    """A scripted vLLM replica at weight version 0 that counts its `/weight_info` reads in `reads`; the reads
    numbered in `failing` (from 1) answer 500."""

    def engine(seen: Seen) -> Answer:
        if seen.path == "/weight_info":
            reads["weight_info"] += 1
            if reads["weight_info"] in failing:
                return Answer(500, b'{"error": "busy"}')
            return Answer(200, b'{"weight_version": "0"}')
        if seen.path == "/health":
            return Answer(200, b"")
        return Answer(404, b"{}")

    return engine


async def test_a_failed_weight_version_read_does_not_hold_a_replica_out(make_gateway: GatewayFactory) -> None:
    """Bug: the health probe also reads the replica's weight version, and a failed read (a connection reset
    under load, in the benchmark) counted as "reports version None": the replica was held out as stale, and since
    only loading weights re-admits a stale replica, for good. The benchmark's every session then went to the
    other replica. A failed read now proves nothing and changes nothing."""
    reads = {"weight_info": 0}
    engine = version_zero_engine(reads, failing=(2, 3))  # the start-up read succeeds; two probes' reads fail

    async with scripted_server(engine) as replica:
        gw = await make_gateway([ReplicaConfig(url=replica.url, backend="vllm")])
        (held,) = gw.services.pool.all()
        await wait_for(lambda: reads["weight_info"] >= 5, what="probes past the failed reads")
        assert not held.stale and held in gw.services.pool.candidates()


async def test_a_stopped_gateway_probes_its_replicas_no_more(make_gateway: GatewayFactory) -> None:
    """Bug (CI, the vLLM tier): a test restored the engine while its gateway still ran; the gateway's health probe
    read the restored label, held the replica out and loaded the test's weights back onto it. The tiers now stop
    their gateway first: after `RunningGateway.stop()` nothing reaches the replica and nothing answers."""
    reads = {"weight_info": 0}

    async with scripted_server(version_zero_engine(reads)) as replica:
        gw = await make_gateway([ReplicaConfig(url=replica.url, backend="vllm")])
        await wait_for(lambda: reads["weight_info"] >= 3, what="a few health probes")
        await gw.stop()
        stopped_at = reads["weight_info"]
        await asyncio.sleep(1.0)  # five probe intervals (0.2 s in tests)
        assert reads["weight_info"] == stopped_at
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(f"{gw.url}/health")
        await gw.stop()  # a second stop (and leaving serve_gateway afterwards) is a no-op
