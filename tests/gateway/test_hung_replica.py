"""A hung replica (a real simulator process stopped with SIGSTOP mid-generation: its sockets stay open, nothing more
comes) must not hold its requests: once the health probe marks it down they resume on another replica at once, and
a stream that sends no token for `generation.stall_timeout_s` counts as a failure of its replica and resumes too.
Either way the caller gets the uninterrupted run's tokens, and the stored sample is one contiguous run of them. A
`keep` pause that holds a stream's tokens past the stall timeout is no stall."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import (
    PROMPT,
    Streamed,
    expected_tokens,
    generate_body,
    scrape,
    slow,
    stream_generate,
    value,
)
from tests.sim_helpers import sim_state, wait_for

TOTAL = 400
# Far under the 600 s a hung replica held its requests before (`generation.read_timeout_s`), far over what the
# resumes take on a loaded 2-core machine.
FINISH_WITHIN_S = 15.0
FASTPATH = [pytest.param({}, id="fastpath-engine-client"), pytest.param({"engine_client": False}, id="aiohttp")]


@contextlib.asynccontextmanager
async def two_replicas(dialect: str) -> AsyncIterator[list[SimProcess]]:
    procs = [SimProcess(["--dialect", dialect, "--token-delay", "0.003"]) for _ in range(2)]
    try:
        for proc in procs:
            await asyncio.to_thread(proc.start)
        yield procs
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                if proc.pid is not None:
                    os.kill(proc.pid, signal.SIGCONT)
            await asyncio.to_thread(proc.stop)


async def _generated(http: httpx.AsyncClient, url: str, at_least: int) -> bool:
    return bool((await sim_state(http, url))["counters"].get("generation_tokens", 0) >= at_least)


async def _check_sample(gw: RunningGateway, session_id: str, output_ids: list[int], replicas: list[str]) -> None:
    """The session's one sample holds exactly the answer's tokens, in contiguous segments, the last on another
    replica than the first."""
    [sample] = await gw.services.store.load_samples(session_id)
    assert sample.response_ids.tolist() == output_ids
    assert np.all(sample.loss_mask == 1) and len(sample.logprobs) == len(output_ids)
    bounds = [(s.start, s.end) for s in sample.segments if s.end > s.start]
    assert bounds[0][0] == 0 and bounds[-1][1] == len(output_ids)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert sample.segments[-1].replica == replicas[-1] != replicas[0]


async def _stop_under(
    gw: RunningGateway, http: httpx.AsyncClient, procs: list[SimProcess], progress: list[int], at_least: int
) -> tuple[SimProcess, str]:
    """SIGSTOP the replica serving the sessions once it generated `at_least` tokens and the stream got some."""
    victim = gw.services.pool.all()[0]
    proc = next(p for p in procs if p.url.endswith(victim.id.split(":")[-1]))
    await wait_for(lambda: progress[0] >= 50, what="streamed tokens before the stop")
    await wait_for(lambda: _generated(http, proc.url, at_least), what="tokens before the stop")
    assert proc.pid is not None
    os.kill(proc.pid, signal.SIGSTOP)
    return proc, victim.id


@pytest.mark.parametrize("fastpath", FASTPATH)
@pytest.mark.parametrize("dialect", ["vllm", "sglang"])
async def test_requests_on_a_replica_the_probe_marks_down_resume_elsewhere_at_once(
    make_gateway: GatewayFactory, http: httpx.AsyncClient, dialect: str, fastpath: dict[str, Any]
) -> None:
    """The probe marks the stopped replica down within its timeout; its streamed and whole requests go on elsewhere
    then, not after the read timeout. The stall timeout is left long: the probe alone moves them."""
    async with two_replicas(dialect) as procs:
        gw = await make_gateway(
            [ReplicaConfig(url=p.url, backend="sim", dialect=dialect) for p in procs],
            routing={"health_timeout_s": 1.0},
            generation={"stall_timeout_s": 600.0},
            fastpath=fastpath,
        )
        pool = gw.services.pool
        victim_id = pool.all()[0].id
        for session in ("hung-stream", "hung-whole"):
            pool.remember(session, victim_id)  # both on the replica that will hang
        progress = [0]
        streamed = asyncio.create_task(
            stream_generate(http, gw.url, generate_body(PROMPT, TOTAL, session_id="hung-stream"), progress)
        )
        whole = asyncio.create_task(
            http.post(f"{gw.url}/generate", json=generate_body(PROMPT, TOTAL, session_id="hung-whole"))
        )
        _, stopped_id = await _stop_under(gw, http, procs, progress, 120)
        assert stopped_id == victim_id
        stopped_at = time.monotonic()
        try:
            result, answer = await asyncio.wait_for(asyncio.gather(streamed, whole), FINISH_WITHIN_S)
        except TimeoutError:
            raise AssertionError(
                f"requests still held by the hung replica {FINISH_WITHIN_S:g} s after its stop"
            ) from None
        assert not pool.get(victim_id).healthy  # type: ignore[union-attr]
        _check_streamed(result, victim_id)
        body = answer.json()
        assert answer.status_code == 200, body
        assert body["finish_reason"] == "length" and body["replicas"][0] == victim_id != body["replicas"][-1]
        assert body["output_ids"] == expected_tokens(PROMPT, body["versions"], TOTAL)
        await _check_sample(gw, "hung-stream", result.output_ids, result.final["replicas"])
        await _check_sample(gw, "hung-whole", body["output_ids"], body["replicas"])
        assert gw.services.generator.interrupted_total >= 2 and gw.services.generator.stalled_total == 0
        assert time.monotonic() - stopped_at < FINISH_WITHIN_S


def _check_streamed(result: Streamed, victim_id: str) -> None:
    assert result.error is None and result.final["finish_reason"] == "length"
    assert result.output_ids == expected_tokens(PROMPT, result.final["versions"], TOTAL)
    replicas = result.final["replicas"]
    assert replicas[0] == victim_id != replicas[-1] and result.final["num_resumes"] >= 1


@pytest.mark.parametrize("fastpath", FASTPATH)
async def test_a_stream_that_stalls_resumes_elsewhere_and_counts_a_failure(
    make_gateway: GatewayFactory, http: httpx.AsyncClient, fastpath: dict[str, Any]
) -> None:
    """No probe runs during the test (the interval outlasts it): the stream's own stall timeout moves it, and the
    replica is charged one failure, not marked down."""
    async with two_replicas("vllm") as procs:
        gw = await make_gateway(
            [ReplicaConfig(url=p.url, backend="sim", dialect="vllm") for p in procs],
            routing={"health_interval_s": 3600.0},
            generation={"stall_timeout_s": 1.0},
            fastpath=fastpath,
        )
        pool = gw.services.pool
        victim_id = pool.all()[0].id
        pool.remember("stalled", victim_id)
        progress = [0]
        streamed = asyncio.create_task(
            stream_generate(http, gw.url, generate_body(PROMPT, TOTAL, session_id="stalled"), progress)
        )
        await _stop_under(gw, http, procs, progress, 50)
        try:
            result = await asyncio.wait_for(streamed, FINISH_WITHIN_S)
        except TimeoutError:
            raise AssertionError(
                f"a stalled stream still waits {FINISH_WITHIN_S:g} s after its replica stopped"
            ) from None
        _check_streamed(result, victim_id)
        await _check_sample(gw, "stalled", result.output_ids, result.final["replicas"])
        victim = pool.get(victim_id)
        assert victim is not None and victim.healthy and victim.consecutive_failures == 1
        assert gw.services.generator.stalled_total == 1 and gw.services.generator.interrupted_total == 0
        samples = await scrape(http, gw.url)
        assert value(samples, "rollout_gateway_segments_cut_total", cause="stalled") == 1
        assert value(samples, "rollout_gateway_segments_cut_total", cause="replica_out") == 0


async def test_a_stream_held_by_a_keep_pause_past_the_stall_timeout_goes_on(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A `keep` pause freezes the engine's requests for as long as the weight sync takes: no token comes, and that
    is no stall. The stream goes on in the same engine request after the resume."""
    sim = await make_sim(*slow("vllm", 0.005))
    gw = await make_gateway([sim], generation={"stall_timeout_s": 0.3})
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 300, session_id="held"), progress))
    await wait_for(lambda: progress[0] >= 20, what="tokens before the pause")
    assert (await http.post(f"{gw.url}/admin/pause", json={"mode": "keep"}, headers=ADMIN)).status_code == 200
    rpc = {"method": "reload_weights", "kwargs": {"weights_path": "ckpt-1"}}  # the out-of-band weight sync
    assert (await http.post(f"{sim.url}/collective_rpc", json=rpc)).status_code == 200
    await asyncio.sleep(1.0)  # the sync outlasts the stall timeout: the duration under test, not synchronisation
    assert (await http.post(f"{gw.url}/admin/resume", json={"version": 1}, headers=ADMIN)).status_code == 200
    result = await task
    assert result.error is None and result.final["finish_reason"] == "length"
    assert result.final["num_resumes"] == 0 and set(result.final["versions"]) == {0, 1}
    assert result.output_ids == expected_tokens(PROMPT, result.final["versions"], 300)
    assert gw.services.generator.stalled_total == 0


@pytest.mark.parametrize("fastpath", FASTPATH)
async def test_a_stream_whose_replica_sends_no_first_token_resumes_elsewhere(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, fastpath: dict[str, Any]
) -> None:
    """A replica that answers its health probe but decodes nothing (a wedged scheduler) sends no first token: once
    `generation.first_token_timeout_s` passed with no token for any request, the engine request is aborted and the
    stream resumes on the other replica. Before this bound it waited out `read_timeout_s` (600 s)."""
    victim, other = await make_sim(*slow("vllm", 0.003)), await make_sim(*slow("vllm", 0.003))
    gw = await make_gateway(
        [victim, other],
        routing={"health_interval_s": 0.2},  # probes run, and pass: the replica looks alive
        generation={"first_token_timeout_s": 0.5, "stall_timeout_s": 600.0},
        fastpath=fastpath,
    )
    pool = gw.services.pool
    victim_id = next(r.id for r in pool.all() if victim.url.endswith(r.id.split(":")[-1]))
    pool.remember("wedged", victim_id)
    assert (await http.post(f"{victim.url}/sim/faults", json={"stall": True})).status_code == 200
    body = generate_body(PROMPT, 50, session_id="wedged")
    try:
        result = await asyncio.wait_for(stream_generate(http, gw.url, body, [0]), FINISH_WITHIN_S)
    except TimeoutError:
        raise AssertionError(f"a stream without a first token still waits after {FINISH_WITHIN_S:g} s") from None
    assert result.error is None and result.final["finish_reason"] == "length", result.final
    assert result.output_ids == expected_tokens(PROMPT, result.final["versions"], 50)
    assert result.final["num_resumes"] >= 1 and victim_id not in result.final["replicas"][-1:]
    wedged = pool.get(victim_id)
    assert wedged is not None and wedged.healthy and wedged.consecutive_failures == 1
    assert gw.services.generator.stalled_total == 1
    await wait_for(lambda: not victim.engine.requests, what="the wedged replica's engine request aborted")


async def test_a_stream_queued_behind_moving_requests_is_not_taken_for_a_hang(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A request whose first token takes longer than `first_token_timeout_s` (here a long prefill) on a replica that
    keeps sending other requests' tokens is waiting, not hung: it is not cut."""
    sim = await make_sim(*slow("vllm", 0.005, prefill_delay_s_per_token=0.002))
    gw = await make_gateway([sim], generation={"first_token_timeout_s": 1.0})
    busy = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 1500, session_id="busy"), [0]))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 10, what="the busy stream under way")
    long_prompt = [1 + i % 1000 for i in range(1500)]  # 3 s of prefill
    queued = await stream_generate(http, gw.url, generate_body(long_prompt, 5, session_id="queued"), [0])
    assert queued.error is None and queued.final["num_resumes"] == 0, queued.final
    assert gw.services.generator.stalled_total == 0
    busy.cancel()
