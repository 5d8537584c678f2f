"""The simulator's SGLang dialect against ../shared/contracts (SGLang 0.5.23: field names, status codes, encodings,
pause modes, weight updates), over real HTTP to an in-process replica."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from backends.routed_experts import decode_int32_b64, encode_int32_b64
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from gateway.assets import TINY_TOKENIZER_DIR
from tests.conftest import SimFactory
from tests.sim_helpers import sim_state, sse_events, wait_for

SHAPE = ModelShape()
V1 = ("init", "default")
V2 = ("w2", "v2")
PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "weight_version",
    "num_retractions",
    "e2e_latency",
}


def sg(**engine: Any) -> EngineSettings:
    """Engine settings for an SGLang replica: its radix cache is token-granular."""
    return EngineSettings(block_size=1, **engine)


def gen(
    prompt: list[Any] = PROMPT, max_new_tokens: int = 8, sampling: dict[str, Any] | None = None, **extra: Any
) -> dict[str, Any]:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True} | (sampling or {})
    return {"input_ids": prompt, "sampling_params": params} | extra


async def generate(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(f"{url}/generate", json=body)
    assert response.status_code == 200, response.text
    out: dict[str, Any] = response.json()
    return out


async def post(http: httpx.AsyncClient, url: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return await http.post(f"{url}{path}", json=body if body is not None else {})


async def read_until(events: AsyncIterator[Any], chunks: list[Any], tokens: int) -> None:
    """Read stream chunks until the cumulative output has `tokens` tokens (the request keeps running)."""
    async for chunk in events:
        chunks.append(chunk)
        if len(chunk["output_ids"]) >= tokens:
            return
    raise AssertionError(f"the stream ended before {tokens} tokens")


async def state_is(http: httpx.AsyncClient, url: str, **expected: Any) -> bool:
    state = await sim_state(http, url)
    return all(state[key] == value for key, value in expected.items())


async def generated(http: httpx.AsyncClient, url: str) -> int:
    return int((await sim_state(http, url))["counters"].get("generation_tokens", 0))


async def assert_blocked(task: asyncio.Task[Any], seconds: float = 0.1) -> None:
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), seconds)


# -- /generate -------------------------------------------------------------------------------------------------


async def test_generate_non_stream_fields(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg())
    body = gen(rid="r-1", return_logprob=True, top_logprobs_num=2, return_prompt_token_ids=True)
    out = await generate(http, sim.url, body)
    assert set(out) == {"text", "output_ids", "meta_info", "prompt_token_ids"}
    assert out["output_ids"] == reference_tokens(SHAPE, PROMPT, V1, 8, ignore_eos=True)
    assert out["prompt_token_ids"] == PROMPT and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert META_KEYS | {"weight_versions", "output_token_logprobs", "output_token_logprobs_length"} <= set(meta)
    assert "routed_experts" not in meta  # not asked, and the server flag is off
    assert meta["id"] == "r-1"
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (8, 8, 0)
    assert meta["weight_version"] == "default" and meta["num_retractions"] == 0
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 8}]
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] >= 0
    logprobs = meta["output_token_logprobs"]
    assert meta["output_token_logprobs_length"] == 8
    assert [t for _, t, _ in logprobs] == out["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in logprobs)
    top = meta["output_top_logprobs"]
    assert len(top) == 8 and all(len(entries) == 2 for entries in top)
    assert all(
        entries[0][:2] == entry[:2] and entries[1][0] <= entries[0][0]
        for entries, entry in zip(top, logprobs, strict=True)
    )

    plain = (await generate(http, sim.url, gen()))["meta_info"]
    assert "output_token_logprobs" not in plain and "prompt_token_ids" not in plain
    assert plain["id"] and plain["id"] != "r-1"  # a fresh random rid
    put = await http.put(f"{sim.url}/generate", json=gen())
    assert put.status_code == 200 and put.json()["output_ids"] == out["output_ids"]


async def test_text_prompt_needs_a_tokenizer(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    bare = await make_sim("sglang", engine=sg())
    refused = await http.post(f"{bare.url}/generate", json={"text": "hello world"})
    assert refused.status_code == 400 and "tokenizer" in refused.json()["error"]["message"]

    sim = await make_sim("sglang", engine=sg(), tokenizer_path=str(TINY_TOKENIZER_DIR))
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    out = await generate(http, sim.url, body | {"return_prompt_token_ids": True, "return_logprob": True})
    assert out["meta_info"]["prompt_tokens"] == len(out["prompt_token_ids"]) > 0
    assert out["text"] and all(text is None for _, _, text in out["meta_info"]["output_token_logprobs"])
    texts = await generate(http, sim.url, body | {"return_logprob": True, "return_text_in_logprobs": True})
    pieces = [text for _, _, text in texts["meta_info"]["output_token_logprobs"]]
    assert all(isinstance(p, str) for p in pieces) and "".join(pieces) == texts["text"]


BAD_REQUESTS: list[tuple[dict[str, Any], str]] = [
    (gen(foo=1), "unknown field `foo`, expected one of `rid`"),
    (gen(sampling={"max_tokens": 4}), "unknown field `max_tokens` in `sampling_params`"),
    (gen(replay_routed_experts=""), "unknown field `replay_routed_experts`"),  # flag off: not a field
    (gen(routed_experts_start_len=9, return_routed_experts=True), "routed_experts_start_len"),
    (gen(routed_experts_start_len=-1), "routed_experts_start_len"),
    (gen(sampling={"n": 2}), "n=1"),
    (gen(prompt=[]), "at least one token"),
    (gen(prompt=[[1, 2], [3, 4]]), "one prompt per request"),
    ({"sampling_params": {}}, "Either text, input_ids"),
    (gen(input_ids=[SHAPE.vocab_size]), "out of vocabulary"),
    (gen(max_new_tokens=5000), "maximum context length"),
    (gen(rid=["a", "b"]), "rid must be a string"),
    (gen(max_new_tokens=2, return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
]


async def test_bad_requests_are_400(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(routed_experts_output=True))
    for body, needle in BAD_REQUESTS:
        response = await http.post(f"{sim.url}/generate", json=body)
        assert response.status_code == 400, body
        assert needle in response.json()["error"]["message"], (body, response.text)
    not_json = await http.post(f"{sim.url}/generate", content=b"{oops", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    assert (await sim_state(http, sim.url))["counters"].get("prompt_tokens", 0) == 0  # nothing reached the engine


async def test_stream_chunks_are_cumulative(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    body = gen(max_new_tokens=24, return_logprob=True)
    expected = await generate(http, sim.url, body)
    lines: list[str] = []
    async with http.stream("POST", f"{sim.url}/generate", json=body | {"stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [orjson.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert len(chunks) > 2
    for previous, chunk in itertools.pairwise(chunks):
        assert chunk["output_ids"][: len(previous["output_ids"])] == previous["output_ids"]
        assert len(chunk["output_ids"]) > len(previous["output_ids"])
    for chunk in chunks:
        meta = chunk["meta_info"]
        assert meta["completion_tokens"] == len(chunk["output_ids"]) == len(meta["output_token_logprobs"])
        assert [t for _, t, _ in meta["output_token_logprobs"]] == chunk["output_ids"]
        assert meta["weight_version"] == "default"
    assert all(c["meta_info"]["finish_reason"] is None and "weight_versions" not in c["meta_info"] for c in chunks[:-1])
    final = chunks[-1]
    assert final["output_ids"] == expected["output_ids"]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert final["meta_info"]["weight_versions"] == expected["meta_info"]["weight_versions"]
    assert final["meta_info"]["output_token_logprobs"] == expected["meta_info"]["output_token_logprobs"]


async def test_incremental_streaming_output(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002), incremental_streaming_output=True)
    body = gen(max_new_tokens=24, return_logprob=True)
    expected = (await generate(http, sim.url, body))["output_ids"]
    async with http.stream("POST", f"{sim.url}/generate", json=body | {"stream": True}) as response:
        chunks = [chunk async for chunk in sse_events(response)]
    assert len(chunks) > 2
    assert [t for c in chunks for t in c["output_ids"]] == expected
    assert [t for c in chunks for _, t, _ in c["meta_info"]["output_token_logprobs"]] == expected
    assert [c["meta_info"]["completion_tokens"] for c in chunks] == list(
        itertools.accumulate(len(c["output_ids"]) for c in chunks)
    )


async def test_finish_reasons(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg())
    ref = reference_tokens(SHAPE, PROMPT, V1, 16, ignore_eos=True)
    stop = ref[5]
    assert stop not in ref[:5]
    out = await generate(http, sim.url, gen(max_new_tokens=16, sampling={"stop_token_ids": [stop]}))
    assert out["output_ids"] == ref[:6]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    eos_shape = ModelShape(eos_prob=0.5)
    eos_sim = await make_sim("sglang", engine=sg(shape=eos_shape))
    out = await generate(http, eos_sim.url, gen(max_new_tokens=64, sampling={"ignore_eos": False}))
    assert out["output_ids"] == reference_tokens(eos_shape, PROMPT, V1, 64)
    assert out["output_ids"][-1] == eos_shape.eos_token_id
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos_shape.eos_token_id}


async def test_sampling_seed(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg())
    seeded = gen(max_new_tokens=12, sampling={"temperature": 1.0, "sampling_seed": 7})
    first = (await generate(http, sim.url, seeded))["output_ids"]
    assert (await generate(http, sim.url, seeded))["output_ids"] == first
    other = gen(max_new_tokens=12, sampling={"temperature": 1.0, "sampling_seed": 8})
    assert (await generate(http, sim.url, other))["output_ids"] != first
    assert first == reference_tokens(SHAPE, PROMPT, V1, 12, seed=7, temperature=1.0, ignore_eos=True)


# -- routed experts --------------------------------------------------------------------------------------------


async def test_routed_experts_raw_int32(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(routed_experts_output=True))
    out = await generate(http, sim.url, gen(max_new_tokens=6, return_routed_experts=True))
    experts = decode_int32_b64(out["meta_info"]["routed_experts"], SHAPE.num_layers, SHAPE.top_k)
    assert experts.shape == (len(PROMPT) + 6 - 1, SHAPE.num_layers, SHAPE.top_k)
    assert int(experts.max()) < SHAPE.num_experts
    assert all(len(set(row)) == SHAPE.top_k for row in experts.reshape(-1, SHAPE.top_k).tolist())

    start = len(PROMPT)
    tail = await generate(
        http, sim.url, gen(max_new_tokens=6, return_routed_experts=True, routed_experts_start_len=start)
    )
    tail_experts = decode_int32_b64(tail["meta_info"]["routed_experts"], SHAPE.num_layers, SHAPE.top_k)
    assert tail["meta_info"]["cached_tokens"] > 0  # same count on a prefix-cache hit, like the real server
    np.testing.assert_array_equal(tail_experts, experts[start:])

    assert "routed_experts" not in (await generate(http, sim.url, gen()))["meta_info"]
    async with http.stream("POST", f"{sim.url}/generate", json=gen(return_routed_experts=True, stream=True)) as r:
        chunks = [chunk async for chunk in sse_events(r)]
    assert "routed_experts" in chunks[-1]["meta_info"]
    assert all("routed_experts" not in c["meta_info"] for c in chunks[:-1])

    off = await make_sim("sglang", engine=sg())
    assert "routed_experts" not in (await generate(http, off.url, gen(return_routed_experts=True)))["meta_info"]


async def test_routed_experts_replay(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(routed_experts_output=True, routed_experts_input=True))
    base = await generate(http, sim.url, gen(max_new_tokens=4, return_routed_experts=True))
    experts = decode_int32_b64(base["meta_info"]["routed_experts"], SHAPE.num_layers, SHAPE.top_k)
    given = (experts[: len(PROMPT)].astype(np.int32) + 1) % SHAPE.num_experts
    body = gen(max_new_tokens=4, return_routed_experts=True, replay_routed_experts=encode_int32_b64(given))
    replayed = await generate(http, sim.url, body)
    got = decode_int32_b64(replayed["meta_info"]["routed_experts"], SHAPE.num_layers, SHAPE.top_k)
    np.testing.assert_array_equal(got[: len(PROMPT)], given)
    np.testing.assert_array_equal(got[len(PROMPT) :], experts[len(PROMPT) :])
    assert replayed["output_ids"] == base["output_ids"]  # replay changes routing, not the sampled tokens

    bad = await http.post(f"{sim.url}/generate", json=gen(replay_routed_experts="AAAA"))
    assert bad.status_code == 400 and "replay_routed_experts" in bad.json()["error"]["message"]


# -- pause / continue ------------------------------------------------------------------------------------------


async def test_pause_abort_partial_output_and_exact_continuation(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    budget = 200
    ref = reference_tokens(SHAPE, PROMPT, V1, budget, ignore_eos=True)
    other = [9, 8, 7, 6, 5, 4, 3]
    plain = asyncio.create_task(generate(http, sim.url, gen(prompt=other, max_new_tokens=budget)))
    chunks: list[Any] = []
    async with http.stream("POST", f"{sim.url}/generate", json=gen(max_new_tokens=budget, stream=True)) as response:
        events = sse_events(response)
        await read_until(events, chunks, 5)
        paused = await post(http, sim.url, "/pause_generation", {"mode": "abort"})
        assert paused.status_code == 200
        assert paused.json() == {"message": "Generation paused successfully.", "status": "ok"}
        chunks.extend([chunk async for chunk in events])
    final = chunks[-1]
    partial = final["output_ids"]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert final["meta_info"]["finish_reason"]["message"]
    assert 5 <= len(partial) < budget and partial == ref[: len(partial)]
    assert final["meta_info"]["completion_tokens"] == len(partial)
    aborted = await plain  # non-stream: HTTP 200 with the partial output
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < budget

    assert (await http.get(f"{sim.url}/ready")).status_code == 503
    blocked = asyncio.create_task(generate(http, sim.url, gen(prompt=[11, 12, 13])))
    await wait_for(lambda: state_is(http, sim.url, held=1), what="the new request to be held")
    await assert_blocked(blocked)
    assert (await http.post(f"{sim.url}/continue_generation")).json() == {"status": "ok"}  # the body is optional
    assert (await http.get(f"{sim.url}/ready")).status_code == 200
    assert (await blocked)["meta_info"]["finish_reason"] == {"type": "length", "length": 8}

    continuation = gen(prompt=PROMPT + partial, max_new_tokens=budget - len(partial))
    rest = await generate(http, sim.url, continuation)
    assert partial + rest["output_ids"] == ref
    assert rest["meta_info"]["cached_tokens"] >= len(PROMPT)  # the aborted request's KV stayed in the radix cache


@pytest.mark.parametrize(("mode", "retractions"), [("retract", 1), ("in_place", 0)])
async def test_pause_freezes_in_flight_and_holds_new_requests(
    make_sim: SimFactory, http: httpx.AsyncClient, mode: str, retractions: int
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    budget = 150
    chunks: list[Any] = []
    async with http.stream("POST", f"{sim.url}/generate", json=gen(max_new_tokens=budget, stream=True)) as response:
        events = sse_events(response)
        await read_until(events, chunks, 5)
        assert (await post(http, sim.url, "/pause_generation", {"mode": mode})).status_code == 200
        if mode == "retract":
            assert await state_is(http, sim.url, paused=True, running=0, waiting=1)
            assert 'sglang:num_retracted_reqs{model_name="tiny"} 1.0' in (await http.get(f"{sim.url}/metrics")).text
        else:
            assert await state_is(http, sim.url, paused=True, running=1, waiting=0)
        frozen_at = await generated(http, sim.url)
        blocked = asyncio.create_task(generate(http, sim.url, gen(prompt=[11, 12, 13])))
        await wait_for(lambda: state_is(http, sim.url, held=1), what="the new request to be held")
        await assert_blocked(blocked)
        assert await generated(http, sim.url) == frozen_at  # nothing decodes while paused
        assert (await http.get(f"{sim.url}/ready")).status_code == 503
        resumed = await post(http, sim.url, "/continue_generation", {"torch_empty_cache": True})
        assert resumed.status_code == 200 and resumed.json()["status"] == "ok"
        chunks.extend([chunk async for chunk in events])
    final = chunks[-1]
    assert final["output_ids"] == reference_tokens(SHAPE, PROMPT, V1, budget, ignore_eos=True)
    assert final["meta_info"]["finish_reason"] == {"type": "length", "length": budget}
    assert final["meta_info"]["num_retractions"] == retractions
    assert (await blocked)["meta_info"]["finish_reason"]["type"] == "length"


# -- weights ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["retract", "in_place"])
async def test_weight_update_while_paused_gives_version_spans(
    make_sim: SimFactory, http: httpx.AsyncClient, mode: str
) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    budget = 150
    v1_only = reference_tokens(SHAPE, PROMPT, V1, budget, ignore_eos=True)
    chunks: list[Any] = []
    async with http.stream("POST", f"{sim.url}/generate", json=gen(max_new_tokens=budget, stream=True)) as response:
        events = sse_events(response)
        await read_until(events, chunks, 5)
        await post(http, sim.url, "/pause_generation", {"mode": mode})
        update = await post(http, sim.url, "/update_weights_from_disk", {"model_path": "w2", "weight_version": "v2"})
        if mode == "retract":  # retracted requests hold no KV: the flush succeeds
            assert update.status_code == 200
            assert update.json()["success"] is True and update.json()["num_paused_requests"] == 0
        else:  # in_place keeps the running batch's KV: weights switch, the cache cannot be flushed
            assert update.status_code == 400
            assert update.json()["success"] is False
            assert update.json()["message"].startswith("Weights were updated, but the cache was not flushed")
            assert (await http.post(f"{sim.url}/flush_cache")).status_code == 400
        info = (await http.get(f"{sim.url}/model_info")).json()
        # Observed on 0.5.23: only a successful update relabels what /model_info reports (the tokenizer
        # manager's copy); after the in_place 400 the scheduler already runs v2 (see the spans below).
        assert (info["model_path"], info["weight_version"]) == ("w2", "v2" if mode == "retract" else "default")
        await post(http, sim.url, "/continue_generation")
        chunks.extend([chunk async for chunk in events])
    meta = chunks[-1]["meta_info"]
    out = chunks[-1]["output_ids"]
    k = meta["weight_versions"][0]["end"]
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": k},
        {"version": "v2", "start": k, "end": budget},
    ]
    assert meta["weight_version"] == "v2" and meta["num_retractions"] == (1 if mode == "retract" else 0)
    assert out[:k] == v1_only[:k] and out[k:] != v1_only[k:]
    assert out == reference_tokens(SHAPE, PROMPT, [V1] * k + [V2] * (budget - k), budget, ignore_eos=True)

    clean_v2 = reference_tokens(SHAPE, PROMPT, V2, 16, ignore_eos=True)
    again = await generate(http, sim.url, gen(max_new_tokens=16))
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1
    if mode == "retract":  # the retracted request recomputed its KV under v2: the cache is clean
        assert again["output_ids"] == clean_v2
        return
    assert again["output_ids"] != clean_v2  # the radix cache still holds the prompt's KV from the old weights
    assert (await http.get(f"{sim.url}/flush_cache")).status_code == 200
    fresh = await generate(http, sim.url, gen(max_new_tokens=16))
    assert fresh["output_ids"] == clean_v2 and fresh["meta_info"]["cached_tokens"] == 0


async def test_update_waits_for_in_flight_requests(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    running = asyncio.create_task(generate(http, sim.url, gen(max_new_tokens=100)))
    await wait_for(lambda: _at_least(http, sim.url, 3), what="generation to start")
    update = asyncio.create_task(
        post(http, sim.url, "/update_weights_from_disk", {"model_path": "w2", "weight_version": "v2"})
    )
    await assert_blocked(update, 0.05)  # the writer lock waits for the running request
    assert not running.done()
    done = await running
    assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 100}
    assert done["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": 100}]
    result = await update
    assert result.status_code == 200 and result.json()["success"] is True
    assert "v2" in result.json()["message"]
    after = await generate(http, sim.url, gen())
    assert after["meta_info"]["weight_version"] == "v2"
    assert after["output_ids"] == reference_tokens(SHAPE, PROMPT, V2, 8, ignore_eos=True)


async def test_update_with_abort_all_requests(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    running = asyncio.create_task(generate(http, sim.url, gen(max_new_tokens=300)))
    await wait_for(lambda: _at_least(http, sim.url, 3), what="generation to start")
    update = await post(
        http, sim.url, "/update_weights_from_disk", {"model_path": "w2", "abort_all_requests": True, "load_format": "x"}
    )
    assert update.status_code == 200 and update.json()["success"] is True
    aborted = await running
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < 300
    info = (await http.get(f"{sim.url}/get_model_info")).json()
    assert (info["model_path"], info["load_format"], info["weight_version"]) == ("w2", "x", "default")


async def test_update_weight_version(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    running = asyncio.create_task(generate(http, sim.url, gen(max_new_tokens=300)))
    await wait_for(lambda: _at_least(http, sim.url, 3), what="generation to start")
    response = await post(http, sim.url, "/update_weight_version", {"new_version": "v9"})
    assert response.status_code == 200
    assert response.json()["success"] is True and response.json()["new_version"] == "v9"
    assert (await running)["meta_info"]["finish_reason"]["type"] == "abort"  # abort_all_requests defaults to true
    assert (await http.get(f"{sim.url}/model_info")).json()["weight_version"] == "v9"
    assert (await generate(http, sim.url, gen()))["meta_info"]["weight_version"] == "v9"


async def _at_least(http: httpx.AsyncClient, url: str, tokens: int) -> bool:
    return await generated(http, url) >= tokens


# -- abort and disconnect --------------------------------------------------------------------------------------


async def test_abort_request_by_rid_and_all(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    plain = asyncio.create_task(generate(http, sim.url, gen(prompt=[42, 43, 44], max_new_tokens=300, rid="b")))
    chunks: list[Any] = []
    async with http.stream("POST", f"{sim.url}/generate", json=gen(max_new_tokens=300, rid="a", stream=True)) as r:
        events = sse_events(r)
        await read_until(events, chunks, 3)
        await wait_for(lambda: state_is(http, sim.url, running=2), what="both requests running")
        duplicate = await http.post(f"{sim.url}/generate", json=gen(rid="b"))
        assert duplicate.status_code == 400 and "'b'" in duplicate.json()["error"]["message"]

        ignored = await post(http, sim.url, "/abort_request", {"rid": ""})
        assert ignored.status_code == 200 and ignored.content == b""
        assert await state_is(http, sim.url, running=2)

        one = await post(http, sim.url, "/abort_request", {"rid": "a"})
        assert one.status_code == 200 and one.content == b""
        chunks.extend([chunk async for chunk in events])
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert chunks[-1]["meta_info"]["id"] == "a" and 3 <= len(chunks[-1]["output_ids"]) < 300
    assert await state_is(http, sim.url, running=1)

    everything = await post(http, sim.url, "/abort_request", {"rid": "", "abort_all": True})
    assert everything.status_code == 200
    out = await plain
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "b"
    assert 'sglang:num_aborted_requests_total{model_name="tiny"} 2.0' in (await http.get(f"{sim.url}/metrics")).text


async def test_client_disconnect_aborts(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    chunks: list[Any] = []
    async with http.stream("POST", f"{sim.url}/generate", json=gen(max_new_tokens=300, stream=True)) as response:
        await read_until(sse_events(response), chunks, 2)
    await wait_for(lambda: state_is(http, sim.url, running=0, waiting=0), what="the streamed request to be aborted")
    assert (await sim_state(http, sim.url))["counters"]["aborted"] == 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(20.0, read=0.1)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(f"{sim.url}/generate", json=gen(max_new_tokens=300))
    await wait_for(lambda: state_is(http, sim.url, running=0, waiting=0), what="the plain request to be aborted")
    assert (await sim_state(http, sim.url))["counters"]["aborted"] == 2

    assert (await http.post(f"{sim.url}/pause_generation")).status_code == 200  # no body: mode abort
    assert await state_is(http, sim.url, paused=True, pause_mode="abort")
    async with httpx.AsyncClient(timeout=httpx.Timeout(20.0, read=0.1)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(f"{sim.url}/generate", json=gen())
    await wait_for(lambda: state_is(http, sim.url, held=0), what="the held request to leave")
    await post(http, sim.url, "/continue_generation")
    assert (await sim_state(http, sim.url))["counters"].get("prompt_tokens") == 2 * len(PROMPT)  # never admitted


# -- metrics, cache and info endpoints -------------------------------------------------------------------------


async def test_metrics_and_prefix_cache_hits(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg())
    first = await generate(http, sim.url, gen())
    second = await generate(http, sim.url, gen())
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(PROMPT) - 1  # token-granular radix cache; last token recomputed
    text = (await http.get(f"{sim.url}/metrics")).text
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:")
    }
    label = '{model_name="tiny"}'
    assert samples[f"sglang:num_running_reqs{label}"] == 0
    assert samples[f"sglang:num_queue_reqs{label}"] == 0
    assert samples[f"sglang:num_retracted_reqs{label}"] == 0
    assert samples[f"sglang:num_aborted_requests_total{label}"] == 0
    assert samples[f"sglang:prompt_tokens_total{label}"] == 2 * len(PROMPT)
    assert samples[f"sglang:generation_tokens_total{label}"] == 16
    assert samples[f"sglang:cached_tokens_total{label}"] == len(PROMPT) - 1
    assert samples[f"sglang:cache_hit_rate{label}"] == pytest.approx((len(PROMPT) - 1) / (2 * len(PROMPT)))


async def test_metrics_are_gzipped_for_a_client_that_accepts_gzip(make_sim: SimFactory) -> None:
    """As SGLang's /metrics (prometheus_client's ASGI app): gzip where the client offers it, plain text otherwise."""
    sim = await make_sim("sglang", engine=sg())
    async with httpx.AsyncClient(timeout=10) as client:  # decodes gzip itself, as it says it can
        offered = await client.get(f"{sim.url}/metrics", headers={"accept-encoding": "gzip"})
        plain = await client.get(f"{sim.url}/metrics", headers={"accept-encoding": "identity"})
    assert offered.headers["content-encoding"] == "gzip"
    assert "content-encoding" not in plain.headers
    assert "sglang:num_running_reqs" in offered.text and "sglang:num_running_reqs" in plain.text


async def test_info_and_health_endpoints(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(token_delay_s=0.002))
    for path in ("/model_info", "/get_model_info"):
        info = (await http.get(f"{sim.url}{path}")).json()
        assert info["model_path"] == "init" and info["served_model_name"] == "tiny"
        assert info["is_generation"] is True and info["weight_version"] == "default"
        assert {"tokenizer_path", "load_format"} <= set(info)
    for path in ("/server_info", "/get_server_info"):
        server = (await http.get(f"{sim.url}{path}")).json()
        assert server["version"].startswith("0.5.23") and server["weight_version"] == "default"
    for path in ("/get_weight_version", "/weight_version"):
        gone = await http.get(f"{sim.url}{path}")
        assert gone.status_code == 404 and "/model_info" in gone.json()["error"]["message"]
    for path in ("/health", "/health_generate", "/ready"):
        assert (await http.get(f"{sim.url}{path}")).status_code == 200
    for method in ("GET", "POST"):
        assert (await http.request(method, f"{sim.url}/flush_cache")).status_code == 200

    [idle] = (await http.get(f"{sim.url}/v1/loads")).json()["loads"]
    assert (idle["num_running_reqs"], idle["num_waiting_reqs"], idle["num_used_tokens"]) == (0, 0, 0)
    running = asyncio.create_task(generate(http, sim.url, gen(max_new_tokens=300)))
    await wait_for(lambda: _at_least(http, sim.url, 2), what="generation to start")
    [busy] = (await http.get(f"{sim.url}/v1/loads")).json()["loads"]
    assert (busy["dp_rank"], busy["num_running_reqs"], busy["num_waiting_reqs"]) == (0, 1, 0)
    assert busy["num_used_tokens"] > len(PROMPT) and 0 < busy["token_usage"] <= 1
    flush = await http.post(f"{sim.url}/flush_cache")
    assert flush.status_code == 400 and flush.text
    await post(http, sim.url, "/abort_request", {"abort_all": True})
    assert (await running)["meta_info"]["finish_reason"]["type"] == "abort"
    assert (await http.get(f"{sim.url}/nope")).status_code == 404


async def test_slow_start_answers_503(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("sglang", engine=sg(), startup_delay_s=60.0)
    assert (await http.get(f"{sim.url}/health")).status_code == 503
    starting = await http.post(f"{sim.url}/generate", json=gen())
    assert starting.status_code == 503 and "starting" in starting.json()["error"]["message"]
    assert (await http.post(f"{sim.url}/sim/faults", json={"ready": True})).status_code == 200
    assert (await http.get(f"{sim.url}/health")).status_code == 200


async def test_a_load_from_a_missing_path_fails_and_keeps_the_weights_when_weights_must_exist(
    make_sim: SimFactory, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The `weights_must_exist` fault: SGLang answers 400 `success: false` and keeps its weights and label."""
    sim = await make_sim("sglang", weights_must_exist=True)
    failed = await post(
        http, sim.url, "/update_weights_from_disk", {"model_path": str(tmp_path / "no"), "weight_version": "v2"}
    )
    assert failed.status_code == 400 and failed.json()["success"] is False
    assert failed.json()["message"].startswith("Failed to get weights iterator")
    info = (await http.get(f"{sim.url}/model_info")).json()
    assert (info["model_path"], info["weight_version"], sim.engine.version) == ("init", "default", "default")
    loaded = await post(
        http, sim.url, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "v2"}
    )
    assert loaded.status_code == 200 and loaded.json()["success"] is True
    await post(http, sim.url, "/sim/reset")
    assert (await sim_state(http, sim.url))["weights_must_exist"] is False  # a reset clears the fault
