"""The example agents and the GRPO episode runner, against a real gateway over simulator replicas."""

from __future__ import annotations

import asyncio
import io
import json
from typing import Any

import httpx
import openai
import pytest
from redis.asyncio import Redis
from rich.console import Console

from backends.sim.server import SimReplica
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.embedded_redis import EmbeddedRedis
from gateway.server import RunningGateway
from gateway.tokenization import ChatTokenizer
from gateway.trainer import TrajectoryConsumer
from rollout_agents import math_agent, tool_agent
from rollout_agents.calculator import CalculatorError, evaluate, run_tool
from rollout_agents.episode import EpisodeTrace
from rollout_agents.runner import Runner, gateway_root, main, run
from rollout_agents.session_client import RetryPolicy, retry_after_s
from rollout_agents.tasks import Task, generate_tasks, last_integer, reward
from tests.conftest import GatewayFactory, SimFactory
from tests.sim_helpers import wait_for

TASK = Task(id="t-1", question="3 + 4 * 5", answer=23)
FAST_RETRY = RetryPolicy(max_retries=1000, max_wait_s=0.02)  # the gateway says Retry-After: 5


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.load(TINY_TOKENIZER_DIR)


@pytest.fixture
def console() -> Console:
    return Console(file=io.StringIO(), width=120)


async def gateway_on(
    make_sim: SimFactory, make_gateway: GatewayFactory, **sections: Any
) -> tuple[SimReplica, RunningGateway]:
    sim = await make_sim("vllm")
    return sim, await make_gateway([sim], **sections)


def client_of(gw: RunningGateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)


def answer_ids(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return [*tokenizer.encode(text), tokenizer.end_of_turn_id]


def script_tool_call(
    sim: SimReplica, tokenizer: ChatTokenizer, messages: list[dict[str, Any]], arguments: str
) -> dict[str, Any]:
    """Make the simulator answer `messages` with the template's exact rendering of one calculator call."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": arguments}}],
    }
    prompt = tokenizer.render(messages, tool_agent.TOOLS)
    full = tokenizer.render([*messages, assistant], tool_agent.TOOLS, add_generation_prompt=False)
    reply = full[len(prompt) :]
    sim.engine.add_script(prompt, reply[: reply.index(tokenizer.end_of_turn_id) + 1])
    return assistant


# -- pure parts ------------------------------------------------------------------------------------------------


def test_calculator_evaluates_only_integer_arithmetic() -> None:
    assert evaluate("3 + 4 * (5 - 7)") == -5 and evaluate(" -2 * -3 ") == 6
    for bad in ("__import__('os').system('true')", "2 ** 10", "1 / 2", "1.5 + 1", "True + 1", "x", "", "1 +"):
        with pytest.raises(CalculatorError):
            evaluate(bad)
    with pytest.raises(CalculatorError, match="too large"):
        evaluate("*".join(["999999999"] * 8))
    assert run_tool('{"expression": "6 * 7"}') == ("42", True)
    assert run_tool('{"a": 6, "b": 7, "op": "-"}') == ("-1", True)
    for bad in ("not json", "[1, 2]", '{"a": true, "b": 1, "op": "+"}', '{"a": 1, "b": 2, "op": "^"}', '{"x": 1}'):
        content, ok = run_tool(bad)
        assert not ok and content.startswith("error: "), bad


def test_tasks_are_deterministic_with_known_answers() -> None:
    tasks = generate_tasks(50, seed=7)
    assert tasks == generate_tasks(50, seed=7) != generate_tasks(50, seed=8)
    assert len({t.id for t in tasks}) == 50
    # Our own generated strings: Python's eval is the independent reference for precedence and signs.
    assert all(t.answer == eval(t.question) for t in tasks)
    assert last_integer("so 3 + 4 = 7, then -12.") == -12 and last_integer("none") is None
    assert reward(TASK, "the answer is 23") == 1.0 and reward(TASK, "23 or 24") == 0.0 and reward(TASK, None) == 0.0


def test_base_url_and_retry_after() -> None:
    assert gateway_root("http://h:1/v1/") == gateway_root("http://h:1") == "http://h:1"
    assert retry_after_s("5") == 5.0 and retry_after_s(None) is None and retry_after_s("soon") is None
    past = retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT")
    assert past is not None and past < 0  # an HTTP date in the past: the wait clamps to 0
    assert RetryPolicy(max_wait_s=2.0).wait_s(0, 30.0) == 2.0 and 0 < RetryPolicy().wait_s(5, None) <= 10.0


# -- agents against the gateway --------------------------------------------------------------------------------


async def test_math_agent_reward_from_the_reply(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway)
    api = client_of(gw)
    trace = EpisodeTrace()
    unscripted = await math_agent.episode(api, TASK, session_id="math-0", max_tokens=16, trace=trace)
    assert unscripted == 0.0 and trace.turns == 1 and trace.completion_tokens > 0
    assert last_integer(trace.final_text) != TASK.answer
    prompt = tokenizer.render(math_agent.build_messages(TASK))
    sim.engine.add_script(prompt, answer_ids(tokenizer, "3 + 20 = 23"))
    trace = EpisodeTrace()
    assert await math_agent.episode(api, TASK, session_id="math-1", max_tokens=16, trace=trace) == 1.0
    assert trace.final_text == "3 + 20 = 23"
    await api.close()


async def test_tool_agent_calls_the_calculator_in_one_sample(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer, http: httpx.AsyncClient
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway)
    messages = tool_agent.build_messages(TASK)
    assistant = script_tool_call(sim, tokenizer, messages, json.dumps({"expression": TASK.question}))
    second = [*messages, assistant, {"role": "tool", "tool_call_id": "c1", "content": "23"}]
    sim.engine.add_script(tokenizer.render(second, tool_agent.TOOLS)[-12:], answer_ids(tokenizer, "It is 23."))
    api = client_of(gw)
    trace = EpisodeTrace()
    assert await tool_agent.episode(api, TASK, session_id="tool-1", max_tokens=64, trace=trace) == 1.0
    assert (trace.turns, trace.tool_calls, trace.tool_errors, trace.final_text) == (2, 1, 0, "It is 23.")
    session = (await http.get(f"{gw.url}/v1/sessions/tool-1")).json()
    assert [s["num_turns"] for s in session["samples"]] == [2]  # the whole episode is ONE sample
    await api.close()


async def test_tool_agent_survives_malformed_arguments(
    make_sim: SimFactory, make_gateway: GatewayFactory, tokenizer: ChatTokenizer, http: httpx.AsyncClient
) -> None:
    sim, gw = await gateway_on(make_sim, make_gateway)
    messages = tool_agent.build_messages(TASK)
    arguments = json.dumps({"expression": "__import__('os').system('echo pwned')"})
    assistant = script_tool_call(sim, tokenizer, messages, arguments)
    error, ok = run_tool(arguments)
    assert not ok
    second = [*messages, assistant, {"role": "tool", "tool_call_id": "c1", "content": error}]
    sim.engine.add_script(tokenizer.render(second, tool_agent.TOOLS)[-12:], answer_ids(tokenizer, "Then 23."))
    api = client_of(gw)
    trace = EpisodeTrace()
    assert await tool_agent.episode(api, TASK, session_id="tool-2", max_tokens=64, trace=trace) == 1.0
    assert (trace.turns, trace.tool_calls, trace.tool_errors) == (2, 1, 1)
    session = (await http.get(f"{gw.url}/v1/sessions/tool-2")).json()
    assert [s["num_turns"] for s in session["samples"]] == [2]
    await api.close()


# -- the runner ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agent", ["math", "tool"])
async def test_runner_runs_grpo_groups(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    redis: Redis,
    console: Console,
    agent: Any,
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    summary = await run(
        f"{gw.url}/v1", agent=agent, tasks=3, group_size=4, concurrency=5, seed=3, max_tokens=12, console=console
    )
    assert (summary.episodes, summary.finished, summary.failed) == (12, 12, 0)
    assert summary.completion_tokens > 0 and summary.episodes_per_s > 0 and summary.mean_reward is not None
    assert [(g.size, g.finished) for g in summary.groups] == [(4, 4)] * 3
    assert await redis.xlen("rg:trajectories") == 12
    tasks = generate_tasks(3, seed=3)
    for result in summary.results:
        session = (await http.get(f"{gw.url}/v1/sessions/{result.session_id}")).json()
        assert session["status"] == "finished" and session["reward"] == result.reward
        assert session["metadata"] == {
            "task_id": result.task.id,
            "group_id": result.group_id,
            "group_size": 4,
            "sample_index": result.sample_index,
        }
        assert result.task == tasks[int(result.task.id.removeprefix("task-"))]
    assert sorted((r.group_id, r.sample_index) for r in summary.results) == sorted(
        (g.group_id, i) for g in summary.groups for i in range(4)
    )
    assert len({g.group_id for g in summary.groups}) == 3
    assert "run summary" in console.file.getvalue()  # type: ignore[attr-defined]


async def test_runner_records_failed_episodes_and_goes_on(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient, console: Console
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    summary = await run(gw.url, model="no-such-model", tasks=2, group_size=2, console=console)
    assert (summary.episodes, summary.finished, summary.failed, summary.mean_reward) == (4, 0, 4, None)
    assert all(r.error is not None and r.error.startswith("NotFoundError") for r in summary.failures)
    session = (await http.get(f"{gw.url}/v1/sessions/{summary.results[0].session_id}")).json()
    assert session["status"] == "active"  # never finished with a made-up reward
    assert "failures (first 4 of 4)" in console.file.getvalue()  # type: ignore[attr-defined]


async def test_runner_waits_out_backpressure_then_gives_up_at_its_cap(
    make_sim: SimFactory, make_gateway: GatewayFactory, redis_server: EmbeddedRedis, console: Console
) -> None:
    _, gw = await gateway_on(make_sim, make_gateway, store={"max_pending": 2})
    first = await run(gw.url, tasks=1, group_size=2, max_tokens=8, retry=FAST_RETRY, console=console)
    assert (first.finished, first.throttled) == (2, 0)  # now 2 trajectories wait for the trainer: the limit
    runner = Runner(gw.url, tasks=1, group_size=2, max_tokens=8, retry=FAST_RETRY, console=console)
    running = asyncio.create_task(runner.run())
    await wait_for(lambda: runner.stats.throttled >= 4, what="both episodes to meet backpressure")
    assert runner.stats.done == 0
    async with TrajectoryConsumer(redis_server.url, "trainer", "c1") as consumer:  # the trainer catches up
        batch = await consumer.next_batch(2, timeout=5.0)
        assert len(batch) == 2
        await consumer.ack(batch)
    second = await asyncio.wait_for(running, timeout=20.0)
    assert (second.finished, second.failed) == (2, 0) and second.throttled >= 4
    # Nobody consumes now: with a cap of 3 retries every episode fails cleanly, naming the 429.
    capped = RetryPolicy(max_retries=3, max_wait_s=0.01)
    third = await run(gw.url, tasks=1, group_size=2, max_tokens=8, retry=capped, console=console)
    assert (third.finished, third.failed, third.throttled) == (0, 2, 6)
    assert all("gave up after 3 retries: 429" in (r.error or "") for r in third.failures)


async def test_runner_fails_fast_on_an_unreachable_gateway(console: Console) -> None:
    policy = RetryPolicy(max_transport_retries=2, max_wait_s=0.01)
    summary = await run("http://127.0.0.1:1", tasks=1, group_size=2, retry=policy, console=console)
    assert (summary.finished, summary.failed, summary.throttled) == (0, 2, 0)
    assert all("gave up after 2 retries: ConnectError" in (r.error or "") for r in summary.failures)


async def test_cli_main(make_sim: SimFactory, make_gateway: GatewayFactory, capsys: pytest.CaptureFixture[str]) -> None:
    _, gw = await gateway_on(make_sim, make_gateway)
    argv = ["--base-url", gw.url, "--agent", "tool", "--tasks", "2", "--group-size", "2", "--no-progress"]
    # main() runs its own event loop: give it a thread, as a shell would give it a process.
    assert await asyncio.to_thread(main, [*argv, "--max-tokens", "8"]) == 0
    assert "run summary" in capsys.readouterr().out
