"""`POST /generate` in a session: its turns are recorded like the OpenAI routes' (token-in/token-out, the caller's
ids as the prompt, the prefix rule for continuing a sample), reach the trainer once the session is finished, and
carry where their tokens came from (resumes, segments). Without a session, /generate records nothing. A request
that does not validate (a bad field, a token outside the vocabulary, malformed JSON) is a 400 and reaches no engine."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import httpx
import numpy as np
import pytest
from redis.asyncio import Redis

from backends.routed_experts import decode_npy_b64
from backends.sim.engine import EngineSettings
from gateway.config import ReplicaConfig
from gateway.server import RunningGateway
from gateway.store import Keys
from gateway.trainer import TrajectoryConsumer
from gateway.trajectory import Sample, SampleSegment
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import (
    generate_body,
    publish,
    stream_generate,
)
from tests.sim_helpers import wait_for

PROMPT = [11, 22, 33, 44, 55]
KEYS = Keys()


async def generate(http: httpx.AsyncClient, gw: RunningGateway, body: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(f"{gw.url}/generate", json=body)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


async def test_generate_in_a_session_records_its_turns_for_the_trainer(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis_server: Any
) -> None:
    """Turn 2 resends turn 1's prompt + output + environment tokens: the same sample, the extension masked 0; turn 3
    (streamed) starts over: a new sample. Finished with a reward, the session reaches the trainer exactly."""
    gw = await make_gateway([await make_sim("vllm")])
    first = await generate(http, gw, generate_body(PROMPT, 5, session_id="loop", metadata={"task_id": "t1"}))
    assert (first["session_id"], first["sample_index"], first["new_sample"]) == ("loop", 0, True)
    env = [7, 8, 9]
    second_prompt = PROMPT + first["output_ids"] + env
    second = await generate(http, gw, generate_body(second_prompt, 4, session_id="loop"))
    assert (second["sample_index"], second["new_sample"]) == (0, False)
    third = await stream_generate(http, gw.url, generate_body([3, 1, 4], 3, session_id="loop"))
    assert (third.final["sample_index"], third.final["new_sample"]) == (1, True)

    session = (await http.get(f"{gw.url}/v1/sessions/loop")).json()
    assert session["metadata"] == {"task_id": "t1"}
    assert [s["num_turns"] for s in session["samples"]] == [2, 1]
    finished = await http.post(f"{gw.url}/v1/sessions/loop/finish", json={"reward": 1.5})
    assert finished.status_code == 200

    async with TrajectoryConsumer(redis_server.url, "trainers", "t0") as consumer:
        batch = await consumer.next_batch(4, timeout=5)
        (trajectory,) = batch.trajectories
        assert (trajectory.session_id, trajectory.reward) == ("loop", 1.5)
        sample, other = trajectory.samples
        assert sample.prompt_ids.tolist() == PROMPT
        assert sample.response_ids.tolist() == first["output_ids"] + env + second["output_ids"]
        assert sample.loss_mask.tolist() == [1] * 5 + [0] * 3 + [1] * 4
        expected_logprobs = first["logprobs"] + [0.0] * 3 + second["logprobs"]
        assert np.allclose(sample.logprobs, np.asarray(expected_logprobs, np.float32))
        assert sample.versions.tolist() == [0] * 5 + [-1] * 3 + [0] * 4
        assert other.prompt_ids.tolist() == [3, 1, 4] and other.response_ids.tolist() == third.output_ids
        assert other.loss_mask.tolist() == [1] * 3
        rows = batch.to_tensors()
        assert rows["loss_mask"][0].sum().item() == 9
        assert await consumer.ack(batch) == 1


async def test_generate_without_a_session_records_nothing(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    await generate(http, gw, generate_body(PROMPT, 3))  # the app's first request may set its own keys up

    async def stored() -> list[bytes]:  # what requests store: the dashboard's stream is written every second
        return sorted(k for k in await redis.keys("*") if k != Keys().dashboard.encode())

    keys = await stored()
    answer = await generate(http, gw, generate_body(PROMPT, 3))
    streamed = await stream_generate(http, gw.url, generate_body(PROMPT, 3))
    assert answer["session_id"] is None and "sample_index" not in answer
    assert streamed.final["session_id"] is None
    assert await stored() == keys
    refused = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, metadata={"task_id": "t"}))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "metadata"


async def test_generate_in_a_finished_session_is_a_conflict(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    await generate(http, gw, generate_body(PROMPT, 3, session_id="done"))
    assert (await http.post(f"{gw.url}/v1/sessions/done/finish", json={})).status_code == 200
    again = await http.post(f"{gw.url}/generate", json=generate_body(PROMPT, 3, session_id="done"))
    assert again.status_code == 409
    assert [s["num_turns"] for s in (await http.get(f"{gw.url}/v1/sessions/done")).json()["samples"]] == [1]


def without_sampling(segments: list[SampleSegment]) -> list[SampleSegment]:
    """Where each segment was sampled (what it was sampled with is checked apart)."""
    return [replace(segment, sampling=None) for segment in segments]


async def test_a_stored_sample_says_how_many_resumes_and_which_replica_served_each_segment(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """A weight update in the middle of a turn: two segments, versions 0 then 1, the resume counted; the next turn's
    segment comes after its environment span."""
    sim = await make_sim("vllm", engine=EngineSettings(block_size=16, token_delay_s=0.003))
    gw = await make_gateway([sim])
    replica = gw.services.generator.pool.all()[0].id
    task = asyncio.create_task(generate(http, gw, generate_body(PROMPT, 200, session_id="seg")))
    await wait_for(lambda: sim.engine.counters["generation_tokens"] > 30, what="tokens")
    assert (await publish(http, gw.url, 1)).status_code == 200
    first = await task
    assert first["num_resumes"] == 1
    cut = first["versions"].index(1)
    second = await generate(http, gw, generate_body(PROMPT + first["output_ids"] + [5], 4, session_id="seg"))

    (sample,) = await gw.services.store.load_samples("seg")
    assert sample.num_resumes == 1
    assert without_sampling(sample.segments) == [
        SampleSegment(0, cut, replica, 0),
        SampleSegment(cut, 200, replica, 1),
        SampleSegment(201, 205, replica, 1),
    ]
    # Each segment keeps its turn's sampling (the whole turn's budget, resumed or not).
    assert [s.sampling["max_tokens"] for s in sample.segments if s.sampling] == [200, 200, 4]
    assert second["replicas"] == [replica]
    view = (await http.get(f"{gw.url}/v1/sessions/seg")).json()["samples"][0]
    assert view["num_resumes"] == 1
    assert view["segments"][0] == {
        "start": 0,
        "end": cut,
        "replica": replica,
        "version": 0,
        "sampling": sample.segments[0].sampling,
    }


async def test_a_sample_stored_without_resumes_and_segments_reads_with_defaults(redis: Redis) -> None:
    """Backwards compatible: a sample hash written before `num_resumes` and `segments` existed still decodes."""
    sample = Sample(
        prompt_ids=np.asarray([1, 2], np.int32),
        response_ids=np.asarray([3], np.int32),
        loss_mask=np.asarray([1], np.uint8),
        logprobs=np.asarray([-0.5], np.float32),
        versions=np.asarray([0], np.int32),
        num_resumes=2,
        segments=[SampleSegment(0, 1, "http://127.0.0.1:1", 0)],
    )
    key = KEYS.sample("old", 0)
    await redis.hset(key, mapping=sample.to_redis())  # type: ignore[arg-type]
    assert Sample.from_redis(await redis.hgetall(key)).segments == sample.segments
    await redis.hdel(key, "num_resumes", "segments", "segment_replicas")
    old = Sample.from_redis(await redis.hgetall(key))
    assert (old.num_resumes, old.segments, old.response_ids.tolist()) == (0, [], [3])


async def test_an_engine_request_that_goes_on_across_an_update_is_one_segment_per_version(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Pause mode `keep`: the request stays in the engine (no resume), its tokens labelled 0 then 1."""
    sim = await make_sim("sglang", engine=EngineSettings(block_size=1, token_delay_s=0.002))
    gw = await make_gateway([sim])
    replica = gw.services.generator.pool.all()[0].id
    progress = [0]
    task = asyncio.create_task(stream_generate(http, gw.url, generate_body(PROMPT, 200, session_id="kept"), progress))
    await wait_for(lambda: progress[0] >= 50, what="tokens")
    assert (await publish(http, gw.url, 1, mode="keep")).status_code == 200
    versions = (await task).final["versions"]
    cut = versions.index(1)
    (sample,) = await gw.services.store.load_samples("kept")
    assert sample.num_resumes == 0
    assert without_sampling(sample.segments) == [SampleSegment(0, cut, replica, 0), SampleSegment(cut, 200, replica, 1)]


async def test_routed_experts_of_a_continued_turn_cover_its_whole_input(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The second turn fetches only its new positions' experts (the sample holds the others); its answer still has
    one row per position of `input_ids + output_ids` but the last, as a one-shot's has."""
    sim = await make_sim("vllm", engine=EngineSettings(block_size=16, routed_experts_output=True))
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", routed_experts=True)])
    first = await generate(http, gw, generate_body(PROMPT, 4, session_id="r3", return_routed_experts=True))
    prompt = PROMPT + first["output_ids"] + [9]
    second = await generate(http, gw, generate_body(prompt, 4, session_id="r3", return_routed_experts=True))
    assert second["new_sample"] is False
    experts = decode_npy_b64(second["routed_experts"])
    oneshot = await generate(http, gw, generate_body(prompt, 4, return_routed_experts=True))
    assert oneshot["output_ids"] == second["output_ids"]
    assert experts.shape[0] == len(prompt) + 4 - 1
    assert np.array_equal(experts, decode_npy_b64(oneshot["routed_experts"]))
    (sample,) = await gw.services.store.load_samples("r3")
    assert sample.routed_experts is not None and np.array_equal(sample.routed_experts, experts)


# -- requests refused before anything runs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input_ids": [], "sampling_params": {"max_tokens": 4}}, "input_ids", 400),
        ({"input_ids": [1, 999999], "sampling_params": {"max_tokens": 4}}, "input_ids", 400),
        ({"input_ids": [1, -3], "sampling_params": {"max_tokens": 4}}, "input_ids", 400),
        # Long prompts are checked in one buffer pass (gateway.tokenization.token_ids): one id outside, at the end.
        ({"input_ids": [1] * 3000 + [-1], "sampling_params": {"max_tokens": 4}}, "input_ids", 400),
        ({"input_ids": [1] * 3000 + [999999], "sampling_params": {"max_tokens": 4}}, "input_ids", 400),
        ({"input_ids": [1] * 3000 + [2**64], "sampling_params": {"max_tokens": 4}}, "input_ids", 400),
        (
            {"input_ids": [1], "sampling_params": {"max_tokens": 4, "stop_token_ids": [-2]}},
            "sampling_params.stop_token_ids",
            400,
        ),
        ({"input_ids": [1], "sampling_params": {"max_tokens": -1}}, "sampling_params.max_tokens", 400),
        ({"input_ids": [1], "sampling_params": {"max_tokens": 10**6}}, "sampling_params.max_tokens", 400),
        ({"input_ids": [1]}, "sampling_params", 400),
        ({"input_ids": [1], "sampling_params": {"max_tokens": 4}, "bogus": 1}, "bogus", 400),
        ({"input_ids": [1], "sampling_params": {"max_tokens": 4, "top_p": 0}}, "sampling_params.top_p", 400),
    ],
)
async def test_generate_rejects_bad_input(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    body: dict[str, Any],
    param: str,
    status: int,
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    response = await http.post(f"{gw.url}/generate", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert sim.engine.counters["prompt_tokens"] == 0  # nothing reached the engine


async def test_a_token_outside_the_vocabulary_is_named_and_nothing_runs(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, redis: Redis
) -> None:
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    vocab = gw.services.vocab.vocab_size
    body = {"input_ids": [5, 7, vocab, 3], "sampling_params": {"max_tokens": 4}}  # exactly the size: one too many
    response = await http.post(f"{gw.url}/generate", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith(f"input_ids[2] = {vocab} is outside the vocabulary")
    completion = {"model": "tiny", "prompt": [5, vocab + 9, vocab], "max_tokens": 4}
    response = await http.post(f"{gw.url}/v1/completions", json=completion, headers={"x-session-id": "s-vocab"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["message"] == f"token id {vocab + 9} is outside the vocabulary"
    long_prompt = [i % vocab for i in range(3000)]  # checked in one buffer pass (gateway.tokenization.token_ids)
    for bad in (-1, vocab):
        response = await http.post(f"{gw.url}/generate", json={**body, "input_ids": [*long_prompt, bad, 3]})
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith(f"input_ids[3000] = {bad} is outside the vocabulary")
    ok = await http.post(f"{gw.url}/generate", json={**body, "input_ids": [5, 7, vocab - 1]})
    assert ok.status_code == 200, ok.text
    assert sim.engine.counters["prompt_tokens"] == 3  # only the valid request reached the engine
    assert await redis.keys("*s-vocab*") == []  # the refused turn stored nothing


async def test_malformed_json_is_400(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    gw = await make_gateway([await make_sim("vllm")])
    headers = {"content-type": "application/json"}
    response = await http.post(f"{gw.url}/generate", content=b"{not json", headers=headers)
    assert response.status_code == 400 and "error" in response.json()
