"""`backends.sglang.SglangBackend` against in-process SGLang-dialect simulator replicas over real HTTP.

The simulator enforces SGLang 0.5.23's strict `/generate` schema (any field it does not declare is a 400), so every
successful generation here also proves the adapter sends only accepted fields. A few stream shapes the simulator
never produces (a stream cut before the finish, aborts carrying an HTTP status) come from a scripted HTTP server.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from backends.base import (
    Chunk,
    EngineBackend,
    Load,
    ReplicaSpec,
    SamplingParams,
    StreamPacing,
    Timeouts,
    VersionSpan,
)
from backends.errors import (
    BackendError,
    BackendProtocolError,
    BackendRejected,
    BackendTimeout,
    BackendUnavailable,
    WeightsNotLoaded,
)
from backends.routed_experts import decode_int32_b64
from backends.sglang import SglangBackend
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from tests.conftest import SimFactory
from tests.scripted_server import Answer, Seen, scripted_server, sse_body
from tests.sim_helpers import gateway_transport, sim_state, wait_for

SHAPE = ModelShape()
V1 = ("init", "default")
V2 = ("w2", "v2")
PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
EXPERTS = (SHAPE.num_layers, SHAPE.top_k)

BackendFactory = Callable[..., SglangBackend]


def sg(**engine: Any) -> EngineSettings:
    """Engine settings for an SGLang replica: its radix cache is token-granular."""
    return EngineSettings(block_size=1, **engine)


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **({"ignore_eos": True} | kw))


@pytest.fixture
async def make_backend() -> AsyncIterator[BackendFactory]:
    """`make_backend(url, **spec_fields)`: a backend closed after the test."""
    backends: list[SglangBackend] = []

    def make(url: str, **spec: Any) -> SglangBackend:
        backend = SglangBackend(
            ReplicaSpec(id=f"sg{len(backends)}", url=url, **({"generation_transport": gateway_transport()} | spec))
        )
        backends.append(backend)
        return backend

    try:
        yield make
    finally:
        for backend in backends:
            await backend.aclose()


async def collect(backend: SglangBackend, prompt: list[int], sampling: SamplingParams, **kw: Any) -> list[Chunk]:
    rid = kw.pop("request_id", "r-1")
    async with contextlib.aclosing(backend.generate(prompt, sampling, rid, **kw)) as chunks:
        return [chunk async for chunk in chunks]


def tokens(chunks: list[Chunk]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


async def read_until(stream: AsyncIterator[Chunk], chunks: list[Chunk], count: int) -> None:
    """Read chunks until `count` tokens arrived (the request keeps running)."""
    async for chunk in stream:
        chunks.append(chunk)
        if len(tokens(chunks)) >= count:
            return
    raise AssertionError(f"the stream ended before {count} tokens")


async def engine_logprobs(http: httpx.AsyncClient, url: str, max_tokens: int, top: int) -> dict[str, Any]:
    """The replica's own non-streamed answer with logprobs (what the adapter's chunks must add up to)."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": top,
    }
    response = await http.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    meta: dict[str, Any] = response.json()["meta_info"]
    return meta


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- construction ----------------------------------------------------------------------------------------------


async def test_construction_and_capabilities(make_backend: BackendFactory) -> None:
    with pytest.raises(ValueError, match="routed_experts_shape"):
        SglangBackend(ReplicaSpec(id="x", url="http://127.0.0.1:1", routed_experts=True))
    backend = make_backend("http://127.0.0.1:1", routed_experts=True, routed_experts_shape=EXPERTS)
    assert isinstance(backend, EngineBackend) and "sg0" in repr(backend)
    caps = backend.capabilities
    assert caps.pause_modes == {"abort", "keep"} and caps.version_spans
    assert caps.routed_experts_out and not caps.routed_experts_in and caps.streams_routed_experts
    assert caps.token_endpoint == "/generate" and caps.new_requests_while_paused == "block"
    assert make_backend("http://127.0.0.1:1", routed_experts_input=True).capabilities.routed_experts_in
    with pytest.raises(ValueError, match="wait"):
        await backend.pause("wait")


# -- generation ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_stream_matches_reference_with_aligned_logprobs(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient, incremental: bool
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.001), incremental_streaming_output=incremental)
    backend = make_backend(sim.url)
    chunks = await collect(backend, PROMPT, greedy(24, top_logprobs=2))
    assert len(chunks) > 2  # really streamed, several chunks turned into deltas
    assert tokens(chunks) == reference_tokens(SHAPE, PROMPT, V1, 24, ignore_eos=True)
    meta = await engine_logprobs(http, sim.url, 24, 2)
    assert [lp for chunk in chunks for lp in chunk.logprobs] == [lp for lp, _, _ in meta["output_token_logprobs"]]
    top = [entry for chunk in chunks for entry in chunk.top_logprobs or []]
    assert top == [[(t, lp) for lp, t, _ in position] for position in meta["output_top_logprobs"]]
    assert all(len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs or []) > 0 for c in chunks[:-1])
    assert all(c.finish_reason is None for c in chunks[:-1])
    final = chunks[-1]
    assert (final.finish_reason, final.stop_reason) == ("length", None)
    assert final.version_spans == [VersionSpan("default", 0, 24)] and final.weight_version == "default"
    assert final.cached_tokens == 0
    assert final.routed_experts is None


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_paced_reads_of_a_stream_add_up_to_the_engines_answer(
    make_sim: SimFactory,
    make_backend: BackendFactory,
    http: httpx.AsyncClient,
    incremental: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Several events to a read (paced reads): a cumulative stream, decoded one event a read once it shows itself,
    still adds up to the engine's answer, ids and logprobs (top ones too); the replica is flagged, and a warning
    logged once for it. A stream of deltas is decoded whole, and nothing is flagged."""
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002), incremental_streaming_output=incremental)
    backend = make_backend(sim.url, stream_pacing=StreamPacing(0.05, 1))
    meta = await engine_logprobs(http, sim.url, 64, 2)
    with caplog.at_level(logging.WARNING, logger="backends.sglang"):
        for request_id in ("first", "second"):
            chunks = await collect(backend, PROMPT, greedy(64, top_logprobs=2), request_id=request_id)
            assert tokens(chunks) == reference_tokens(SHAPE, PROMPT, V1, 64, ignore_eos=True)
            assert [lp for chunk in chunks for lp in chunk.logprobs] == [
                lp for lp, _, _ in meta["output_token_logprobs"]
            ]
            top = [entry for chunk in chunks for entry in chunk.top_logprobs or []]
            assert top == [[(t, lp) for lp, t, _ in position] for position in meta["output_top_logprobs"]]
            assert len(chunks) < 32  # several events to a read
    assert backend.cumulative_streams is not incremental
    assert sum("cumulative events" in record.getMessage() for record in caplog.records) == (0 if incremental else 1)


async def test_stop_eos_min_tokens_and_seed(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    sim = await make_sim("sglang", engine=sg())
    backend = make_backend(sim.url)
    ref = reference_tokens(SHAPE, PROMPT, V1, 16, ignore_eos=True)
    stop = ref[5]
    assert stop not in ref[:5]
    chunks = await collect(backend, PROMPT, greedy(16, stop_token_ids=(stop,)))
    assert tokens(chunks) == ref[:6]
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("stop", stop)

    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, top_k=50, top_p=0.9)
    expected = reference_tokens(SHAPE, PROMPT, V1, 12, seed=7, temperature=1.0, ignore_eos=True)
    assert tokens(await collect(backend, PROMPT, seeded)) == expected

    eos_shape = ModelShape(eos_prob=0.5)
    eos_backend = make_backend((await make_sim("sglang", engine=sg(shape=eos_shape))).url)
    chunks = await collect(eos_backend, PROMPT, SamplingParams(max_tokens=64, temperature=0.0))
    assert tokens(chunks) == reference_tokens(eos_shape, PROMPT, V1, 64)
    assert (chunks[-1].finish_reason, chunks[-1].stop_reason) == ("stop", eos_shape.eos_token_id)
    at_least = SamplingParams(max_tokens=64, temperature=0.0, min_tokens=6)
    out = tokens(await collect(eos_backend, PROMPT, at_least))
    assert len(out) >= 6 and out == reference_tokens(eos_shape, PROMPT, V1, 64, min_tokens=6)


async def test_every_optional_field_is_accepted(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    """All optional fields at once against the strict schema (with routing replay on): no 400."""
    sim = await make_sim("sglang", engine=sg(routed_experts_output=True, routed_experts_input=True))
    backend = make_backend(sim.url, routed_experts=True, routed_experts_shape=EXPERTS, routed_experts_input=True)
    sampling = SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.5, top_k=4, seed=3, stop_token_ids=(9999,), min_tokens=2, top_logprobs=3
    )
    replay = np.zeros((3, *EXPERTS), dtype=np.uint8)
    chunks = await collect(backend, PROMPT, sampling, routed_experts=replay, experts_start=2)
    assert tokens(chunks) == reference_tokens(SHAPE, PROMPT, V1, 10, seed=3, temperature=1.0, min_tokens=2)
    assert chunks[-1].routed_experts is not None


async def test_consumer_closing_early_aborts_the_request(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url)
    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(300), "early")) as stream:
        await read_until(stream, received, 2)
    await wait_for(lambda: _state_is(http, sim.url, running=0, waiting=0), what="the engine to drop the request")
    assert (await sim_state(http, sim.url))["counters"]["aborted"] == 1


async def test_load_counts_a_running_request(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url)
    assert busy(await backend.load()) == (0, 0)
    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(300), "busy")) as stream:
        await read_until(stream, received, 2)
        assert busy(await backend.load()) == (1, 0)
        await backend.abort("busy")
        received.extend([chunk async for chunk in stream])
    assert received[-1].finish_reason == "abort"
    assert busy(await backend.load()) == (0, 0)
    # The prefix cache's counters (sglang:{prompt,cached}_tokens_total): the prompt was looked up once.
    load = await backend.load()
    assert load.prefix_cache_queries == len(PROMPT) and load.prefix_cache_hits == 0


def busy(load: Load) -> tuple[int | None, int | None]:
    return load.running, load.waiting


# -- abort and pause -------------------------------------------------------------------------------------------


async def test_abort_mid_stream_returns_partial_prefix(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url)
    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(300), "victim")) as stream:
        await read_until(stream, received, 3)
        await backend.abort("victim")
        received.extend([chunk async for chunk in stream])
    partial = tokens(received)
    assert received[-1].finish_reason == "abort" and received[-1].stop_reason is None
    assert (
        3 <= len(partial) < 300 and partial == reference_tokens(SHAPE, PROMPT, V1, 300, ignore_eos=True)[: len(partial)]
    )
    assert received[-1].version_spans == [VersionSpan("default", 0, len(partial))]


async def test_pause_abort_holds_new_requests_until_resume(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url)
    ref = reference_tokens(SHAPE, PROMPT, V1, 200, ignore_eos=True)
    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(200), "p")) as stream:
        await read_until(stream, received, 5)
        await backend.pause("abort")
        received.extend([chunk async for chunk in stream])
    partial = tokens(received)
    assert received[-1].finish_reason == "abort" and 5 <= len(partial) < 200 and partial == ref[: len(partial)]
    assert (await sim_state(http, sim.url))["pause_mode"] == "abort"

    held = asyncio.create_task(collect(backend, PROMPT + partial, greedy(200 - len(partial)), request_id="p-1"))
    await wait_for(lambda: _state_is(http, sim.url, held=1), what="the continuation to be held while paused")
    assert not held.done()
    await backend.resume()
    rest = await held
    assert partial + tokens(rest) == ref and rest[-1].finish_reason == "length"


@pytest.mark.parametrize("keep_mode", ["retract", "in_place"])
async def test_pause_keep_freezes_and_resumes(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient, keep_mode: str
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url, keep_mode=keep_mode)
    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(100), "k")) as stream:
        await read_until(stream, received, 5)
        await backend.pause("keep")
        state = await sim_state(http, sim.url)
        assert (state["paused"], state["pause_mode"]) == (True, keep_mode)
        await backend.resume()
        received.extend([chunk async for chunk in stream])
    assert tokens(received) == reference_tokens(SHAPE, PROMPT, V1, 100, ignore_eos=True)
    assert received[-1].finish_reason == "length"


# -- weights ---------------------------------------------------------------------------------------------------


async def test_update_weights_from_disk_changes_outputs(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    sim = await make_sim("sglang", engine=sg())
    backend = make_backend(sim.url)
    assert await backend.weight_version() == "default"
    before = tokens(await collect(backend, PROMPT, greedy(12)))
    assert await backend.update_weights("v2", "w2") is True
    assert await backend.weight_version() == "v2"
    after = await collect(backend, PROMPT, greedy(12))
    assert tokens(after) == reference_tokens(SHAPE, PROMPT, V2, 12, ignore_eos=True) != before
    assert after[-1].weight_version == "v2" and after[-1].cached_tokens == 0  # the update flushed the cache


async def test_a_load_sglang_refuses_is_weights_not_loaded(
    make_sim: SimFactory, make_backend: BackendFactory, tmp_path: Path
) -> None:
    """SGLang answers a failed `/update_weights_from_disk` with 400 `success: false` and keeps (or rolls back to)
    its weights and label: `WeightsNotLoaded`, with the engine's message."""
    sim = await make_sim("sglang", engine=sg(), weights_must_exist=True)
    backend = make_backend(sim.url)
    with pytest.raises(WeightsNotLoaded, match="Failed to get weights iterator") as failed:
        await backend.update_weights("v2", str(tmp_path / "missing"))
    assert failed.value.code == "400"
    assert await backend.weight_version() == "default" and sim.engine.weights == "init"
    assert await backend.update_weights("v2", str(tmp_path)) is True
    assert await backend.weight_version() == "v2"


@pytest.mark.parametrize(("keep_mode", "clean"), [("retract", True), ("in_place", False)])
async def test_update_while_paused_keep(
    make_sim: SimFactory, make_backend: BackendFactory, keep_mode: str, clean: bool
) -> None:
    """retract: the frozen request holds no KV, the flush succeeds. in_place: SGLang answers 400 yet switched
    weights and version; the adapter reports a stale cache (False) instead of failing, and the cache can be flushed
    once the request has finished."""
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url, keep_mode=keep_mode)
    budget = 120
    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(budget), "u")) as stream:
        await read_until(stream, received, 5)
        await backend.pause("keep")
        assert await backend.update_weights("v2", "w2") is clean
        assert await backend.weight_version() == "v2"
        assert await backend.flush_cache() is clean
        await backend.resume()
        received.extend([chunk async for chunk in stream])
    final = received[-1]
    assert final.finish_reason == "length" and final.version_spans is not None
    k = final.version_spans[0].end
    assert final.version_spans == [VersionSpan("default", 0, k), VersionSpan("v2", k, budget)]
    assert final.weight_version == "v2"
    assert tokens(received) == reference_tokens(SHAPE, PROMPT, [V1] * k + [V2] * (budget - k), budget, ignore_eos=True)
    assert await backend.flush_cache() is True  # nothing holds KV any more
    assert tokens(await collect(backend, PROMPT, greedy(8))) == reference_tokens(SHAPE, PROMPT, V2, 8, ignore_eos=True)


async def test_out_of_band_update_sets_the_label(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    backend = make_backend(sim.url)
    assert await backend.update_weights("v3", None) is True
    assert await backend.weight_version() == "v3"
    assert tokens(await collect(backend, PROMPT, greedy(8))) == reference_tokens(
        SHAPE, PROMPT, ("init", "v3"), 8, ignore_eos=True
    )

    received: list[Chunk] = []
    async with contextlib.aclosing(backend.generate(PROMPT, greedy(200), "oob")) as stream:
        await read_until(stream, received, 3)
        assert await backend.update_weights("v4", None) is False  # relabelled; the running request blocks the flush
        assert await backend.weight_version() == "v4"
        received.extend([chunk async for chunk in stream])
    final = received[-1]
    assert final.finish_reason == "length"  # in-flight requests are not aborted
    assert final.version_spans is not None and [s.version for s in final.version_spans] == ["v3", "v4"]
    assert await backend.flush_cache() is True


# -- routed experts --------------------------------------------------------------------------------------------


async def test_routed_experts_shape_start_and_no_replay(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang", engine=sg(routed_experts_output=True))
    backend = make_backend(sim.url, routed_experts=True, routed_experts_shape=EXPERTS)
    chunks = await collect(backend, PROMPT, greedy(6))
    experts = chunks[-1].routed_experts
    assert experts is not None and experts.shape == (len(PROMPT) + 6 - 1, *EXPERTS) and experts.dtype == np.uint8
    assert all(chunk.routed_experts is None for chunk in chunks[:-1])
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    direct = (await http.post(f"{sim.url}/generate", json=body | {"return_routed_experts": True})).json()
    np.testing.assert_array_equal(experts, decode_int32_b64(direct["meta_info"]["routed_experts"], *EXPERTS))

    tail = (await collect(backend, PROMPT, greedy(6), experts_start=len(PROMPT)))[-1].routed_experts
    assert tail is not None and tail.shape == (6 - 1, *EXPERTS)
    np.testing.assert_array_equal(tail, experts[len(PROMPT) :])

    # routed_experts_input is off: the replay field is not sent (this replica would reject it as unknown).
    replayed = await collect(backend, PROMPT, greedy(6), routed_experts=experts[:4])
    np.testing.assert_array_equal(replayed[-1].routed_experts, experts)

    plain = make_backend(sim.url)  # R3 off in the spec: nothing asked, nothing decoded
    assert (await collect(plain, PROMPT, greedy(6)))[-1].routed_experts is None

    wrong = make_backend(sim.url, routed_experts=True, routed_experts_shape=(1, SHAPE.top_k))
    with pytest.raises(BackendProtocolError, match="routed experts cover"):
        await collect(wrong, PROMPT, greedy(6))


async def test_routed_experts_replay_is_sent_when_enabled(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    sim = await make_sim("sglang", engine=sg(routed_experts_output=True, routed_experts_input=True))
    backend = make_backend(sim.url, routed_experts=True, routed_experts_shape=EXPERTS, routed_experts_input=True)
    base = (await collect(backend, PROMPT, greedy(4)))[-1].routed_experts
    assert base is not None
    given = ((base[: len(PROMPT)].astype(np.int32) + 1) % SHAPE.num_experts).astype(np.uint8)
    replayed = (await collect(backend, PROMPT, greedy(4), routed_experts=given))[-1].routed_experts
    assert replayed is not None
    np.testing.assert_array_equal(replayed[: len(PROMPT)], given)
    np.testing.assert_array_equal(replayed[len(PROMPT) :], base[len(PROMPT) :])


# -- failures --------------------------------------------------------------------------------------------------


async def test_engine_errors_are_translated(
    make_sim: SimFactory, make_backend: BackendFactory, http: httpx.AsyncClient
) -> None:
    failing = make_backend((await make_sim("sglang", engine=sg(), error_rate=1.0)).url)
    with pytest.raises(BackendError) as error:
        await collect(failing, PROMPT, greedy())
    assert type(error.value) is BackendError and error.value.code == "500"

    sim = await make_sim("sglang", engine=sg())
    backend = make_backend(sim.url)
    with pytest.raises(BackendRejected, match="out of vocabulary"):
        await collect(backend, [SHAPE.vocab_size + 5], greedy())
    assert await backend.health() is True

    hung = make_backend(sim.url, timeouts=Timeouts(read=0.2, control=0.2, health=0.2))
    await http.post(f"{sim.url}/sim/faults", json={"hang": True})
    try:
        with pytest.raises(BackendTimeout):
            await collect(hung, PROMPT, greedy())
        assert await hung.health() is False
    finally:
        await http.post(f"{sim.url}/sim/faults", json={"hang": False})


async def test_a_whole_answer_is_bounded_by_whole_answer_not_by_the_read_gap(
    make_sim: SimFactory, make_backend: BackendFactory
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.02))
    patient = make_backend(sim.url, timeouts=Timeouts(read=0.1, whole_answer=30.0))
    whole = await collect(patient, PROMPT, greedy(20), stream=False)  # 0.4 s before its answer
    assert len(whole) == 1 and len(tokens(whole)) == 20
    hasty = make_backend(sim.url, timeouts=Timeouts(read=30.0, whole_answer=0.1))
    with pytest.raises(BackendTimeout):
        await collect(hasty, PROMPT, greedy(20), stream=False)


async def test_unreachable_and_closed_backends(make_sim: SimFactory, make_backend: BackendFactory) -> None:
    down = make_backend(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(BackendUnavailable):
        await collect(down, PROMPT, greedy())
    with pytest.raises(BackendUnavailable):
        await down.weight_version()
    assert await down.health() is False

    backend = make_backend((await make_sim("sglang", engine=sg())).url)
    assert await backend.health() is True
    await backend.aclose()
    assert await backend.health() is False
    with pytest.raises(BackendUnavailable, match="closed"):
        await collect(backend, PROMPT, greedy())
    with pytest.raises(BackendUnavailable, match="closed"):
        await backend.update_weights("v2", "w2")


# -- stream shapes the simulator does not produce (scripted server) --------------------------------------------


def event(ids: list[int], total: int, finish: Any = None, logprobs: list[int] | None = None) -> dict[str, Any]:
    listed = ids if logprobs is None else logprobs
    meta = {"completion_tokens": total, "finish_reason": finish, "weight_version": "v1"}
    meta["output_token_logprobs"] = [[-0.5, t, None] for t in listed]
    return {"output_ids": ids, "meta_info": meta}


async def test_scripted_stream_shapes(make_backend: BackendFactory) -> None:
    async with contextlib.AsyncExitStack() as stack:

        async def backend(*events: Any, done: bool = True) -> SglangBackend:
            body = sse_body(*events, done=done)
            server = await stack.enter_async_context(scripted_server(lambda _: Answer(200, body, "text/event-stream")))
            return make_backend(server.url)

        cut = await backend(event([7, 8], 2), done=True)
        with pytest.raises(BackendUnavailable, match="before the request finished"):
            await collect(cut, PROMPT, greedy())

        # Delta ids with cumulative logprobs: each side is aligned on its own.
        mixed = await backend(event([7, 8], 2), event([9], 3, {"type": "length", "length": 3}, logprobs=[7, 8, 9]))
        chunks = await collect(mixed, PROMPT, greedy())
        assert [t for c in chunks for t in c.token_ids] == [7, 8, 9] and chunks[-1].finish_reason == "length"
        assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]

        server_abort = {"type": "abort", "message": "out of memory", "status_code": 503, "err_type": None}
        chunks = await collect(await backend(event([7], 1, server_abort)), PROMPT, greedy())
        assert chunks[-1].finish_reason == "abort" and chunks[-1].token_ids == [7]

        too_long = {"type": "abort", "message": "input is too long", "status_code": 400, "err_type": "BadRequestError"}
        with pytest.raises(BackendRejected, match="too long"):
            await collect(await backend(event([], 0, too_long)), PROMPT, greedy())

        with pytest.raises(BackendProtocolError, match="differ"):
            await collect(await backend(event([7], 1, logprobs=[8])), PROMPT, greedy())
        with pytest.raises(BackendError, match="boom"):
            await collect(await backend({"error": {"message": "boom"}}), PROMPT, greedy())


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("kind", [list, tuple, range, "array"])
async def test_a_prompt_is_encoded_when_the_request_is_built(
    make_backend: BackendFactory, kind: Any, stream: bool
) -> None:
    """Any sequence of ids makes the body's `input_ids`, encoded as the request is built: a list passed uncopied
    (a first segment's prompt) may change afterwards without changing what the engine gets."""
    finished = event([9], 1, {"type": "length", "length": 1})

    def answer(seen: Seen) -> Answer:
        if seen.json().get("stream"):
            return Answer(200, sse_body(finished), "text/event-stream")
        return Answer(200, orjson.dumps(finished))

    async with scripted_server(answer) as server:
        backend = make_backend(server.url)
        ids = [5, 6, 7]
        prompt = array.array("q", ids) if kind == "array" else range(5, 8) if kind is range else kind(ids)
        request = backend.generate(prompt, greedy(1), "rq", stream=stream)
        ids.append(8)  # the caller's list changes before the request is sent
        async with contextlib.aclosing(request) as chunks:
            assert [t async for chunk in chunks for t in chunk.token_ids] == [9]
        assert server.seen[0].json()["input_ids"] == [5, 6, 7]


async def _state_is(http: httpx.AsyncClient, url: str, **expected: Any) -> bool:
    state = await sim_state(http, url)
    return all(state[key] == value for key, value in expected.items())
