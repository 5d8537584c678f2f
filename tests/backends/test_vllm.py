"""`VllmBackend` against in-process simulator replicas speaking vLLM's protocol (real HTTP, real sockets).

The last section drives the adapter with a scripted HTTP server (`tests/scripted_server.py`) for answers the
simulator never gives (contract breaches, cut streams, older-server shapes): the adapter's error paths, not the
simulator's.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from backends.base import Chunk, EngineBackend, Load, ReplicaSpec, SamplingParams, Timeouts, VersionSpan
from backends.errors import (
    BackendError,
    BackendProtocolError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    WeightsNotLoaded,
)
from backends.http_client import parse_gauges
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from backends.sim.server import SimReplica
from backends.vllm import PROMPT_ECHO_MIN_BYTES, VllmBackend, without_prompt_echo
from tests.conftest import SimFactory
from tests.scripted_server import Answer, Handler, ScriptedServer, Seen, replying, scripted_server, sse_body
from tests.sim_helpers import gateway_transport, wait_for

SHAPE = ModelShape()
PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
INIT = ("init", "default")

BackendFactory = Callable[..., VllmBackend]
Scripted = Callable[[Handler], Awaitable[ScriptedServer]]


def greedy(max_tokens: int, **extra: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **extra)


@pytest.fixture
async def backend_for() -> AsyncIterator[BackendFactory]:
    """`backend_for(sim_or_url, **spec_fields)`: a VllmBackend closed after the test."""
    backends: list[VllmBackend] = []

    def make(target: SimReplica | str, **spec: Any) -> VllmBackend:
        url = target if isinstance(target, str) else target.url
        backend = VllmBackend(ReplicaSpec(id="r0", url=url, **({"generation_transport": gateway_transport()} | spec)))
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        await backend.aclose()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[Handler], Awaitable[ScriptedServer]]]:
    """`await scripted(handler)`: a scripted HTTP server on loopback, stopped after the test."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(handler: Handler) -> ScriptedServer:
            return await stack.enter_async_context(scripted_server(handler))

        yield start


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    return [chunk async for chunk in chunks]


def tokens_of(chunks: Sequence[Chunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# ----------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------


async def test_stream_equals_reference(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001))
    backend = backend_for(sim)
    assert isinstance(backend, EngineBackend)
    assert backend.capabilities.token_endpoint == "/v1/completions"
    chunks = await collect(backend.generate(PROMPT, greedy(24), "s1"))
    assert tokens_of(chunks) == reference_tokens(SHAPE, PROMPT, INIT, 24, ignore_eos=True)
    assert len(chunks) > 1  # streamed, not one answer
    assert all(len(c.token_ids) == len(c.logprobs) and c.token_ids for c in chunks)
    assert all(lp <= 0 for c in chunks for lp in c.logprobs)
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    final = chunks[-1]
    assert final.version_spans == [VersionSpan("default", 0, 24)] and final.weight_version == "default"
    assert final.top_logprobs is None and final.routed_experts is None and final.cached_tokens is None
    assert all(c.version_spans is None for c in chunks[:-1])


async def test_logprobs_match_the_engine_and_top_logprobs_are_keyed_by_id(
    make_sim: SimFactory, backend_for: BackendFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    backend = backend_for(sim)
    chunks = await collect(backend.generate(PROMPT, greedy(10, top_logprobs=3), "t1"))
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    expected = (await http.post(f"{sim.url}/v1/completions", json=body)).json()["choices"][0]["logprobs"]
    assert [lp for c in chunks for lp in c.logprobs] == expected["token_logprobs"]
    for chunk in chunks:
        assert chunk.top_logprobs is not None and len(chunk.top_logprobs) == len(chunk.token_ids)
        for token, logprob, top in zip(chunk.token_ids, chunk.logprobs, chunk.top_logprobs, strict=True):
            assert len(top) == 3 and top[0] == (token, logprob)  # greedy: the sampled token is the best
            assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


async def test_stop_token_eos_and_cached_tokens(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", enable_prompt_tokens_details=True)
    backend = backend_for(sim)
    full = reference_tokens(SHAPE, PROMPT, INIT, 20, ignore_eos=True)
    stop = full[5]
    chunks = await collect(backend.generate(PROMPT, greedy(20, stop_token_ids=(stop,)), "st"))
    assert tokens_of(chunks) == full[: full.index(stop) + 1]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    assert chunks[-1].cached_tokens == 0
    prompt = list(range(10, 50))  # two full 16-token blocks can be reused by the second request
    await collect(backend.generate(prompt, greedy(2), "c1"))
    assert (await collect(backend.generate(prompt, greedy(2), "c2")))[-1].cached_tokens == 32
    eos_sim = await make_sim("vllm", engine=EngineSettings(shape=ModelShape(eos_prob=0.5)))
    chunks = await collect(backend_for(eos_sim).generate(PROMPT, SamplingParams(max_tokens=64, temperature=0), "e"))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason is None
    assert tokens_of(chunks)[-1] == SHAPE.eos_token_id


async def test_consumer_closing_early_aborts_the_request(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    stream = backend_for(sim).generate(PROMPT, greedy(1000), "early")
    async with contextlib.aclosing(stream):
        async for _ in stream:
            if sim.engine.counters["generation_tokens"] >= 5:
                break
    await wait_for(lambda: sim.engine.counters["finished_abort"] == 1, what="disconnect abort")
    assert sim.engine.num_running == 0


# ----------------------------------------------------------------------------------------------------------
# Abort, pause, resume, weights
# ----------------------------------------------------------------------------------------------------------


async def generate_until(
    backend: VllmBackend, sampling: SamplingParams, request_id: str, ready: asyncio.Event, after: int = 10
) -> list[Chunk]:
    """Consume a generation, setting `ready` once `after` tokens arrived."""
    chunks: list[Chunk] = []
    async for chunk in backend.generate(PROMPT, sampling, request_id):
        chunks.append(chunk)
        if len(tokens_of(chunks)) >= after:
            ready.set()
    ready.set()
    return chunks


@pytest.mark.parametrize("scale_out", [False, True])
async def test_abort_mid_stream_returns_a_prefix(
    make_sim: SimFactory, backend_for: BackendFactory, scale_out: bool
) -> None:
    engine = EngineSettings(token_delay_s=0.002, routed_experts_output=scale_out)
    sim = await make_sim("vllm", engine=engine, enable_scale_out=scale_out)
    backend = backend_for(sim, routed_experts=scale_out, scale_out=scale_out)
    ready = asyncio.Event()
    task = asyncio.create_task(generate_until(backend, greedy(500), "ab", ready))
    await ready.wait()
    await backend.abort("ab")
    chunks = await task
    partial = tokens_of(chunks)
    assert chunks[-1].finish_reason == "abort" and 10 <= len(partial) < 500
    assert partial == reference_tokens(SHAPE, PROMPT, INIT, len(partial), ignore_eos=True)


async def test_pause_abort_then_resume(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    backend = backend_for(sim)
    ready = asyncio.Event()
    task = asyncio.create_task(generate_until(backend, greedy(150), "pa", ready))
    await ready.wait()
    await backend.pause("abort")
    assert sim.engine.paused
    chunks = await task
    assert chunks[-1].finish_reason == "abort"
    await backend.resume()
    assert not sim.engine.paused
    partial = tokens_of(chunks)
    rest = tokens_of(await collect(backend.generate(PROMPT + partial, greedy(150 - len(partial)), "pa2")))
    assert partial + rest == reference_tokens(SHAPE, PROMPT, INIT, 150, ignore_eos=True)


async def test_pause_wait_drains_and_keep_freezes(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001))
    backend = backend_for(sim)
    ready = asyncio.Event()
    task = asyncio.create_task(generate_until(backend, greedy(60), "w", ready, after=1))
    await ready.wait()
    await backend.pause("wait")  # returns only once the in-flight request has finished in the engine
    assert sim.engine.counters["finished_length"] == 1 and not sim.engine.requests
    assert (await task)[-1].finish_reason == "length"
    await backend.resume()

    ready = asyncio.Event()
    task = asyncio.create_task(generate_until(backend, greedy(200), "k", ready, after=5))
    await ready.wait()
    await backend.pause("keep")
    frozen = sim.engine.counters["generation_tokens"]
    assert sim.engine.frozen and not task.done() and sim.engine.num_running == 1
    await backend.resume()
    chunks = await task
    assert sim.engine.counters["generation_tokens"] > frozen
    assert chunks[-1].finish_reason == "length"
    assert tokens_of(chunks) == reference_tokens(SHAPE, PROMPT, INIT, 200, ignore_eos=True)


async def test_keep_mode_update_gives_version_spans(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001))
    backend = backend_for(sim)
    ready = asyncio.Event()
    task = asyncio.create_task(generate_until(backend, greedy(120), "kv", ready))
    await ready.wait()
    await backend.pause("keep")
    # The frozen request holds KV: the reset preempts it (it recomputes under the new weights on resume), so the
    # prefix cache is flushed before anything queued at the paused engine can be admitted onto old KV.
    assert await backend.update_weights("v2", "ckpt2") is True
    assert sim.engine.counters["retractions"] == 1
    assert await backend.weight_version() == "v2"
    await backend.resume()
    final = (chunks := await task)[-1]
    assert final.version_spans is not None and final.weight_version == "v2"
    k = final.version_spans[0].end
    assert final.version_spans == [VersionSpan("default", 0, k), VersionSpan("v2", k, 120)]
    per_token = [INIT] * k + [("ckpt2", "v2")] * (120 - k)
    assert tokens_of(chunks) == reference_tokens(SHAPE, PROMPT, per_token, 120, ignore_eos=True)
    assert await backend.flush_cache() is True  # nothing holds KV any more


async def test_update_weights_changes_outputs(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm")
    backend = backend_for(sim)
    assert await backend.weight_version() == "default"
    before = tokens_of(await collect(backend.generate(PROMPT, greedy(12), "u0")))
    assert await backend.update_weights("v3", "w3") is True
    assert await backend.weight_version() == "v3" and sim.engine.weights == "w3"
    after = tokens_of(await collect(backend.generate(PROMPT, greedy(12), "u1")))
    assert after == reference_tokens(SHAPE, PROMPT, ("w3", "v3"), 12, ignore_eos=True) != before
    assert await backend.update_weights("v4", None) is True  # synced out of band: only the label changes
    assert sim.engine.weights == "w3" and await backend.weight_version() == "v4"
    again = tokens_of(await collect(backend.generate(PROMPT, greedy(12), "u2")))
    assert again == reference_tokens(SHAPE, PROMPT, ("w3", "v4"), 12, ignore_eos=True)


async def test_a_reload_from_a_missing_path_is_weights_not_loaded(
    make_sim: SimFactory, backend_for: BackendFactory, tmp_path: Path
) -> None:
    """vLLM answers a reload it cannot read with an error and keeps its weights: the adapter says so with
    `WeightsNotLoaded` (the one failure a weight update may roll back), and does not relabel."""
    sim = await make_sim("vllm", weights_must_exist=True)
    backend = backend_for(sim)
    with pytest.raises(WeightsNotLoaded, match="no checkpoint") as failed:
        await backend.update_weights("v2", str(tmp_path / "missing"))
    assert failed.value.code == "500"
    assert await backend.weight_version() == "default" and sim.engine.weights == "init"
    assert await backend.update_weights("v2", str(tmp_path)) is True  # a path that is there loads
    assert await backend.weight_version() == "v2" and sim.engine.weights == str(tmp_path)


async def test_a_failed_relabel_after_a_reload_is_not_weights_not_loaded(
    backend_for: BackendFactory, scripted: Scripted
) -> None:
    """The reload succeeded and only the relabel failed: the engine runs the new weights under the old label, so
    this must not read as "kept its weights" (the coordinator would roll back onto weights that are gone)."""
    answers = {
        "/collective_rpc": (200, b'{"results":[null]}'),
        "/update_weight_version": (500, b'{"error":{"message":"boom"}}'),
    }
    backend = backend_for((await scripted(lambda r: Answer(*answers[r.path]))).url)
    with pytest.raises(BackendError) as failed:
        await backend.update_weights("v2", "/ckpt")
    assert not isinstance(failed.value, WeightsNotLoaded)
    answers["/collective_rpc"] = (503, b'{"error":{"message":"starting"}}')  # not taken up: weights unknown
    with pytest.raises(BackendUnavailable):
        await backend.update_weights("v2", "/ckpt")


# ----------------------------------------------------------------------------------------------------------
# Routed experts (R3)
# ----------------------------------------------------------------------------------------------------------


async def test_routed_experts_non_stream_and_scale_out(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    engine = EngineSettings(routed_experts_output=True, token_delay_s=0.001)
    sim = await make_sim("vllm", engine=engine, enable_scale_out=True)
    plain = backend_for(sim, routed_experts=True)
    assert plain.capabilities.token_endpoint == "/v1/completions" and plain.capabilities.routed_experts_out
    chunks = await collect(plain.generate(PROMPT, greedy(6), "x1", experts_start=3))
    assert len(chunks) == 1  # non-streaming: the only completions transport carrying experts
    (chunk,) = chunks
    assert chunk.routed_experts is not None and chunk.finish_reason == "length"
    assert chunk.routed_experts.shape == (len(PROMPT) + 6 - 1 - 3, SHAPE.num_layers, SHAPE.top_k)
    assert chunk.token_ids == reference_tokens(SHAPE, PROMPT, INIT, 6, ignore_eos=True)
    assert chunk.version_spans == [VersionSpan("default", 0, 6)]
    (whole,) = await collect(plain.generate(PROMPT, greedy(6), "x2"))
    assert whole.routed_experts is not None and np.array_equal(whole.routed_experts[3:], chunk.routed_experts)

    scaled = backend_for(sim, routed_experts=True, scale_out=True)
    caps = scaled.capabilities
    assert caps.token_endpoint == "/inference/v1/generate" and caps.streams_routed_experts
    chunks = await collect(scaled.generate(PROMPT, greedy(6, top_logprobs=2), "x3", experts_start=3))
    assert len(chunks) > 1 and all(c.routed_experts is None for c in chunks[:-1])
    final = chunks[-1]
    assert tokens_of(chunks) == chunk.token_ids
    assert [lp for c in chunks for lp in c.logprobs] == chunk.logprobs
    assert all(c.top_logprobs is not None and len(c.top_logprobs[0]) == 2 for c in chunks)
    assert final.routed_experts is not None and np.array_equal(final.routed_experts, chunk.routed_experts)
    assert final.version_spans == [VersionSpan("default", 0, 6)]


async def test_routed_experts_off_or_null(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm")  # engine started without routed-experts capture: the field is null
    (chunk,) = await collect(backend_for(sim, routed_experts=True).generate(PROMPT, greedy(4), "n1"))
    assert chunk.routed_experts is None and len(chunk.token_ids) == 4


@pytest.mark.parametrize("scale_out", [False, True])
async def test_replay_input_sent_only_when_enabled(
    make_sim: SimFactory, backend_for: BackendFactory, scale_out: bool
) -> None:
    engine = EngineSettings(routed_experts_output=True, routed_experts_input=True)
    sim = await make_sim("vllm", engine=engine, enable_scale_out=scale_out)
    given = np.full((len(PROMPT), SHAPE.num_layers, SHAPE.top_k), 7, dtype=np.uint8)
    replaying = backend_for(sim, routed_experts=True, routed_experts_input=True, scale_out=scale_out)
    assert replaying.capabilities.routed_experts_in
    chunks = await collect(replaying.generate(PROMPT, greedy(4), "p1", routed_experts=given))
    experts = chunks[-1].routed_experts
    assert experts is not None and (experts[: len(PROMPT)] == 7).all() and not (experts[len(PROMPT) :] == 7).all()
    silent = backend_for(sim, routed_experts=True, scale_out=scale_out)
    assert not silent.capabilities.routed_experts_in
    experts = (await collect(silent.generate(PROMPT, greedy(4), "p2", routed_experts=given)))[-1].routed_experts
    assert experts is not None and not (experts[: len(PROMPT)] == 7).all()


# ----------------------------------------------------------------------------------------------------------
# Failures, health, load, lifecycle
# ----------------------------------------------------------------------------------------------------------


async def test_engine_errors_are_translated(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", error_rate=1.0)
    with pytest.raises(BackendError) as failed:
        await collect(backend_for(sim).generate(PROMPT, greedy(4), "e1"))
    assert type(failed.value) is BackendError and failed.value.code == "500" and failed.value.retryable
    assert await backend_for(sim).health() is True  # only generation fails

    good = await make_sim("vllm")
    with pytest.raises(BackendRejected) as rejected:
        await collect(backend_for(good).generate([1, 99999], greedy(4), "e2"))
    assert "out of vocabulary" in rejected.value.message and not rejected.value.retryable
    with pytest.raises(BackendRejected):  # the non-streaming R3 transport too
        await collect(backend_for(good, routed_experts=True).generate([1, 99999], greedy(4), "e3"))


async def test_paused_replica_rejecting_new_requests(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(new_requests_while_paused="reject"))
    backend = backend_for(sim, new_requests_while_paused="reject")
    assert backend.capabilities.new_requests_while_paused == "reject"
    await backend.pause("abort")
    with pytest.raises(BackendUnavailable, match="503"):
        await collect(backend.generate(PROMPT, greedy(4), "rj"))
    await backend.resume()
    assert len(tokens_of(await collect(backend.generate(PROMPT, greedy(4), "rj2")))) == 4


async def test_unreachable_replica(backend_for: BackendFactory) -> None:
    backend = backend_for(f"http://127.0.0.1:{free_port()}", timeouts=Timeouts(connect=1.0))
    with pytest.raises(BackendUnavailable):
        await collect(backend.generate(PROMPT, greedy(4), "down"))
    with pytest.raises(BackendUnavailable):
        await backend.pause("abort")
    assert await backend.health() is False


async def test_hung_replica_times_out(
    make_sim: SimFactory, backend_for: BackendFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")
    backend = backend_for(sim, timeouts=Timeouts(read=0.2, control=0.2, health=0.2))
    await http.post(f"{sim.url}/sim/faults", json={"hang": True})
    try:
        with pytest.raises(BackendTimeout):
            await collect(backend.generate(PROMPT, greedy(4), "hang"))
        with pytest.raises(BackendTimeout):
            await backend.weight_version()
        assert await backend.health() is False
    finally:
        await http.post(f"{sim.url}/sim/faults", json={"hang": False})
    assert await backend.health() is True


async def test_a_stream_that_stalls_midway_times_out(
    make_sim: SimFactory, backend_for: BackendFactory, http: httpx.AsyncClient
) -> None:
    """The read timeout bounds every gap of a stream, not only the wait for its head."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005))
    backend = backend_for(sim, timeouts=Timeouts(read=0.3))
    got: list[int] = []
    try:
        with pytest.raises(BackendTimeout, match="nothing received for 0.3 s"):
            async for chunk in backend.generate(PROMPT, greedy(2000), "stall"):
                got += chunk.token_ids
                if len(got) >= 5:
                    await http.post(f"{sim.url}/sim/faults", json={"hang": True})  # decoding stops
    finally:
        await http.post(f"{sim.url}/sim/faults", json={"hang": False})
    assert 5 <= len(got) < 2000


async def test_a_slow_consumer_is_no_read_timeout(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    """Time the consumer spends elsewhere between chunks does not count against the replica."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001))
    backend = backend_for(sim, timeouts=Timeouts(read=0.2))
    got: list[int] = []
    async for chunk in backend.generate(PROMPT, greedy(40), "slow-reader"):
        got += chunk.token_ids
        if len(got) < 10:
            await asyncio.sleep(0.3)
    assert len(got) == 40


async def test_a_whole_answer_is_bounded_by_whole_answer_not_by_the_read_gap(
    make_sim: SimFactory, backend_for: BackendFactory
) -> None:
    """A non-streamed answer's first byte comes after its whole generation: a generation longer than the read gap
    still completes, and `whole_answer` bounds it."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.02))
    patient = backend_for(sim, timeouts=Timeouts(read=0.1, whole_answer=30.0))
    whole = await collect(patient.generate(PROMPT, greedy(20), "whole", stream=False))  # 0.4 s before its answer
    assert len(whole) == 1 and len(tokens_of(whole)) == 20
    hasty = backend_for(sim, timeouts=Timeouts(read=30.0, whole_answer=0.1))
    with pytest.raises(BackendTimeout):
        await collect(hasty.generate(PROMPT, greedy(20), "hasty", stream=False))


async def test_load_counts_running_requests(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    backend = backend_for(sim)
    assert busy(await backend.load()) == (0, 0)
    ready = asyncio.Event()
    task = asyncio.create_task(generate_until(backend, greedy(2000), "ld", ready, after=1))
    await ready.wait()
    assert busy(await backend.load()) == (1, 0)
    await backend.abort("ld")
    assert (await task)[-1].finish_reason == "abort"
    # The prefix cache's counters (vllm:prefix_cache_{queries,hits}_total): the prompt was looked up once.
    load = await backend.load()
    assert load.prefix_cache_queries == len(PROMPT) and load.prefix_cache_hits == 0


def busy(load: Load) -> tuple[int | None, int | None]:
    return load.running, load.waiting


async def test_aclose_closes_the_client(make_sim: SimFactory, backend_for: BackendFactory) -> None:
    sim = await make_sim("vllm")
    backend = backend_for(sim)
    assert await backend.health() is True
    await backend.aclose()
    with pytest.raises(BackendUnavailable, match="closed"):
        await collect(backend.generate(PROMPT, greedy(4), "closed"))
    with pytest.raises(BackendUnavailable, match="closed"):
        await backend.weight_version()
    assert await backend.health() is False


@pytest.mark.parametrize("stream", [True, False])
async def test_aclose_fails_the_answers_being_read_at_once(
    make_sim: SimFactory, backend_for: BackendFactory, stream: bool
) -> None:
    """Closing a backend fails the answers being read at once: without that, a stream of a replica removed from the
    pool would wait out the read timeout (600 s by default). A whole answer, still waiting for its head, too."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.005))
    backend = backend_for(sim)
    chunks: list[Chunk] = []

    async def consume() -> None:
        async for chunk in backend.generate(PROMPT, greedy(2000), "closing", stream=stream):
            chunks.append(chunk)

    task = asyncio.create_task(consume())
    await wait_for(lambda: sim.engine.num_running == 1 and (len(chunks) > 1 or not stream), what="tokens coming")
    await backend.aclose()
    with pytest.raises(BackendUnavailable, match="closed"):
        await asyncio.wait_for(task, timeout=20)  # the answer itself would take 10 s


# ----------------------------------------------------------------------------------------------------------
# Answers the simulator never gives: contract breaches, cut streams, other server versions (scripted server)
# ----------------------------------------------------------------------------------------------------------


def choice(token_ids: list[int], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    logprobs = {"token_logprobs": [-0.5] * len(token_ids), "top_logprobs": [{f"token_id:{t}": -0.5} for t in token_ids]}
    return {"choices": [{"index": 0, "token_ids": token_ids, "logprobs": logprobs, "finish_reason": finish, **extra}]}


async def test_request_body_follows_the_contract(backend_for: BackendFactory, scripted: Scripted) -> None:
    def handler(request: Seen) -> Answer:
        if request.path == "/pause":
            return Answer(200, b'{"status": "paused"}')
        if request.path == "/abort_requests":
            return Answer(200, b'{"status": "aborted", "aborted": 2}')
        if request.path == "/version":
            return Answer(200, b'{"version": "0.33.0"}')
        return Answer(200, sse_body(choice([9], "length")), "text/event-stream")

    server = await scripted(handler)
    seen = server.seen
    backend = backend_for(server.url)
    sampling = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=20, seed=3, stop_token_ids=(2,))
    await collect(backend.generate([1, 2, 3], sampling, "rq"))
    body = seen[0].json()
    assert seen[0].path == "/v1/completions"
    assert body == {
        "model": "tiny",
        "prompt": [1, 2, 3],
        "max_tokens": 5,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "seed": 3,
        "stop_token_ids": [2],
        "ignore_eos": False,
        "min_tokens": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "return_weight_versions": True,
        "request_id": "rq",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    await backend.abort("rq")
    assert seen[1].json() == {"request_ids": ["cmpl-rq-0", "generate-tokens-rq"]}
    await backend.pause("keep")  # 0.33 reports weight_versions on /v1/completions: keep stays keep
    assert seen[2].path == "/version"
    assert seen[3].path == "/pause" and seen[3].query["mode"] == "keep"


@pytest.mark.parametrize("scale_out", [False, True])
@pytest.mark.parametrize("kind", [list, tuple, range, "array"])
async def test_a_prompt_is_encoded_when_the_request_is_built(
    backend_for: BackendFactory, scripted: Scripted, kind: Any, scale_out: bool
) -> None:
    """Any sequence of ids makes the body's prompt, and the body is encoded as the request is built: a list passed
    uncopied (a first segment's prompt) may change afterwards without changing what the engine gets."""

    answer = choice([9], "length")
    if scale_out:  # /inference/v1/generate's logprobs
        answer["choices"][0]["logprobs"] = {"content": [{"token_id": 9, "logprob": -0.5}]}
    server = await scripted(replying(orjson.dumps(answer)))
    backend = backend_for(server.url, scale_out=scale_out)
    ids = [5, 6, 7]
    prompt = array.array("q", ids) if kind == "array" else range(5, 8) if kind is range else kind(ids)
    request = backend.generate(prompt, SamplingParams(max_tokens=1), "rq", stream=False)
    ids.append(8)  # the caller's list changes before the request is sent
    assert (await collect(request))[-1].token_ids == [9]
    body = server.seen[0].json()
    assert (body["token_ids"] if scale_out else body["prompt"]) == [5, 6, 7]


@pytest.mark.parametrize(("version", "scale_out", "sent"), [("0.32.0", False, "abort"), ("0.32.0", True, "keep")])
async def test_keep_needs_version_spans(scripted: Scripted, version: str, scale_out: bool, sent: str) -> None:
    """vLLM 0.32 has weight_versions only on /inference/v1/generate (scale-out): over /v1/completions a kept
    request could not say which tokens the new weights made, so keep becomes abort (the gateway resumes)."""

    def handler(request: Seen) -> Answer:
        if request.path == "/version":
            return Answer(200, orjson.dumps({"version": version}))
        return Answer(200, b'{"status": "paused"}')

    server = await scripted(handler)
    backend = VllmBackend(ReplicaSpec(id="r0", url=server.url, scale_out=scale_out))
    await backend.pause("keep")
    assert server.seen[-1].path == "/pause" and server.seen[-1].query["mode"] == sent
    # A keep pause asks vLLM to keep its cache (0.32 preempts the kept requests otherwise); an abort clears it.
    assert server.seen[-1].query.get("clear_cache") == ("false" if sent == "keep" else None)
    assert backend.capabilities.version_spans is scale_out
    await backend.aclose()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (sse_body(choice([1, 2])), BackendUnavailable),  # [DONE] without a finish reason
        (sse_body(choice([1, 2]), done=False), BackendUnavailable),  # connection closed mid-request
        (sse_body({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}]}), BackendProtocolError),
        (sse_body({"choices": [{"token_ids": [1], "logprobs": None, "finish_reason": None}]}), BackendProtocolError),
        (sse_body({"choices": [{"token_ids": ["x"], "logprobs": {"token_logprobs": [-1.0]}}]}), BackendProtocolError),
        (sse_body({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": ["?"]}}]}), BackendProtocolError),
        (sse_body({"choices": "nope"}), BackendProtocolError),
        (b"data: [1, 2]\n\n", BackendProtocolError),
        (b"data: {not json\n\n", BackendProtocolError),
        (
            sse_body(choice([1]), {"error": {"message": "boom", "type": "InternalServerError", "code": 500}}),
            BackendError,
        ),
        (sse_body({"object": "error", "message": "bad", "code": 400}), BackendRejected),
        (sse_body(choice([1], "error")), BackendError),
    ],
)
async def test_stream_breaches(
    backend_for: BackendFactory, scripted: Scripted, body: bytes, error: type[BackendError]
) -> None:
    backend = backend_for((await scripted(replying(body))).url)
    with pytest.raises(error) as raised:
        await collect(backend.generate(PROMPT, greedy(4), "b"))
    assert type(raised.value) is error


async def test_top_logprob_keys_must_be_token_ids(backend_for: BackendFactory, scripted: Scripted) -> None:
    event = choice([1], "length")
    event["choices"][0]["logprobs"]["top_logprobs"] = [{"hello": -0.5}]
    backend = backend_for((await scripted(replying(sse_body(event)))).url)
    with pytest.raises(BackendProtocolError, match="token_id"):
        await collect(backend.generate(PROMPT, greedy(4, top_logprobs=1), "k"))


async def test_stream_cut_by_a_transport_error(backend_for: BackendFactory, scripted: Scripted) -> None:
    server = await scripted(replying(sse_body(choice([1, 2]), done=False), cut=True))
    backend = backend_for(server.url)
    received: list[Chunk] = []
    # The fast path's pool and aiohttp each name the cut their way.
    with pytest.raises(
        BackendUnavailable, match="closed the connection before its answer ended|payload is not completed"
    ):
        async for chunk in backend.generate(PROMPT, greedy(4), "cut"):
            received.append(chunk)
    assert tokens_of(received) == [1, 2]  # what arrived before the cut was delivered


@pytest.mark.parametrize("top_logprobs", [0, 1])
async def test_one_read_of_several_events_is_one_delta(
    backend_for: BackendFactory, scripted: Scripted, top_logprobs: int
) -> None:
    """The events of one socket read reach the caller as one delta, their ids and logprobs in order, whether the
    adapter reads them as plain tokens (no top logprobs) or through a chunk each (with them)."""
    first, second, last = choice([1]), choice([2, 3]), choice([4], "length")
    second["choices"][0]["logprobs"]["token_logprobs"] = [-0.25, -0.75]
    backend = backend_for((await scripted(replying(sse_body(first, second, last)))).url)
    chunks = await collect(backend.generate(PROMPT, greedy(4, top_logprobs=top_logprobs), "several"))
    assert [(c.token_ids, c.logprobs, c.finish_reason) for c in chunks] == [
        ([1, 2, 3], [-0.5, -0.25, -0.75], None),
        ([4], [-0.5], "length"),
    ]
    assert chunks[0].top_logprobs == ([[(1, -0.5)], [(2, -0.5)], [(3, -0.5)]] if top_logprobs else None)


async def test_other_finish_reasons_and_usage(backend_for: BackendFactory, scripted: Scripted) -> None:
    usage = {"choices": [], "usage": {"prompt_tokens": 8, "prompt_tokens_details": {"cached_tokens": 128}}}
    body = sse_body(choice([4]), choice([5], "repetition", stop_reason=None), usage)
    backend = backend_for((await scripted(replying(body))).url)
    chunks = await collect(backend.generate(PROMPT, greedy(4), "r"))
    assert [c.token_ids for c in chunks] == [[4], [5]]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].cached_tokens == 128
    body = sse_body(choice([4], "something_new"))
    chunks = await collect(backend_for((await scripted(replying(body))).url).generate(PROMPT, greedy(4), "n"))
    assert chunks[-1].finish_reason == "stop"


async def test_older_server_answers(backend_for: BackendFactory, scripted: Scripted) -> None:
    """vLLM 0.32 shapes: empty 200 bodies, `{"success": ...}` version updates, refused cache resets."""
    answers = {
        "/collective_rpc": (200, b'{"results":[null]}'),
        "/update_weight_version": (200, b'{"success":true,"new_version":"s7"}'),
        "/reset_prefix_cache": (200, b""),
        "/pause": (200, b'{"status":"paused"}'),
        "/resume": (200, b""),
    }
    server = await scripted(lambda r: Answer(*answers[r.path]))
    backend = backend_for(server.url)
    assert await backend.update_weights("s7", "/ckpt") is True
    await backend.resume()
    answers["/reset_prefix_cache"] = (200, b'{"success":false}')
    assert await backend.flush_cache() is False
    answers["/update_weight_version"] = (200, b'{"success":false,"message":"no"}')
    with pytest.raises(BackendError, match="update_weight_version"):
        await backend.update_weights("s8", None)
    answers["/pause"] = (400, b'{"error":"Invalid mode"}')
    with pytest.raises(BackendRejected):
        await backend.pause("keep")
    answers["/pause"] = (200, b'{"status":"something else"}')
    with pytest.raises(BackendProtocolError):
        await backend.pause("keep")


async def test_load_sums_label_sets_and_takes_the_fullest_kv_cache(
    backend_for: BackendFactory, scripted: Scripted
) -> None:
    metrics = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
vllm:num_requests_running_total_something{engine="0"} 100.0
vllm:num_requests_waiting{engine="0",model_name="a b"} 4.0
vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
"""
    backend = backend_for((await scripted(replying(metrics))).url)
    load = await backend.load()
    assert busy(load) == (5, 4)
    assert load.kv_usage == 0.5  # a share: the fullest engine's, not the sum
    assert await backend_for((await scripted(replying(b"# nothing\n"))).url).load() == Load()
    assert parse_gauges("", ["x"]) == {}


# ----------------------------------------------------------------------------------------------------------
# The echoed prompt (`return_token_ids` sends the prompt's ids back): cut out unparsed
# ----------------------------------------------------------------------------------------------------------

LONG_PROMPT = [(7 * i) % 1000 + 3 for i in range(600)]  # about 2,300 bytes of ids: above PROMPT_ECHO_MIN_BYTES


def test_a_long_echoed_prompt_is_cut_out_before_parsing() -> None:
    answer = {"id": "cmpl-1", "choices": [{"text": "x", "token_ids": [1, 2], "prompt_token_ids": LONG_PROMPT}]}
    encoded = orjson.dumps(answer)
    assert len(orjson.dumps(LONG_PROMPT)) >= PROMPT_ECHO_MIN_BYTES
    cut = without_prompt_echo(encoded)
    assert len(cut) < len(encoded) - PROMPT_ECHO_MIN_BYTES
    answer["choices"][0]["prompt_token_ids"] = None
    assert orjson.loads(cut) == answer
    # Whitespace after the colon (a server that indents its JSON), and the top-level key of `/inference/v1/generate`.
    spaced = b'{"prompt_token_ids": \n ' + orjson.dumps(LONG_PROMPT) + b', "choices": []}'
    assert orjson.loads(without_prompt_echo(spaced)) == {"prompt_token_ids": None, "choices": []}


def test_what_is_not_a_long_flat_echo_is_left_as_it_is() -> None:
    short = orjson.dumps({"choices": [{"token_ids": [1], "prompt_token_ids": PROMPT}]})
    nested = orjson.dumps({"prompt_token_ids": [LONG_PROMPT, LONG_PROMPT]})
    unterminated = b'{"prompt_token_ids":' + orjson.dumps(LONG_PROMPT)[:-1]
    for answer in (short, nested, unterminated, b'{"prompt_token_ids":null}', orjson.dumps({"token_ids": [1]})):
        assert without_prompt_echo(answer) == answer
    # The key inside a string is escaped there, so only the real key matches.
    text = '"prompt_token_ids":' + str(LONG_PROMPT)
    answer = {"choices": [{"text": text, "prompt_token_ids": LONG_PROMPT}]}
    assert orjson.loads(without_prompt_echo(orjson.dumps(answer))) == {
        "choices": [{"text": text, "prompt_token_ids": None}]
    }


async def test_long_prompts_stream_and_answer_whole_as_the_reference(
    make_sim: SimFactory, backend_for: BackendFactory
) -> None:
    """With the echoed prompt cut out of the whole answer and of the stream's first event, tokens, logprobs and
    versions are what the engine sent."""
    sim = await make_sim("vllm")
    backend = backend_for(sim)
    expected = reference_tokens(SHAPE, LONG_PROMPT, INIT, 12, ignore_eos=True)
    streamed = await collect(backend.generate(LONG_PROMPT, greedy(12), "long-s"))
    whole = (await collect(backend.generate(LONG_PROMPT, greedy(12), "long-w", stream=False)))[-1]
    assert tokens_of(streamed) == whole.token_ids == expected
    assert [lp for c in streamed for lp in c.logprobs] == whole.logprobs and len(whole.logprobs) == 12
    assert streamed[-1].version_spans == whole.version_spans == [VersionSpan("default", 0, 12)]


async def test_a_first_event_over_several_reads_is_cut_once_it_is_complete(
    backend_for: BackendFactory, scripted: Scripted
) -> None:
    huge = list(range(200_000))  # 1.3 MB of ids in the first event: more than one socket read
    body = sse_body(choice([1], prompt_token_ids=huge), choice([2]), choice([3], "length"))
    backend = backend_for((await scripted(replying(body))).url)
    chunks = await collect(backend.generate(PROMPT, greedy(3), "huge"))
    assert tokens_of(chunks) == [1, 2, 3] and [lp for c in chunks for lp in c.logprobs] == [-0.5] * 3
    whole = orjson.dumps({"choices": [{**choice([1, 2, 3], "length")["choices"][0], "prompt_token_ids": huge}]})
    answering_whole = backend_for((await scripted(replying(whole))).url)
    answer = (await collect(answering_whole.generate(PROMPT, greedy(3), "w", stream=False)))[-1]
    assert answer.token_ids == [1, 2, 3] and answer.finish_reason == "length"
