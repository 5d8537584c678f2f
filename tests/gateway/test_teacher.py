"""A teacher pool (`pools[i].role: teacher`, issue 54 §3): it scores the samples of the policies that name it
(`pools[i].teacher`) and serves no agent."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.config import ReplicaConfig, load_config
from gateway.errors import ConfigError
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import generate_body


def pool(model: str, sim: Any, **extra: Any) -> dict[str, Any]:
    return {"model": model, "replicas": [ReplicaConfig(url=sim.url, backend="sim", dialect=sim.dialect)]} | extra


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


async def test_a_teacher_pool_serves_no_agent_and_the_policy_is_the_default_model(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    student, teacher = await make_sim("vllm"), await make_sim("sglang")
    gw = await make_gateway(
        [], pools=[pool("student", student, teacher={"model": "teacher"}), pool("teacher", teacher, role="teacher")]
    )
    models = (await http.get(f"{gw.url}/v1/models")).json()
    assert [card["id"] for card in models["data"]] == ["student"]
    refused = await http.post(f"{gw.url}/v1/chat/completions", json=chat("teacher"))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "model"
    assert "`teacher` is a teacher" in refused.json()["error"]["message"]
    assert "`student`" in refused.json()["error"]["message"]
    answer = await http.post(f"{gw.url}/generate", json=generate_body([5, 6, 7], 4))  # no model: the one policy
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["output_ids"]) == 4
    assert (
        student.engine.total_counters()["generation_tokens"],
        teacher.engine.total_counters()["generation_tokens"],
    ) == (4, 0)


def test_a_teacher_is_validated_naming_what_is_wrong() -> None:
    replica = {"url": "http://127.0.0.1:9", "backend": "sim"}
    teacher = {"model": "t", "role": "teacher", "replicas": [replica]}
    cases = {
        r"pools\[0\]\.teacher names 'u', which is no teacher pool \(the teacher pools: 't'\)": [
            {"model": "p", "teacher": {"model": "u"}},
            teacher,
        ],
        r"pools\[0\]\.teacher names 'p2', which is no teacher pool": [
            {"model": "p", "teacher": {"model": "t", "by_metadata": "task", "models": {"code": "p2"}}},
            {"model": "p2"},
            teacher,
        ],
        r"pools\[1\] \('t'\) is a teacher: it has no teacher of its own": [
            {"model": "p"},
            teacher | {"teacher": {"model": "t"}},
        ],
        r"top_k": [{"model": "p", "teacher": {"model": "t", "top_k": 21}}, teacher],
    }
    for expected, pools in cases.items():
        with pytest.raises(ConfigError, match=expected):
            load_config(pools=pools)
