"""Focused regression tests for bugs found in issue 7 (reliability work: chaos soak, fuzzing, shutdown)."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from backends.sim.engine import EngineSettings
from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import expected_tokens, generate_body, publish
from tests.scripted_server import Answer, Seen, scripted_server
from tests.sim_helpers import wait_for

PROMPT = [11, 22, 33, 44, 55]


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


async def test_stream_cut_before_its_first_byte_releases_the_session(
    make_sim: SimFactory, make_gateway: GatewayFactory
) -> None:
    """Bug: when the client left while the head of a streamed answer was being sent, Starlette cancelled the
    body before its generator started, so the turn was never closed: the session's lock (and its per-key slot)
    stayed taken and every later turn of that session hung."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True})
    messages: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            await asyncio.Event().wait()  # the socket never drains: the client leaves during the head

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"cut")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    await asyncio.wait_for(gw.app(scope, receive, send), timeout=10)
    assert not gw.services.turns.sessions.lock("cut").locked()
    assert gw.services.quota.in_flight() == 0


async def test_turn_cut_mid_segment_is_recorded_with_aligned_arrays(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug: a turn cut mid-segment (client gone, or shutdown past its bound) had its tokens and logprobs but not
    their versions (those were assigned when a segment closed), so recording it raised TrajectoryFormatError
    and the tokens generated so far were lost instead of checkpointed."""
    from backends.sim.engine import EngineSettings

    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005))
    gw = await make_gateway([sim])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2000, "stream": True}
    body |= {"ignore_eos": True}
    seen = 0
    async with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body, headers={"x-session-id": "cut"}) as r:
        async for line in r.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= 20:
                break  # leave mid-generation: the connection closes
    store = gw.services.store

    async def recorded() -> bool:
        return bool(await store.load_samples("cut"))

    await wait_for(recorded, what="the cut turn recorded")
    [sample] = await store.load_samples("cut")
    n = len(sample.response_ids)
    assert sample.cancelled and 15 <= n < 2000
    assert len(sample.loss_mask) == len(sample.logprobs) == len(sample.versions) == n
    assert not gw.services.turns.sessions.lock("cut").locked()


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


async def test_json_numbers_beyond_64_bits_are_refused_not_a_500(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by the property tests of the Redis codecs): JSON allows integers of any size, the store
    encodes with orjson (64-bit), so a session created with such metadata was a 500. Now it is a 400 naming
    the field, and nothing is stored."""
    gw = await make_gateway([await make_sim("vllm")])
    huge = 2**64
    headers = {"content-type": "application/json"}
    cases = [
        ("/v1/sessions", {"metadata": {"x": huge}}, "metadata"),
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "n": huge}]}]},
            "messages.0.content",
        ),
    ]
    for path, body, param in cases:
        response = await http.post(f"{gw.url}{path}", content=_dumps(body), headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    session = (await http.post(f"{gw.url}/v1/sessions", json={})).json()["id"]
    finish = await http.post(
        f"{gw.url}/v1/sessions/{session}/finish", content=_dumps({"metadata": {"x": huge}}), headers=headers
    )
    assert finish.status_code == 400 and finish.json()["error"]["param"] == "metadata"


def _dumps(body: Any) -> bytes:
    import json

    return json.dumps(body).encode()  # the standard library writes integers of any size, as a client may


async def test_redis_pool_waits_for_a_free_connection(redis_server: Any, redis: Any) -> None:
    """Bug (found by the chaos soak): redis-py's default pool fails at once with "Too many connections" when all
    its connections are busy, so under 300 concurrent sessions ordinary turns got 503s. The gateway's pool now
    waits for a free connection."""
    from gateway.store import connect

    client = connect(redis_server.url, socket_timeout_s=5.0, max_connections=2)
    try:
        # BLPOP holds a connection for its timeout: far more commands than connections, all must succeed.
        results = await asyncio.gather(*(client.blpop([f"empty-{i}"], timeout=0.05) for i in range(12)))
        assert results == [None] * 12
    finally:
        await client.aclose()


@pytest.mark.parametrize("path", ["/admin/weights", "/admin/resume"])
@pytest.mark.parametrize("version", [2**31, 2**64])
async def test_weight_version_beyond_int32_is_refused_not_a_500(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, path: str, version: int
) -> None:
    """Bug (found by the schema fuzzer): a weight version beyond 64 bits made the coordination bus's encoder
    raise (a 500), and one beyond 32 bits cannot be stored in a sample's int32 per-token versions. Both are a
    400 naming `version` now, and the gateway's version is unchanged."""
    gw = await make_gateway([await make_sim("vllm")])
    headers = ADMIN | {"content-type": "application/json"}
    body = {"version": version} | ({"source": "external"} if path == "/admin/weights" else {})
    response = await http.post(f"{gw.url}{path}", content=_dumps(body), headers=headers)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "version"
    status = await http.get(f"{gw.url}/admin/status", headers=ADMIN)
    assert status.json()["version"] == 0


async def test_request_queued_during_a_keep_pause_never_reads_old_weights_kv(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by the chaos soak with the prefix cache on): vLLM keeps its prefix cache across a weight
    reload, and `/reset_prefix_cache` is refused while a keep-paused request holds KV. The gateway then flushed
    later, once the replica was idle; but a request that reached the engine after its pause (sent just before
    it, or by another gateway process) is queued there and admitted on resume, onto prefix KV of the old
    weights: it sampled tokens that no version draws. The flush now preempts running requests (they recompute
    their KV under the new weights), so it succeeds before the replica resumes."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005))
    gw = await make_gateway([sim])
    prompt = list(range(10, 50))  # two full cache blocks
    warm = await http.post(f"{gw.url}/generate", json=generate_body(prompt, 4, session_id="warm"))
    assert warm.status_code == 200  # the prompt's blocks are now cached, computed under the initial weights
    long = asyncio.create_task(http.post(f"{gw.url}/generate", json=generate_body([7, 8, 9], 200, session_id="l")))
    await wait_for(lambda: sim.engine.num_running == 1, what="the long request running")
    assert (await http.post(f"{gw.url}/admin/pause", json={"mode": "keep"}, headers=ADMIN)).status_code == 200
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": "ckpt-1"}}  # the out-of-band weight sync
    assert (await http.post(f"{sim.url}/collective_rpc", json=rpc)).status_code == 200
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    queued = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=body | {"return_token_ids": True}))
    await wait_for(lambda: sim.engine.held == 1, what="the request queued at the paused engine")
    assert (await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)).status_code == 200
    tokens = (await queued).json()["choices"][0]["token_ids"]
    assert tokens == expected_tokens(prompt, [1] * 8, 8)
    result = (await long).json()
    assert result["finish_reason"] == "length" and len(result["output_ids"]) == 200


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


async def test_served_requests_leave_no_reference_cycle_of_the_server(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Bug (found by counting the collector's garbage): the app kept the server's `send` (a method of uvicorn's
    request cycle) in the scope, which the cycle holds, so every request left a reference cycle: the cycle object,
    its scope, headers and events, freed only by the cyclic collector (about 4 % of the CPU of a short request).
    Now the app drops it when the request ends; the simulator runs in a process of its own, so that whatever
    garbage is left here is the gateway's or the client's."""
    sim = SimProcess()
    await asyncio.to_thread(sim.start)
    try:
        gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm")])
        requests: list[tuple[str, dict[str, Any]]] = [
            ("/generate", generate_body(PROMPT, 3)),
            ("/generate", generate_body(PROMPT, 3, stream=True)),
            ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3}),
            ("/health", {}),
        ]
        for path, body in requests:  # warm: first-use allocations are not per request
            await (http.post(f"{gw.url}{path}", json=body) if body else http.get(f"{gw.url}{path}"))
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                for path, body in requests:
                    answer = await (http.post(f"{gw.url}{path}", json=body) if body else http.get(f"{gw.url}{path}"))
                    assert answer.status_code == 200, answer.text
            gc.collect()
            leaked = [o for o in gc.garbage if isinstance(o, RequestResponseCycle)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()
        assert leaked == []
    finally:
        await asyncio.to_thread(sim.stop)
