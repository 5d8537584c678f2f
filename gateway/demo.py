"""`rollout-gateway demo`: simulator replicas + embedded Redis + the gateway, with weight updates mid-flight.

Every completion is checked against the simulator's deterministic reference for the versions that sampled
its tokens, so the summary shows, not claims, that updates lost and corrupted nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import orjson
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from backends.sim.common import SimServerSettings
from backends.sim.engine import EngineSettings
from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from backends.sim.server import serve_in_process
from gateway.config import ReplicaConfig, Settings
from gateway.server import serve_gateway

ADMIN_TOKEN = "demo-admin-token"


@dataclass(frozen=True)
class DemoOptions:
    replicas: int = 2
    dialect: Literal["vllm", "sglang", "mixed"] = "mixed"
    requests: int = 64
    tokens: int = 200
    updates: int = 3
    token_delay_s: float = 0.005
    mode: Literal["abort", "keep", "wait"] = "abort"


@dataclass
class DemoResult:
    prompt: list[int]
    output_ids: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_resumes: int = 0
    error: str | None = None


def checkpoint(version: int) -> tuple[str, str]:
    """The simulator's (weights identity, label) for a demo version."""
    return ("init", "default") if version == 0 else (f"demo-ckpt-{version}", str(version))


async def _generate(
    client: httpx.AsyncClient, url: str, index: int, options: DemoOptions, sink: list[int]
) -> DemoResult:
    prompt = [10 + index % 50, 20 + index % 7, 30 + index, 40]
    result = DemoResult(prompt)
    body = {
        "session_id": f"demo-{index}",
        "input_ids": prompt,
        "sampling_params": {"max_tokens": options.tokens, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    async with client.stream("POST", f"{url}/generate", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event: dict[str, Any] = orjson.loads(line[6:])
            if "error" in event:
                result.error = event["error"]["message"]
            elif "finish_reason" in event:
                result.finish_reason = event["finish_reason"]
                result.versions = event["versions"]
                result.num_resumes = event["num_resumes"]
            else:
                result.output_ids.extend(event["output_ids"])
                sink[0] += len(event["output_ids"])
    return result


async def _trainer(client: httpx.AsyncClient, url: str, options: DemoOptions, sink: list[int], log: list[str]) -> None:
    """Publish a new version each time another slice of the expected tokens has streamed."""
    expected = options.requests * options.tokens
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"}
    for version in range(1, options.updates + 1):
        threshold = expected * version // (options.updates + 1)
        while sink[0] < threshold:
            await asyncio.sleep(0.01)  # the demo's trainer polls its own progress counter
        body = {"version": version, "path": checkpoint(version)[0], "mode": options.mode}
        report = (await client.post(f"{url}/admin/weights", json=body, headers=headers)).json()
        log.append(
            f"v{version}: {report.get('mode')} update on {len(report.get('updated', []))} replicas "
            f"in {report.get('duration_s', 0) * 1000:.0f} ms"
        )


def _check(result: DemoResult, options: DemoOptions, shape: ModelShape) -> bool:
    if result.error or result.finish_reason != "length" or len(result.versions) != len(result.output_ids):
        return False
    per_token = [checkpoint(v) for v in result.versions]
    expected = reference_tokens(shape, result.prompt, per_token, options.tokens, ignore_eos=True)
    return expected == result.output_ids and result.versions == sorted(result.versions)


def _dialects(options: DemoOptions) -> list[Literal["vllm", "sglang"]]:
    if options.dialect == "mixed":
        return ["vllm" if i % 2 == 0 else "sglang" for i in range(options.replicas)]
    return [options.dialect] * options.replicas


async def run_demo(options: DemoOptions, console: Console | None = None) -> bool:
    """Run the demo; True when every completion matched its reference and none was lost."""
    console = console or Console()
    shape = ModelShape()
    async with contextlib.AsyncExitStack() as stack:
        sims = []
        for dialect in _dialects(options):
            engine = EngineSettings(token_delay_s=options.token_delay_s, block_size=16 if dialect == "vllm" else 1)
            sims.append(await stack.enter_async_context(serve_in_process(SimServerSettings(dialect, engine))))
        settings = Settings(
            server={"port": 0, "admin_token": ADMIN_TOKEN},
            replicas=[
                ReplicaConfig(url=s.url, backend="sim", dialect=d)
                for s, d in zip(sims, _dialects(options), strict=True)
            ],
        )
        gateway = await stack.enter_async_context(serve_gateway(settings))
        client = await stack.enter_async_context(
            httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=httpx.Limits(max_connections=4096))
        )
        console.print(
            f"[bold]rollout-gateway demo[/]: gateway {gateway.url}, redis {gateway.services.redis_url}, "
            f"{len(sims)} simulator replicas ({', '.join(_dialects(options))})"
        )
        sink = [0]
        log: list[str] = []
        started = time.monotonic()
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tokens"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        ) as progress:
            bar = progress.add_task("generating", total=options.requests * options.tokens)
            trainer = asyncio.create_task(_trainer(client, gateway.url, options, sink, log))
            work = asyncio.gather(*(_generate(client, gateway.url, i, options, sink) for i in range(options.requests)))
            while not work.done():
                progress.update(bar, completed=sink[0])
                await asyncio.wait({work}, timeout=0.1)
            results = work.result()
            await trainer
        elapsed = time.monotonic() - started
        status = (
            await client.get(f"{gateway.url}/admin/status", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        ).json()
    return _summary(console, options, results, log, status, elapsed, shape)


def _summary(
    console: Console,
    options: DemoOptions,
    results: list[DemoResult],
    log: list[str],
    status: dict[str, Any],
    elapsed: float,
    shape: ModelShape,
) -> bool:
    for line in log:
        console.print(f"  trainer published {line}")
    exact = sum(_check(r, options, shape) for r in results)
    spanning = sum(len(set(r.versions)) > 1 for r in results)
    tokens = sum(len(r.output_ids) for r in results)
    lost = sum(r.finish_reason is None for r in results)
    table = Table(title="demo summary")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for name, value in (
        ("completions", f"{len(results)}"),
        ("tokens", f"{tokens} ({tokens / elapsed:,.0f}/s)"),
        ("weight updates", f"{status['updates']} (now v{status['version']}, mode {options.mode})"),
        ("completions spanning an update", f"{spanning}"),
        ("resumes after preemption", f"{sum(r.num_resumes for r in results)}"),
        ("exact vs. reference", f"{exact}/{len(results)}"),
        ("lost", f"{lost}"),
        ("affinity ratio", f"{status['affinity_ratio']:.2f}"),
    ):
        table.add_row(name, value)
    console.print(table)
    ok = exact == len(results) and lost == 0
    console.print(
        "[bold green]OK[/]: nothing lost, every token matches the version that sampled it"
        if ok
        else "[bold red]FAILED[/]: see the table"
    )
    return ok
