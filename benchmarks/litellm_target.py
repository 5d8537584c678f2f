"""LiteLLM's proxy as a target of `benchmarks.compare`: the Python gateway a user would otherwise put in front of
OpenAI-compatible engines for OpenAI and Anthropic clients.

It runs from its own venv (`scripts/bench/litellm_setup.sh`: `litellm[proxy]` pins many packages, so it is never in
the project's), as `<venv>/bin/litellm --config <tmp yaml>`, one process (uvicorn, one worker). Its model list names
the gateway's model (`tiny`) twice, one deployment per simulator replica, through `benchmarks/chat_front.py` (the
replicas serve no chat route; the front is a process of its own, so its CPU is not LiteLLM's). It serves
`/v1/chat/completions`, `/v1/messages` and `/v1/responses` itself, each translated to a chat completion of the
engine (`use_chat_completions_url_for_anthropic_messages`, `use_chat_completions_api`: the `openai` provider would
otherwise send Messages and Responses to the engine's own `/v1/responses`, which vLLM has and the simulator has not).

Run lean and offline: no database (spend logs off), no master key (the gateway's agent routes are open too),
telemetry off, message logging off, no admin UI or docs routes, the bundled model cost map
(`LITELLM_LOCAL_MODEL_COST_MAP`: no fetch at start), log level ERROR. Routing is LiteLLM's default `simple-shuffle`:
not sticky, so a session's turns land on either replica (see the affinity column).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks._harness import BenchmarkError, free_port, log_tail, pinned, terminate

REPO_ROOT = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = "scripts/bench/litellm_setup.sh"


def litellm_venv() -> Path:
    """Where `scripts/bench/litellm_setup.sh` installs LiteLLM (`RG_LITELLM_VENV` overrides)."""
    if os.environ.get("RG_LITELLM_VENV"):
        return Path(os.environ["RG_LITELLM_VENV"])
    cache = os.environ.get("RG_ENGINE_CACHE") or str(Path.home() / ".cache" / "rollout-gateway")
    return Path(cache) / "litellm-venv"


def litellm_missing() -> str | None:
    """Why the LiteLLM targets cannot run here, or None where they can."""
    venv = litellm_venv()
    if not (venv / ".complete").exists() or not (venv / "bin" / "litellm").exists():
        return f"no LiteLLM venv at {venv} (run {SETUP_SCRIPT})"
    return None


def litellm_config(front_url: str, replicas: int) -> dict[str, Any]:
    """The proxy's config: `tiny` once per replica (through the chat front's `/r{i}/v1`), nothing else on."""
    deployment = {"model": "openai/tiny", "api_key": "bench", "use_chat_completions_api": True}
    return {
        "model_list": [
            {"model_name": "tiny", "litellm_params": {**deployment, "api_base": f"{front_url}/r{i}/v1"}}
            for i in range(replicas)
        ],
        "litellm_settings": {
            "telemetry": False,
            "turn_off_message_logging": True,
            "use_chat_completions_url_for_anthropic_messages": True,
            "request_timeout": 600,
        },
        "general_settings": {"disable_spend_logs": True, "dangerously_permit_weak_or_unset_master_key": True},
    }


LITELLM_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOG": "ERROR",
    "DISABLE_ADMIN_UI": "True",
    "NO_DOCS": "True",
}


@dataclass
class _Child:
    """A child process with its log, pinned to `cpus`, stopped with SIGTERM (SIGKILL after 10 s)."""

    name: str
    command: list[str]
    cpus: set[int] | None
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self, log_dir: Path) -> None:
        self.log = log_dir / f"{self.name}.log"
        env = {**os.environ, **self.env}
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=pinned(self.cpus), env=env, cwd=log_dir
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log, lines)

    def stop(self) -> None:
        terminate(self.process)


class LiteLLMProcess:
    """LiteLLM's proxy (pinned to `cpus`) and the chat front it reaches the replicas through (pinned to
    `front_cpus`, beside the replicas); `start` returns once a chat completion goes through."""

    def __init__(self, replica_urls: list[str], cpus: set[int] | None, front_cpus: set[int] | None) -> None:
        self.replica_urls = replica_urls
        self.front_port, self.port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        front = [sys.executable, str(REPO_ROOT / "benchmarks" / "chat_front.py"), "--port", str(self.front_port)]
        self.front = _Child(
            "chat-front", [*front, "--worker-urls", *replica_urls], front_cpus, {"PYTHONPATH": str(REPO_ROOT)}
        )
        command = [str(litellm_venv() / "bin" / "litellm"), "--host", "127.0.0.1", "--port", str(self.port)]
        self.proxy = _Child("litellm", command, cpus, LITELLM_ENV)

    @property
    def pid(self) -> int | None:
        return self.proxy.process.pid if self.proxy.process else None

    def start(self, log_dir: Path, timeout_s: float = 120.0) -> LiteLLMProcess:
        config = log_dir / "litellm.yaml"
        front_url = f"http://127.0.0.1:{self.front_port}"
        config.write_text(yaml.safe_dump(litellm_config(front_url, len(self.replica_urls))))
        self.proxy.command += ["--config", str(config)]
        self.front.start(log_dir)
        self.proxy.start(log_dir)
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        # Ready = a chat completion goes through both hops (LiteLLM's import and startup take several seconds).
        deadline = time.monotonic() + timeout_s
        body = {"model": "tiny", "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
        with httpx.Client(timeout=10.0) as client:
            while time.monotonic() < deadline and self.proxy.alive() and self.front.alive():
                with contextlib.suppress(httpx.HTTPError):
                    if client.post(f"{self.url}/v1/chat/completions", json=body).status_code == 200:
                        return
                time.sleep(0.5)
        raise BenchmarkError(
            f"LiteLLM did not become ready:\n{self.proxy.log_tail()}\nchat front:\n{self.front.log_tail()}"
        )

    def stop(self) -> None:
        self.proxy.stop()
        self.front.stop()
