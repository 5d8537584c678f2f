"""The simulator's vLLM dialect against ../shared/contracts (field names, status codes, encodings, semantics)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from backends.routed_experts import decode_npy_b64, encode_npy_b64
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from tests.conftest import SimFactory
from tests.sim_helpers import sim_state, sse_events, wait_for

SHAPE = ModelShape()
PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]


def completion(prompt: list[int] = PROMPT, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra


async def stream_tokens(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[list[int], list[Any]]:
    tokens: list[int] = []
    chunks: list[Any] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}) as response:
        assert response.status_code == 200
        async for chunk in sse_events(response):
            chunks.append(chunk)
            for choice in chunk["choices"]:
                tokens.extend(choice.get("token_ids") or [])
    return tokens, chunks


async def test_completion_non_stream_fields(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    r = await http.post(
        f"{sim.url}/v1/completions",
        json=completion(return_token_ids=True, logprobs=2, return_tokens_as_token_ids=True, request_id="abc"),
    )
    assert r.status_code == 200
    body = r.json()
    assert body["id"] == "cmpl-abc"
    assert body["object"] == "text_completion"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["prompt_token_ids"] == PROMPT
    assert choice["token_ids"] == reference_tokens(SHAPE, PROMPT, ("init", "default"), 8, ignore_eos=True)
    assert choice["routed_experts"] is None  # server flag off
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert all(
        len(top) == 2 and f"token_id:{t}" in top for top, t in zip(lp["top_logprobs"], choice["token_ids"], strict=True)
    )
    assert body["usage"] == {
        "prompt_tokens": 8,
        "total_tokens": 16,
        "completion_tokens": 8,
        "prompt_tokens_details": None,
    }


async def test_token_ids_only_when_asked(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    choice = (await http.post(f"{sim.url}/v1/completions", json=completion())).json()["choices"][0]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and choice["logprobs"] is None


async def test_stream_matches_non_stream(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    body = completion(max_tokens=12, return_token_ids=True, return_weight_versions=True)
    expected = (await http.post(f"{sim.url}/v1/completions", json=body)).json()["choices"][0]
    tokens, chunks = await stream_tokens(http, sim.url, body | {"stream_options": {"include_usage": True}})
    assert tokens == expected["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in chunks[1:-1])
    final_choice = chunks[-2]["choices"][0]
    assert final_choice["finish_reason"] == "length"
    assert final_choice["weight_versions"] == [{"version": "default", "start": 0, "end": 12}]
    assert all("weight_versions" not in c["choices"][0] for c in chunks[:-2])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all("routed_experts" not in c["choices"][0] for c in chunks[:-1])  # never in stream chunks


async def test_eos_and_stop_token(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(shape=ModelShape(eos_prob=0.5)))
    choice = (
        await http.post(
            f"{sim.url}/v1/completions", json=completion(max_tokens=64, ignore_eos=False, return_token_ids=True)
        )
    ).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None
    assert choice["token_ids"][-1] == SHAPE.eos_token_id
    free = await make_sim("vllm")
    full = reference_tokens(SHAPE, PROMPT, ("init", "default"), 20, ignore_eos=True)
    body = completion(max_tokens=20, stop_token_ids=[full[5]], return_token_ids=True)
    choice = (await http.post(f"{free.url}/v1/completions", json=body)).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == full[5]
    assert choice["token_ids"] == full[: full.index(full[5]) + 1]


async def test_abort_pause_then_continuation_equals_uninterrupted(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    reference = reference_tokens(SHAPE, PROMPT, ("init", "default"), 200, ignore_eos=True)
    body = completion(max_tokens=200, return_token_ids=True, stream=True)
    partial: list[int] = []
    finish = None
    async with http.stream("POST", f"{sim.url}/v1/completions", json=body) as response:
        async for chunk in sse_events(response):
            choice = chunk["choices"][0]
            partial.extend(choice["token_ids"])
            if len(partial) >= 20 and finish is None and choice["finish_reason"] is None:
                assert (await http.post(f"{sim.url}/pause", params={"mode": "abort"})).json() == {"status": "paused"}
            finish = choice["finish_reason"] or finish
    assert finish == "abort" and 20 <= len(partial) < 200
    assert (await http.post(f"{sim.url}/resume")).json() == {"status": "resumed"}
    rest = (
        await http.post(
            f"{sim.url}/v1/completions",
            json=completion(prompt=PROMPT + partial, max_tokens=200 - len(partial), return_token_ids=True),
        )
    ).json()["choices"][0]["token_ids"]
    assert partial + rest == reference


async def test_abort_requests_needs_engine_id(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    body = completion(max_tokens=400, return_token_ids=True, request_id="myreq")
    task = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=body))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 10, what="tokens")
    bare = await http.post(f"{sim.url}/abort_requests", json={"request_ids": ["myreq"]})
    assert bare.json() == {"status": "aborted", "aborted": 1}  # vLLM counts ids, matched or not
    assert not task.done()
    await http.post(f"{sim.url}/abort_requests", json={"request_ids": ["cmpl-myreq-0"]})
    choice = (await task).json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 10 <= len(choice["token_ids"]) < 400
    assert choice["token_ids"] == reference_tokens(
        SHAPE, PROMPT, ("init", "default"), len(choice["token_ids"]), ignore_eos=True
    )


async def test_abort_all_with_empty_body(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    tasks = [
        asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=500))) for _ in range(3)
    ]
    await wait_for(lambda: sim.engine.num_running == 3, what="3 running")
    assert (await http.post(f"{sim.url}/abort_requests", json={})).json()["aborted"] == 3
    assert [(await t).json()["choices"][0]["finish_reason"] for t in tasks] == ["abort"] * 3


async def test_pause_wait_drains_in_flight(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001))
    task = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=60)))
    await wait_for(lambda: sim.engine.num_running == 1, what="running")
    pause = await http.post(f"{sim.url}/pause", params={"mode": "wait"})
    assert pause.json() == {"status": "paused"}
    # The pause returned only after the in-flight request had finished in the engine.
    assert sim.engine.counters["finished_length"] == 1 and not sim.engine.requests
    assert (await task).json()["choices"][0]["finish_reason"] == "length"
    await http.post(f"{sim.url}/resume")


async def test_pause_keep_freezes_and_new_requests_are_held(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001), dev_mode=True)
    first = asyncio.create_task(
        http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=300, return_token_ids=True))
    )
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 5, what="tokens")
    await http.post(f"{sim.url}/pause", params={"mode": "keep", "clear_cache": "false"})
    assert (await http.get(f"{sim.url}/is_paused")).json() == {"is_paused": True}
    assert sim.engine.counters["retractions"] == 0
    frozen = sim.engine.counters["generation_tokens"]
    second = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=3)))
    await wait_for(lambda: sim.engine.held == 1, what="held")
    state = await sim_state(http, sim.url)
    assert state["running"] == 1 and state["held"] == 1
    assert sim.engine.counters["generation_tokens"] == frozen and not first.done()
    await http.post(f"{sim.url}/resume")
    assert (await first).json()["choices"][0]["finish_reason"] == "length"
    assert (await second).json()["choices"][0]["finish_reason"] == "length"


async def test_pause_keep_with_clear_cache_preempts_as_vllm_032_does(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    """vLLM 0.32 documents `clear_cache` as ignored for keep, but resets its caches with `reset_running_requests`
    once the paused engine is idle: the frozen request is preempted (it recomputes its KV on resume)."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001), dev_mode=True)
    first = asyncio.create_task(
        http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=300, return_token_ids=True))
    )
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 5, what="tokens")
    await http.post(f"{sim.url}/pause", params={"mode": "keep"})  # clear_cache defaults to true
    assert sim.engine.counters["retractions"] == 1
    await http.post(f"{sim.url}/resume")
    assert (await first).json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(("policy", "status"), [("block", 200), ("reject", 503)])
async def test_new_requests_during_abort_pause(
    make_sim: SimFactory, http: httpx.AsyncClient, policy: str, status: int
) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(new_requests_while_paused=policy))  # type: ignore[arg-type]
    await http.post(f"{sim.url}/pause", params={"mode": "abort"})
    task = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=3)))
    if policy == "block":
        await wait_for(lambda: sim.engine.held == 1, what="held")
        await http.post(f"{sim.url}/resume")
    response = await task
    assert response.status_code == status
    if status == 503:
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        assert response.json()["error"]["code"] == 503


async def test_keep_mode_weight_update_spans_and_tokens(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.001))
    body = completion(max_tokens=120, return_token_ids=True, return_weight_versions=True)
    task = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=body))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 10, what="tokens")
    await http.post(f"{sim.url}/pause", params={"mode": "keep"})
    rpc = await http.post(
        f"{sim.url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": "ckpt2"}}
    )
    assert rpc.json() == {"results": [None]}
    await http.post(f"{sim.url}/update_weight_version", json={"new_version": "v2"})
    assert (await http.get(f"{sim.url}/weight_info")).json() == {"weight_version": "v2"}
    await http.post(f"{sim.url}/resume")
    choice = (await task).json()["choices"][0]
    spans = choice["weight_versions"]
    k = spans[0]["end"]
    assert spans == [{"version": "default", "start": 0, "end": k}, {"version": "v2", "start": k, "end": 120}]
    per_token = [("init", "default")] * k + [("ckpt2", "v2")] * (120 - k)
    assert choice["token_ids"] == reference_tokens(SHAPE, PROMPT, per_token, 120, ignore_eos=True)
    assert choice["token_ids"][k:] != reference_tokens(SHAPE, PROMPT, ("init", "default"), 120, ignore_eos=True)[k:]


async def test_a_reload_from_a_missing_path_fails_when_weights_must_exist(
    make_sim: SimFactory, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    """The `weights_must_exist` fault (off by default, switched at run time): vLLM's reload of a checkpoint that is
    not there answers 500 and leaves the weights as they were; one that is there loads."""
    sim = await make_sim("vllm")
    missing = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path / "missing")}}
    assert (await http.post(f"{sim.url}/collective_rpc", json=missing)).status_code == 200  # off: any path loads
    await http.post(f"{sim.url}/sim/faults", json={"weights_must_exist": True})
    assert (await sim_state(http, sim.url))["weights_must_exist"] is True
    sim.engine.load_weights("init")
    failed = await http.post(f"{sim.url}/collective_rpc", json=missing)
    assert failed.status_code == 500 and "no checkpoint" in failed.json()["error"]["message"]
    assert sim.engine.weights == "init" and sim.engine.counters["weight_loads"] == 2
    there = {"method": "reload_weights", "kwargs": {"weights_path": str(tmp_path)}}
    assert (await http.post(f"{sim.url}/collective_rpc", json=there)).json() == {"results": [None]}
    assert sim.engine.weights == str(tmp_path)


async def test_dev_routes_are_404_without_dev_mode(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", dev_mode=False)
    for path in ("/pause", "/resume", "/abort_requests", "/collective_rpc", "/update_weight_version"):
        assert (await http.post(f"{sim.url}{path}", json={})).status_code == 404
    assert (await http.get(f"{sim.url}/health")).status_code == 200


async def test_generate_endpoint_needs_scale_out(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    r = await http.post(f"{sim.url}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {}})
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "PermissionDeniedError"
    assert "--enable-scale-out" in r.json()["error"]["message"]


async def test_generate_endpoint(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    engine = EngineSettings(routed_experts_output=True)
    sim = await make_sim("vllm", engine=engine, enable_scale_out=True)
    sampling = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    r = await http.post(
        f"{sim.url}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling, "request_id": "g1"}
    )
    body = r.json()
    assert body["request_id"] == "generate-tokens-g1" and body["output_mode"] == "tokens"
    choice = body["choices"][0]
    assert choice["token_ids"] == reference_tokens(SHAPE, PROMPT, ("init", "default"), 5, ignore_eos=True)
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 5}]
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == choice["token_ids"]
    assert content[0]["top_logprobs"][0]["token_id"] == choice["token_ids"][0]
    assert decode_npy_b64(choice["routed_experts"]).shape == (len(PROMPT) + 5 - 1, SHAPE.num_layers, SHAPE.top_k)
    chunks: list[Any] = []
    async with http.stream(
        "POST",
        f"{sim.url}/inference/v1/generate",
        json={"token_ids": PROMPT, "sampling_params": sampling, "stream": True},
    ) as response:
        chunks = [c async for c in sse_events(response)]
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == choice["token_ids"]
    assert chunks[-1]["choices"][0]["routed_experts"] is not None  # the generate stream carries experts at the end
    assert all(c["choices"][0]["weight_versions"] is None for c in chunks[:-1])


async def test_generate_abort_by_engine_id(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002), enable_scale_out=True)
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 500, "ignore_eos": True}, "request_id": "wv"}
    task = asyncio.create_task(http.post(f"{sim.url}/inference/v1/generate", json=body))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] >= 5, what="tokens")
    assert (
        await http.post(f"{sim.url}/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-wv"]})
    ).status_code == 200
    assert (await task).json()["choices"][0]["finish_reason"] == "abort"


async def test_routed_experts_npy(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    shape = ModelShape(num_layers=4, top_k=3, num_experts=16)
    sim = await make_sim("vllm", engine=EngineSettings(shape=shape, routed_experts_output=True))
    choice = (await http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=6))).json()["choices"][0]
    experts = decode_npy_b64(choice["routed_experts"])
    assert experts.shape == (len(PROMPT) + 6 - 1, 4, 3) and experts.dtype == np.uint8
    assert experts.max() < 16
    assert all(len(set(row)) == 3 for row in experts.reshape(-1, 3).tolist())  # top-k experts are distinct
    again = (
        await http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=6, routed_experts_prompt_start=5))
    ).json()
    assert np.array_equal(decode_npy_b64(again["choices"][0]["routed_experts"]), experts[5:])


async def test_routed_experts_replay_input(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    engine = EngineSettings(routed_experts_output=True, routed_experts_input=True)
    sim = await make_sim("vllm", engine=engine)
    given = np.full((len(PROMPT), SHAPE.num_layers, SHAPE.top_k), 7, dtype=np.uint8)
    body = completion(max_tokens=4, replay_routed_experts=encode_npy_b64(given))
    experts = decode_npy_b64(
        (await http.post(f"{sim.url}/v1/completions", json=body)).json()["choices"][0]["routed_experts"]
    )
    assert (experts[: len(PROMPT)] == 7).all() and not (experts[len(PROMPT) :] == 7).all()
    plain = await make_sim("vllm", engine=EngineSettings(routed_experts_output=True))  # off: the field is ignored
    experts = decode_npy_b64(
        (await http.post(f"{plain.url}/v1/completions", json=body)).json()["choices"][0]["routed_experts"]
    )
    assert not (experts[: len(PROMPT)] == 7).all()


async def test_metrics_and_prefix_cache(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", enable_prompt_tokens_details=True)
    prompt = list(range(10, 50))  # 40 tokens: two full 16-token blocks are reusable
    first = (await http.post(f"{sim.url}/v1/completions", json=completion(prompt=prompt, max_tokens=2))).json()
    second = (await http.post(f"{sim.url}/v1/completions", json=completion(prompt=prompt, max_tokens=2))).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    text = (await http.get(f"{sim.url}/metrics")).text
    for name in (
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:prefix_cache_queries_total{",
        "vllm:generation_tokens_total{",
    ):
        assert name in text
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 32.0' in text


async def test_stale_prefix_cache_until_reset(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    prompt = list(range(10, 50))
    await http.post(f"{sim.url}/v1/completions", json=completion(prompt=prompt, max_tokens=2))
    await http.post(f"{sim.url}/pause", params={"mode": "keep", "clear_cache": "false"})  # the cache kept
    await http.post(f"{sim.url}/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": "w2"}})
    await http.post(f"{sim.url}/resume")
    clean = reference_tokens(SHAPE, prompt, ("w2", "default"), 8, ignore_eos=True)
    body = completion(prompt=prompt, max_tokens=8, return_token_ids=True)
    stale = (await http.post(f"{sim.url}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
    assert stale != clean  # KV computed under the old weights leaks into new requests
    assert (await http.post(f"{sim.url}/reset_prefix_cache")).json() == {"success": True}
    fresh = (await http.post(f"{sim.url}/v1/completions", json=body)).json()["choices"][0]["token_ids"]
    assert fresh == clean


async def test_reset_prefix_cache_with_running_requests(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    """Refused while a request holds KV; with `reset_running_requests` the request is preempted (it recomputes
    its KV and goes on with the same tokens) and the reset succeeds."""
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    running = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=60)))
    await wait_for(lambda: sim.engine.num_running == 1)
    assert (await http.post(f"{sim.url}/reset_prefix_cache")).json() == {"success": False}
    reset = await http.post(f"{sim.url}/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert reset.json() == {"success": True} and sim.engine.counters["retractions"] == 1
    choice = (await running).json()["choices"][0]
    assert choice["finish_reason"] == "length"


async def test_client_disconnect_aborts(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    async with http.stream(
        "POST", f"{sim.url}/v1/completions", json=completion(max_tokens=1000, stream=True)
    ) as response:
        async for _ in sse_events(response):
            if sim.engine.counters["generation_tokens"] >= 5:
                break
    await wait_for(lambda: sim.engine.counters["finished_abort"] == 1, what="stream abort")
    short = httpx.AsyncClient(timeout=httpx.Timeout(5.0, read=0.2))
    with pytest.raises(httpx.ReadTimeout):
        await short.post(f"{sim.url}/v1/completions", json=completion(max_tokens=1000))
    await short.aclose()
    await wait_for(lambda: sim.engine.counters["finished_abort"] == 2, what="non-stream abort")
    assert sim.engine.num_running == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (completion(prompt=[1, 99999]), "out of vocabulary"),
        (completion(max_tokens=0), "max_tokens"),
        (completion(max_tokens=5000), "maximum context length"),
        ({"model": "tiny", "max_tokens": 3}, "prompt"),
        (completion(prompt=[]), "at least one token"),
    ],
)
async def test_bad_requests_are_400(
    make_sim: SimFactory, http: httpx.AsyncClient, body: dict[str, Any], needle: str
) -> None:
    sim = await make_sim("vllm")
    r = await http.post(f"{sim.url}/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError" and needle in r.json()["error"]["message"]


async def test_simple_endpoints(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    models = (await http.get(f"{sim.url}/v1/models")).json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    assert (await http.get(f"{sim.url}/load")).json() == {"server_load": 0}
    assert (await http.get(f"{sim.url}/is_paused")).json() == {"is_paused": False}
    assert (await http.post(f"{sim.url}/pause", params={"mode": "nope"})).status_code == 400


async def test_faults_error_rate_hang_ready_abort(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", engine=EngineSettings(token_delay_s=0.002))
    await http.post(f"{sim.url}/sim/faults", json={"error_rate": 1.0})
    r = await http.post(f"{sim.url}/v1/completions", json=completion())
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
    assert (await http.get(f"{sim.url}/health")).status_code == 200  # only generation fails
    await http.post(f"{sim.url}/sim/faults", json={"error_rate": 0.0, "hang": True})
    hung = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion()))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(asyncio.shield(hung), 0.3)
    await http.post(f"{sim.url}/sim/faults", json={"hang": False})
    assert (await hung).status_code == 200
    await http.post(f"{sim.url}/sim/faults", json={"ready": False})
    assert (await http.get(f"{sim.url}/health")).status_code == 503
    await http.post(f"{sim.url}/sim/faults", json={"ready": True})
    assert (await http.get(f"{sim.url}/health")).status_code == 200
    task = asyncio.create_task(http.post(f"{sim.url}/v1/completions", json=completion(max_tokens=1000)))
    await wait_for(lambda: sim.engine.num_running == 1, what="running")
    assert (await http.post(f"{sim.url}/sim/faults", json={"abort_all": True})).json()["aborted"] == 1
    assert (await task).json()["choices"][0]["finish_reason"] == "abort"
    assert (await http.post(f"{sim.url}/sim/faults", json={"crash": True})).status_code == 409  # in-process


async def test_slow_start(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm", startup_delay_s=0.3)
    assert (await http.get(f"{sim.url}/health")).status_code == 503
    await wait_for(lambda: sim.app.state.faults.ready, what="ready")
    assert (await http.get(f"{sim.url}/health")).status_code == 200


async def test_speed_and_prompt_log_control(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sim = await make_sim("vllm")
    speed = await http.post(f"{sim.url}/sim/speed", json={"token_delay": 0.001})
    assert speed.json() == {"token_delay": 0.001, "prefill_delay": 0.0}
    assert sim.engine.settings.token_delay_s == 0.001
    assert (await http.post(f"{sim.url}/sim/speed", json={"token_delay": -1})).status_code == 400
    await http.post(f"{sim.url}/v1/completions", json=completion())  # before recording: not logged
    assert (await http.post(f"{sim.url}/sim/prompt_log", json={"head": 2})).json() == {"head": 2}
    await http.post(f"{sim.url}/v1/completions", json=completion())
    await http.post(f"{sim.url}/v1/completions", json=completion([9, 8, 7]))
    log = (await http.get(f"{sim.url}/sim/prompt_log")).json()
    assert log["head"] == 2
    assert [entry[:2] for entry in log["requests"]] == [[PROMPT[:2], len(PROMPT)], [[9, 8], 3]]
    assert log["requests"][0][2] <= log["requests"][1][2]  # arrival times, in order
    await http.post(f"{sim.url}/sim/prompt_log", json={"head": 0})
    assert (await http.get(f"{sim.url}/sim/prompt_log")).json() == {"head": 0, "requests": []}
