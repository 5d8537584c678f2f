"""Focused regression tests for bugs found in issue 7 (reliability work: chaos soak, fuzzing, shutdown)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway_helpers import expected_tokens, generate_body, publish
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
    assert not gw.services.quota._held


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
