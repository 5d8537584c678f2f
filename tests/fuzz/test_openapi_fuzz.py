"""Schemathesis against the gateway's own OpenAPI schema (agent and admin routes), on a real `rollout-gateway
serve` process over a simulator replica process: no answer may be a 5xx, and every answer must conform to the
schema (status codes, content types, headers, bodies — error bodies included, see gateway/api/openapi.py)."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from backends.sim.server import SimProcess
from tests.cli_helpers import CLI, free_port, wait_for_health

ADMIN_TOKEN = "fuzz-admin-token"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
EXAMPLES_PER_OPERATION = 110
MIN_CASES = 1000
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with SimProcess() as sim:
        port = free_port()
        config: Path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
        # Small bounds keep each generated request cheap; the limits themselves are part of what is fuzzed.
        config.write_text(
            f'server:\n  port: {port}\n  admin_token: "{ADMIN_TOKEN}"\n  max_tokens_limit: 32\n'
            f'redis:\n  url: ""\nmodel:\n  max_model_len: 512\n'
            f"generation:\n  max_wait_s: 5\n  request_timeout_s: 30\n"
            f'replicas:\n  - url: "{sim.url}"\n    backend: sim\n    dialect: vllm\n'
        )
        process = subprocess.Popen(
            [*CLI, "serve", "--config", str(config), "--log-level", "warning"], stderr=subprocess.DEVNULL, text=True
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for_health(process, url, timeout_s=120)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def operations(url: str) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    # POST /admin/pause is left out: a pause without its resume makes every later generation wait, by design.
    found = [result.ok() for result in schema.get_all_operations()]
    return [op for op in found if op.path != "/admin/pause"]


@pytest.mark.timeout(600)
def test_gateway_answers_conform_to_its_schema(gateway_url: str) -> None:
    """Positive and negative cases for every operation (the schemathesis pytest plugin does not load on
    pytest 9, so hypothesis drives each operation's strategy here)."""
    ran: Counter[str] = Counter()
    statuses: Counter[str] = Counter()
    started = time.monotonic()
    ops = operations(gateway_url)
    assert {"/v1/chat/completions", "/generate", "/admin/weights", "/v1/sessions/{session_id}/finish"} <= {
        op.path for op in ops
    }
    for op in ops:
        strategy = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=strategy)
        def run(case: schemathesis.Case) -> None:
            ran[case.operation.label] += 1
            # Raises on the first failed check (a 5xx or a schema violation), so a passing run has none of either.
            response = case.call_and_validate(base_url=gateway_url, headers=ADMIN, checks=CHECKS, timeout=60)
            statuses[f"{response.status_code // 100}xx"] += 1

        run()
    total = sum(ran.values())
    print(
        f"fuzz: {total} cases over {len(ran)} operations in {time.monotonic() - started:.0f}s; answers by status "
        f"{dict(sorted(statuses.items()))}; 5xx 0, schema violations 0 (a failed check fails the test); per "
        f"operation {dict(ran)}"
    )
    assert total >= MIN_CASES
