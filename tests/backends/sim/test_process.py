"""Simulator replicas as real child processes (`python -m backends.sim`, driven through `SimProcess`).

What only a separate process can show: the CLI's listening line and exit statuses, a crash or SIGKILL that resets
in-flight connections, a restart on the same port, and the start-up flags. The tests are synchronous: SimProcess
blocks (it reads the child's stdout), and a blocking `httpx.Client` keeps the stream-then-interrupt flows linear.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import orjson
import pytest

from backends.sim.model import ModelShape
from backends.sim.reference import reference_tokens
from backends.sim.server import SimProcess

SHAPE = ModelShape()  # the CLI's defaults
INIT = ("init", "default")
PROMPT = [5, 100, 200, 300, 400, 500, 600, 700]
LONG = 4000  # at --token-delay 0.002 a stream of this length runs ~8 s: always still in flight when interrupted
CONNECTION_LOST = (httpx.RemoteProtocolError, httpx.ReadError)

DIALECTS = [
    pytest.param("vllm", id="vllm"),
    # sglang_app.py is written separately; its cases skip (not fail) until it imports.
    pytest.param("sglang", id="sglang"),
]

Spawn = Callable[..., SimProcess]


def needs_dialect(dialect: str) -> None:
    if dialect == "sglang":
        pytest.importorskip("backends.sim.sglang_app", reason="the SGLang dialect (backends/sim/sglang_app.py)")


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start replicas in child processes; every one is stopped (and its pipe closed) after the test."""
    processes: list[SimProcess] = []

    def start(*args: str) -> SimProcess:
        process = SimProcess(args)
        processes.append(process)  # before start(): a failed start still has a pipe to close
        return process.start()

    try:
        yield start
    finally:
        for process in processes:
            process.stop()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=httpx.Timeout(10.0)) as http:
        yield http


def poll_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll a condition on a real process (bounded); the short sleep is the poll interval, not a synchronisation."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


# -- the two dialects' generate calls ---------------------------------------------------------------------------


def generate_call(
    dialect: str, max_tokens: int, *, stream: bool = False, temperature: float = 0.0, seed: int | None = None
) -> tuple[str, dict[str, Any]]:
    if dialect == "vllm":
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if seed is not None:
            body["seed"] = seed
        return "/v1/completions", body
    sampling: dict[str, Any] = {"max_new_tokens": max_tokens, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        sampling["sampling_seed"] = seed
    return "/generate", {"input_ids": PROMPT, "sampling_params": sampling, "stream": stream}


def output_of(dialect: str, body: dict[str, Any]) -> tuple[list[int], Any]:
    """(output token ids, finish reason) of a non-streamed response or of one stream event."""
    if dialect == "vllm":
        choice = body["choices"][0]
        return list(choice["token_ids"]), choice["finish_reason"]
    return list(body["output_ids"]), body["meta_info"]["finish_reason"]


def generate(client: httpx.Client, url: str, dialect: str, max_tokens: int, **kwargs: Any) -> list[int]:
    path, body = generate_call(dialect, max_tokens, **kwargs)
    response = client.post(f"{url}{path}", json=body)
    assert response.status_code == 200, response.text
    tokens, finish = output_of(dialect, response.json())
    assert finish in ("length", {"type": "length", "length": max_tokens})
    return tokens


def sse_events(response: httpx.Response) -> Iterator[Any]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            if data == "[DONE]":
                return
            yield orjson.loads(data)


def interrupted_stream(client: httpx.Client, url: str, dialect: str, interrupt: Callable[[], None]) -> list[int]:
    """Stream a long greedy generation, call `interrupt` once 20 tokens arrived, and require the stream to break
    with a connection error (never a finish reason, never `[DONE]`). Returns the tokens received before."""
    path, body = generate_call(dialect, LONG, stream=True)
    tokens: list[int] = []
    interrupted = False
    with pytest.raises(CONNECTION_LOST), client.stream("POST", f"{url}{path}", json=body) as response:
        assert response.status_code == 200
        for event in sse_events(response):
            chunk, finish = output_of(dialect, event)
            assert finish is None, f"the stream finished cleanly ({finish}) instead of breaking"
            tokens = chunk if dialect == "sglang" else tokens + chunk  # SGLang chunks are cumulative
            if len(tokens) >= 20 and not interrupted:
                interrupted = True
                interrupt()
    assert interrupted, "the stream broke before it could be interrupted"
    return tokens


def assert_serves_reference(url: str, dialect: str) -> None:
    """Greedy and seeded outputs equal the offline reference (fresh client: the old pool's sockets are dead)."""
    with httpx.Client(timeout=httpx.Timeout(10.0)) as fresh:
        assert fresh.get(f"{url}/health").status_code == 200
        assert generate(fresh, url, dialect, 32) == reference_tokens(SHAPE, PROMPT, INIT, 32, ignore_eos=True)
        seeded = generate(fresh, url, dialect, 32, temperature=1.0, seed=7)
        assert seeded == reference_tokens(SHAPE, PROMPT, INIT, 32, seed=7, temperature=1.0, ignore_eos=True)


# -- the CLI ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_cli_prints_listening_line_and_serves(dialect: str, client: httpx.Client) -> None:
    needs_dialect(dialect)
    command = [sys.executable, "-m", "backends.sim", "--port", "0", "--dialect", dialect]
    with subprocess.Popen(command, stdout=subprocess.PIPE) as process:
        try:
            assert process.stdout is not None
            event = json.loads(process.stdout.readline())  # the first stdout line, once the socket listens
            assert event == {"event": "listening", "host": "127.0.0.1", "port": event["port"], "dialect": dialect}
            assert isinstance(event["port"], int) and event["port"] > 0
            url = f"http://127.0.0.1:{event['port']}"
            assert client.get(f"{url}/health").status_code == 200
            state = client.get(f"{url}/sim/state").json()
            assert state["weights"] == "init" and state["version"] == "default" and state["ready"] is True
            assert generate(client, url, dialect, 8) == reference_tokens(SHAPE, PROMPT, INIT, 8, ignore_eos=True)
        finally:
            process.terminate()
            process.wait(10)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--top-k", "0", "--experts", "8"], "top_k must be in [1, num_experts]"),
        (["--eos-token-id", "99999"], "eos_token_id must be inside the vocabulary"),
        (["--eos-prob", "1.5"], "eos_prob must be in [0, 1)"),
        (["--dialect", "tgi"], "invalid choice: 'tgi'"),
    ],
)
def test_bad_flag_exits_with_status_2(args: list[str], needle: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "backends.sim", "--port", "0", *args], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert needle in result.stderr and result.stderr.startswith(("rollout-gateway sim: ", "usage: "))
    assert "listening" not in result.stdout


def test_sim_process_reports_a_failed_start(spawn: Spawn) -> None:
    with pytest.raises(RuntimeError, match="exited with 2 before listening"):
        spawn("--eos-token-id", "99999")


# -- crash, kill, restart, stop ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_crash_fault_breaks_streams_and_restart_serves_again(dialect: str, spawn: Spawn, client: httpx.Client) -> None:
    needs_dialect(dialect)
    sim = spawn("--dialect", dialect, "--token-delay", "0.002")
    port = sim.port

    def crash() -> None:
        response = client.post(f"{sim.url}/sim/faults", json={"crash": True})
        assert response.status_code == 200 and response.json() == {"status": "crashing"}  # answered, then dies

    received = interrupted_stream(client, sim.url, dialect, crash)
    assert received == reference_tokens(SHAPE, PROMPT, INIT, len(received), ignore_eos=True)
    assert sim.process is not None and sim.process.wait(10) == 1  # os._exit(1): no shutdown ran
    with pytest.raises(httpx.ConnectError):
        client.get(f"{sim.url}/health")
    sim.restart()
    assert sim.port == port
    assert_serves_reference(sim.url, dialect)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_sigkill_breaks_streams_and_restart_takes_the_same_port(
    dialect: str, spawn: Spawn, client: httpx.Client
) -> None:
    needs_dialect(dialect)
    sim = spawn("--dialect", dialect, "--token-delay", "0.002")
    port, first_pid = sim.port, sim.pid
    received = interrupted_stream(client, sim.url, dialect, sim.kill)
    assert received == reference_tokens(SHAPE, PROMPT, INIT, len(received), ignore_eos=True)
    assert sim.process is not None and sim.process.returncode == -signal.SIGKILL
    sim.restart()
    assert sim.port == port and sim.pid != first_pid
    assert_serves_reference(sim.url, dialect)


def test_sigterm_stop_mid_stream_drains_then_exits(spawn: Spawn, client: httpx.Client) -> None:
    # One dialect is enough: the drain is uvicorn's (cli.serve), and it costs the 2 s graceful timeout.
    dialect = "vllm"
    sim = spawn("--dialect", dialect, "--token-delay", "0.002")
    assert generate(client, sim.url, dialect, 4) == reference_tokens(SHAPE, PROMPT, INIT, 4, ignore_eos=True)
    with ThreadPoolExecutor(1) as pool:
        stopping: list[Any] = []
        started = time.monotonic()
        # uvicorn stops accepting, lets in-flight responses run for timeout_graceful_shutdown (2 s), then cancels
        # them: a stream longer than that is cut, never finished with an abort.
        received = interrupted_stream(client, sim.url, dialect, lambda: stopping.append(pool.submit(sim.stop)))
        stopping[0].result(timeout=15)
        elapsed = time.monotonic() - started
    assert received == reference_tokens(SHAPE, PROMPT, INIT, len(received), ignore_eos=True)
    assert 20 < len(received) < LONG
    # The graceful path, not stop()'s SIGKILL fallback: uvicorn (>= 0.29) re-raises the captured SIGTERM once
    # shutdown completes, so the child ends by the signal's default action: -SIGTERM, not exit status 0.
    assert sim.process is not None and sim.process.returncode == -signal.SIGTERM
    assert elapsed < 8.0
    with pytest.raises(httpx.ConnectError):
        client.get(f"{sim.url}/health")


@pytest.mark.parametrize("dialect", DIALECTS)
def test_sigterm_stop_when_idle_is_quick(dialect: str, spawn: Spawn, client: httpx.Client) -> None:
    needs_dialect(dialect)
    sim = spawn("--dialect", dialect)
    assert client.get(f"{sim.url}/health").status_code == 200
    started = time.monotonic()
    sim.stop()
    assert time.monotonic() - started < 2.0  # nothing in flight: no graceful-timeout wait
    assert sim.process is not None and sim.process.returncode == -signal.SIGTERM
    sim.stop()  # idempotent


# -- start-up flags ---------------------------------------------------------------------------------------------


def test_startup_delay_answers_503_then_200(spawn: Spawn, client: httpx.Client) -> None:
    sim = spawn("--startup-delay", "1.5")
    first = client.get(f"{sim.url}/health")
    assert first.status_code == 503
    assert first.json()["error"]["type"] == "ServiceUnavailableError"
    assert first.json()["error"]["message"] == "server is starting"
    assert client.get(f"{sim.url}/sim/state").json()["ready"] is False  # /sim/* bypasses the faults
    path, body = generate_call("vllm", 4)
    assert client.post(f"{sim.url}{path}", json=body).status_code == 503
    poll_until(lambda: client.get(f"{sim.url}/health").status_code == 200, what="/health 200 after the delay")
    assert client.get(f"{sim.url}/sim/state").json()["ready"] is True
    assert generate(client, sim.url, "vllm", 4) == reference_tokens(SHAPE, PROMPT, INIT, 4, ignore_eos=True)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_error_rate_one_answers_500(dialect: str, spawn: Spawn, client: httpx.Client) -> None:
    needs_dialect(dialect)
    sim = spawn("--dialect", dialect, "--error-rate", "1")
    assert client.get(f"{sim.url}/sim/state").json()["error_rate"] == 1.0
    path, body = generate_call(dialect, 4)
    for _ in range(3):
        response = client.post(f"{sim.url}{path}", json=body)
        assert response.status_code == 500
        assert response.json()["error"]["message"] == "injected fault: internal server error"
    assert client.get(f"{sim.url}/health").status_code == 200  # only generation fails
    assert client.post(f"{sim.url}/sim/faults", json={"error_rate": 0.0}).json()["status"] == "ok"
    assert generate(client, sim.url, dialect, 4) == reference_tokens(SHAPE, PROMPT, INIT, 4, ignore_eos=True)


def test_paused_new_requests_reject_gives_503(spawn: Spawn, client: httpx.Client) -> None:
    sim = spawn("--paused-new-requests", "reject")
    assert client.post(f"{sim.url}/pause", params={"mode": "abort"}).json() == {"status": "paused"}
    state = client.get(f"{sim.url}/sim/state").json()
    assert state["paused"] is True and state["pause_mode"] == "abort"
    path, body = generate_call("vllm", 4)
    response = client.post(f"{sim.url}{path}", json=body)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "ServiceUnavailableError" and response.json()["error"]["code"] == 503
    assert client.get(f"{sim.url}/sim/state").json()["held"] == 0  # rejected, not held
    assert client.post(f"{sim.url}/resume").json() == {"status": "resumed"}
    assert generate(client, sim.url, "vllm", 4) == reference_tokens(SHAPE, PROMPT, INIT, 4, ignore_eos=True)


def test_no_dev_mode_hides_the_rl_routes(spawn: Spawn, client: httpx.Client) -> None:
    sim = spawn("--no-dev-mode")
    for path in ("/pause", "/resume", "/collective_rpc", "/update_weight_version"):
        assert client.post(f"{sim.url}{path}", json={}).status_code == 404, path
    assert client.get(f"{sim.url}/is_paused").status_code == 404
    assert client.get(f"{sim.url}/health").status_code == 200
    assert generate(client, sim.url, "vllm", 4) == reference_tokens(SHAPE, PROMPT, INIT, 4, ignore_eos=True)
