"""Direct calls to a real engine (bypassing the gateway): greedy references, metrics, and restoring the state a
test changed (weights, version label, pause, prefix cache) so every test starts from the same engine."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from tests.engines.servers import EngineServer

RESTORE_VERSION = "default"  # the label both engines start with; the gateway reads it as version 0


def prompt_of(length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of ordinary (non-special) token ids."""
    return [7 + (seed * 7919 + i * 104729) % 2000 for i in range(length)]


async def greedy(
    http: httpx.AsyncClient, server: EngineServer, prompt: list[int], n: int, adapter: str | None = None
) -> tuple[list[int], list[float]]:
    """The engine's own greedy completion of `prompt` (n tokens, eos ignored), run alone: (token ids, logprobs);
    `adapter`: under that loaded LoRA adapter."""
    if server.kind == "vllm":
        body: dict[str, Any] = {
            "model": adapter or "tiny",
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 0,
        }
        answer = await _post(http, f"{server.url}/v1/completions", body)
        choice = answer["choices"][0]
        return [int(t) for t in choice["token_ids"]], [float(v) for v in choice["logprobs"]["token_logprobs"]]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    } | ({"lora_path": adapter} if adapter else {})
    answer = await _post(http, f"{server.url}/generate", body)
    entries = answer["meta_info"]["output_token_logprobs"]
    return [int(t) for t in answer["output_ids"]], [float(e[0]) for e in entries]


async def _post(http: httpx.AsyncClient, url: str, body: Any = None, **kw: Any) -> Any:
    response = await http.post(url, json=body, timeout=120.0, **kw)
    assert response.status_code == 200, f"{url}: {response.status_code} {response.text[:500]}"
    # Some control routes answer plain text (SGLang /flush_cache: "Cache flushed. ...").
    return response.json() if response.headers.get("content-type", "").startswith("application/json") else None


async def metric(http: httpx.AsyncClient, server: EngineServer, name: str, *, absent_is_zero: bool = False) -> float:
    """Sum of the samples of one Prometheus metric (all label sets) from the engine's /metrics. `absent_is_zero`:
    a labelled counter that never counted has no sample yet (SGLang's retraction counter)."""
    response = await http.get(f"{server.url}/metrics")
    response.raise_for_status()
    total, found = 0.0, False
    for line in response.text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found or absent_is_zero, f"the engine exports no {name}"
    return total


async def wait_metric(
    http: httpx.AsyncClient, server: EngineServer, name: str, value: float, timeout: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout
    while (current := await metric(http, server, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {current}, expected {value}"
        await asyncio.sleep(0.1)


async def flush(http: httpx.AsyncClient, server: EngineServer, timeout: float = 30.0) -> None:
    """Empty the engine's prefix cache. vLLM: `/reset_prefix_cache`. SGLang: `/flush_cache`, retried while it
    answers 400: the scheduler refuses unless it is fully idle, and its own `/health` runs a one-token generation,
    so a health probe (the gateway's, every few seconds) queued at that moment refuses the flush (seen in CI:
    "#queue-req: 1"). Still refused after `timeout`: a request was left running in the engine, a failure."""
    if server.kind == "vllm":
        await _post(http, f"{server.url}/reset_prefix_cache")
        return
    deadline = time.monotonic() + timeout
    while True:
        response = await http.post(f"{server.url}/flush_cache", timeout=120.0)
        if response.status_code == 200:
            return
        assert response.status_code == 400 and time.monotonic() < deadline, (
            f"{server.url}/flush_cache: {response.status_code} {response.text[:300]} "
            f"({await metric(http, server, 'sglang:num_running_reqs')} requests still running)"
        )
        await asyncio.sleep(0.2)


async def restore(http: httpx.AsyncClient, server: EngineServer) -> None:
    """Back to the served checkpoint, labelled "default", not paused, with an empty prefix cache."""
    model = str(server.model_path)
    if server.kind == "vllm":
        await _post(http, f"{server.url}/resume")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": model}}
        await _post(http, f"{server.url}/collective_rpc", rpc)
        await _post(http, f"{server.url}/update_weight_version", {"new_version": RESTORE_VERSION})
        await flush(http, server)
        info = await http.get(f"{server.url}/weight_info")
        assert info.json()["weight_version"] == RESTORE_VERSION
        return
    await _post(http, f"{server.url}/continue_generation", {})
    update = {"model_path": model, "weight_version": RESTORE_VERSION, "flush_cache": True}
    await _post(http, f"{server.url}/update_weights_from_disk", update)
    await flush(http, server)
    info = await http.get(f"{server.url}/model_info")
    assert info.json()["weight_version"] == RESTORE_VERSION


async def load_from_disk(http: httpx.AsyncClient, server: EngineServer, path: str) -> None:
    """The engine's own load of the checkpoint at `path` (no label, no pause): vLLM's `reload_weights`, SGLang's
    `/update_weights_from_disk`; the prefix cache flushed after."""
    if server.kind == "vllm":
        await _post(
            http, f"{server.url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
        )
    else:
        answer = await _post(http, f"{server.url}/update_weights_from_disk", {"model_path": path, "flush_cache": False})
        assert answer["success"], answer
    await flush(http, server)


async def weight_checksums(http: httpx.AsyncClient, server: EngineServer) -> dict[str, str]:
    """The engine's checksum of each of its parameters as it holds them (vLLM `/weight_checker`, SGLang
    `/weights_checker`; names and bytes are the engine's own, after its post-processing of a load)."""
    if server.kind == "vllm":
        answer = await _post(http, f"{server.url}/weight_checker", {"action": "checksum"})
        return {str(k): str(v) for k, v in answer["checksums"].items()}
    answer = await _post(http, f"{server.url}/weights_checker", {"action": "checksum"})
    assert answer["success"], answer
    return {f"{i}:{k}": str(v) for i, rank in enumerate(answer["ranks"]) for k, v in rank["checksums"].items()}
