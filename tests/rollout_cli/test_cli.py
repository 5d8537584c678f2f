"""The `rollout-gateway` command as a user runs it: real child processes, real ports, real signals."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from backends.sim.server import SimProcess
from tests import REPO
from tests.cli_helpers import CLI, free_port, serving, wait_for_health


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


def sim_config(tmp_path: Path, sim: SimProcess, port: int) -> Path:
    """A config file: the gateway on `port` with an embedded Redis, in front of one simulator replica."""
    config = tmp_path / "config.yaml"
    config.write_text(
        f'server:\n  port: {port}\n  admin_token: "t0k"\nredis:\n  url: ""\n'
        f'replicas:\n  - url: "{sim.url}"\n    backend: sim\n    dialect: vllm\n'
    )
    return config


def test_help_lists_commands() -> None:
    result = run_cli("--help")
    assert result.returncode == 0
    for command in ("serve", "sim", "engine", "demo"):
        assert command in result.stdout


def test_sim_help_passes_through() -> None:
    result = run_cli("sim", "--help")
    assert result.returncode == 0
    assert "--dialect" in result.stdout and "--token-delay" in result.stdout


def test_serve_rejects_a_bad_config(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("server:\n  port: 70000\n")
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2
    assert "server.port" in result.stderr


def test_serve_starts_from_config_and_stops_on_sigterm(tmp_path: Path) -> None:
    with SimProcess() as sim:
        port = free_port()
        with serving("--config", str(sim_config(tmp_path, sim, port))) as process:
            url = f"http://127.0.0.1:{port}"
            health = wait_for_health(process, url)
            assert health.json()["replicas"] == {"serving": 1, "total": 1}
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0}}
            assert httpx.post(f"{url}/generate", json=body, timeout=10).json()["finish_reason"] in ("length", "stop")
            process.send_signal(signal.SIGTERM)
            # uvicorn shuts down gracefully, then re-raises the signal so process managers see why it stopped.
            assert process.wait(timeout=20) in (0, -signal.SIGTERM)
            stderr = process.stderr.read() if process.stderr else ""
            assert "Application shutdown complete" in stderr and "Traceback" not in stderr


def test_serve_says_when_its_port_is_taken_before_it_reaches_redis_or_the_engines(tmp_path: Path) -> None:
    # The port is bound first: a taken one is refused at once, and the embedded redis-server never starts (nor can it
    # be handed the gateway's port meanwhile, which a CI run once saw).
    config = tmp_path / "taken.yaml"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        config.write_text(
            f'server:\n  port: {port}\nredis:\n  url: ""\n'
            'replicas:\n  - url: "http://127.0.0.1:9"\n    backend: sim\n    dialect: vllm\n'
        )
        result = run_cli("serve", "--config", str(config))
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "redis-server" not in result.stderr and "Traceback" not in result.stderr


def test_serve_prints_the_embedded_redis_url_at_any_log_level(tmp_path: Path) -> None:
    """The embedded Redis gets a new URL and password every run, and a trainer needs both: `serve` prints the URL
    with its password at start even with `--log-level error`, and a client connects with it; `/admin/status` shows
    the same URL without the password, which alone is refused."""
    import redis

    from gateway.config import without_credentials

    with SimProcess() as sim:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = sim_config(tmp_path, sim, port)
        with serving("--config", str(config), "--log-level", "error") as process:
            wait_for_health(process, url)
            shown = httpx.get(f"{url}/admin/status", headers={"authorization": "Bearer t0k"}, timeout=10).json()
            assert process.stderr is not None
            printed: list[str] = []
            while not printed:  # printed before the gateway answered its first request
                line = process.stderr.readline()
                assert line, "the gateway ended without printing its Redis URL"
                printed = re.findall(r"^rollout-gateway: Redis at (\S+) \(embedded redis-server", line)
            assert without_credentials(printed[0]) == shown["redis_url"] != printed[0]  # the printed one: a password
            with redis.Redis.from_url(printed[0]) as client:
                assert client.ping() is True  # the printed URL is one a trainer can connect to
            with redis.Redis.from_url(shown["redis_url"]) as anonymous:
                with pytest.raises(redis.RedisError, match="authenticated"):
                    anonymous.ping()  # the shown one alone is refused
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=20) in (0, -signal.SIGTERM)
            stderr = process.stderr.read()
    assert "Redis at" not in stderr, stderr  # printed once


@pytest.mark.slow
def test_demo_runs_and_checks_itself() -> None:
    result = run_cli("demo", "--duration", "3", "--update-every", "1", "--concurrency", "16", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "OK" in out
    assert re.search(r"dashboard: http://127\.0\.0\.1:\d+/dashboard\n", out), out[:500]  # said at start
    lost = re.search(r"lost\s*│\s*(\d+)", out)
    updates = re.search(r"weight updates\s*│\s*(\d+)", out)
    spanning = re.search(r"samples spanning an update\s*│\s*(\d+)", out)
    assert lost and lost.group(1) == "0"
    assert updates and int(updates.group(1)) >= 1
    assert spanning and int(spanning.group(1)) >= 1


def test_demo_rejects_bad_flags() -> None:
    result = run_cli("demo", "--dialect", "tgi")
    assert result.returncode == 2
    assert run_cli("demo", "--engine", "tgi").returncode == 2
    by_pigeon = run_cli("demo", "--engine", "vllm", "--weights", "pigeon")
    assert by_pigeon.returncode == 2 and "--weights checkpoint|transfer" in by_pigeon.stderr


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engine_demo_says_how_to_prepare_a_missing_engine(engine: str, tmp_path: Path) -> None:
    """Without the engine's venv the demo stops at once (exit 2), naming what is missing and the setup script."""
    (tmp_path / "models" / "dense").mkdir(parents=True)
    (tmp_path / "models" / "dense" / "config.json").write_text("{}")  # the model is there, the venv is not
    env = {
        **os.environ,
        "RG_ENGINE_MODELS": str(tmp_path / "models"),
        f"RG_{engine.upper()}_PYTHON": str(tmp_path / "no-venv" / "bin" / "python"),
    }
    result = subprocess.run([*CLI, "demo", "--engine", engine], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "no-venv" in result.stderr and "scripts/engines/setup.sh" in result.stderr


async def test_trajectories_stats_and_tail(redis_server: Any, redis: Any) -> None:
    import numpy as np

    from gateway.store import Keys, TrajectoryStore
    from gateway.trajectory import Sample

    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    meta = await store.create_session({"group_id": "g7"}, "cli-session")
    await store.save_sample(meta.id, 0, Sample(prompt_ids=np.array([1, 2, 3], np.int32)))
    await store.finish(meta.id, 0.5)
    stats = await asyncio.to_thread(run_cli, "trajectories", "stats", "--redis-url", redis_server.url)
    assert stats.returncode == 0, stats.stderr
    assert "stream entries" in stats.stdout and "pending" in stats.stdout
    tail = await asyncio.to_thread(run_cli, "trajectories", "tail", "--redis-url", redis_server.url, "-n", "5")
    assert tail.returncode == 0, tail.stderr
    assert "cli-session" in tail.stdout and "g7" in tail.stdout and "True" in tail.stdout
    down = await asyncio.to_thread(run_cli, "trajectories", "stats", "--redis-url", "redis://127.0.0.1:1/0")
    assert down.returncode == 1 and "redis" in down.stderr


def test_serve_starts_from_the_repository_config_yaml() -> None:
    port = free_port()
    env = {**os.environ, "RG_SERVER__PORT": str(port), "RG_ROUTING__HEALTH_TIMEOUT_S": "0.5"}
    config = REPO / "config.yaml"
    with serving("--config", str(config), env=env) as process:
        health = wait_for_health(process, f"http://127.0.0.1:{port}")
        assert health.status_code == 200 and health.json()["replicas"]["total"] == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) in (0, -signal.SIGTERM)
        assert "Application shutdown complete" in (process.stderr.read() if process.stderr else "")


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (state 0A in /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    found.add(fields[9])
    return found


def socket_inodes(pid: int) -> set[str]:
    """Inodes of the sockets a process holds open."""
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                found.add(target[8:-1])
    return found


def test_serve_workers_share_one_port_and_one_redis(tmp_path: Path) -> None:
    """`serve --workers 2`: two processes answer on one port, a weight update reaches both, SIGTERM stops all."""
    admin = {"authorization": "Bearer t0k"}
    with SimProcess() as sim:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        config = sim_config(tmp_path, sim, port)
        with serving("--config", str(config), "--workers", "2", "--log-level", "warning") as process:
            wait_for_health(process, url)

            answered: Counter[int] = Counter()

            def statuses(attempts: int) -> dict[int, int]:
                """pid -> weight version, over `attempts` fresh connections (the kernel spreads them)."""
                seen: dict[int, int] = {}
                for _ in range(attempts):
                    status = httpx.get(f"{url}/admin/status", headers=admin, timeout=10).json()
                    seen[status["pid"]] = status["version"]
                    answered[status["pid"]] += 1
                return seen

            assert len(statuses(200)) == 2, "both workers answer on the one port"
            assert min(answered.values()) >= 60, answered  # an even split: 100 ± 7 each
            if sys.platform.startswith("linux"):
                # Each worker listens on a socket of its own (SO_REUSEPORT: the kernel hashes new connections over
                # them, whatever each worker is busy with); the supervisor holds none once they started.
                listening = listening_inodes(port)
                held = {pid: socket_inodes(pid) & listening for pid in [*answered, process.pid]}
                assert len(listening) == 2 and held[process.pid] == set(), held
                assert sorted(len(inodes) for inodes in held.values()) == [0, 1, 1], held
                assert set().union(*held.values()) == listening, held
            body = {"input_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0}}
            assert httpx.post(f"{url}/generate", json=body, timeout=10).json()["finish_reason"] == "length"
            relabel = {"version": 3, "source": "external"}  # no checkpoint: the simulator's weights, relabelled
            update = httpx.post(f"{url}/admin/weights", json=relabel, headers=admin, timeout=30)
            assert update.status_code == 200, update.text
            deadline = time.monotonic() + 20
            while set(statuses(50).values()) != {3}:  # the other worker follows through Redis
                assert time.monotonic() < deadline, "the other worker never adopted version 3"
            # The dashboard: whichever worker answers shows the turn and the update, both done by one of them (each
            # worker merges the other's per-second points from Redis).
            feeds: dict[str, tuple[int, list[int]]] = {}
            while sum(feed == (1, [3]) for feed in feeds.values()) < 2:
                assert time.monotonic() < deadline + 20, feeds
                state = httpx.get(f"{url}/dashboard/state", timeout=10).json()
                feeds[state["worker"]] = (sum(state["series"]["turns"]), [e["version"] for e in state["timeline"]])
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            stderr = process.stderr.read() if process.stderr else ""
            assert "Traceback" not in stderr, stderr
            # The supervisor started the one embedded Redis the workers share, and printed its URL once.
            assert len(re.findall(r"^rollout-gateway: Redis at \S+ \(embedded", stderr, re.MULTILINE)) == 1, stderr
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{url}/health", timeout=2)
