"""An openai-agents SDK agent pointed at the gateway with nothing but a base URL and an API key, for
`test_responses.py`: a tool-using episode of three runs (a tool loop; the history replayed with a new question; a
streamed run continuing the last response by `previous_response_id`). Prints what it saw as JSON.

It runs in a process of its own, started with `python -I`, as an agent process beside the gateway would: the SDK's
package is `agents` (this project's example agents are `rollout_agents`, so that the two install side by side).

Usage: python -I responses_agent.py <base url> <api key>
"""

from __future__ import annotations

import asyncio
import json
import sys

from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

QUESTIONS = ("What is 1 plus 2? Use the tool please.", "Thanks. Now say goodbye.", "Once more, please; thank you.")


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def main(base_url: str, api_key: str) -> None:
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    agent = Agent(
        name="calculator",
        instructions="Use the add tool for sums.",
        tools=[add],
        model=OpenAIResponsesModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(max_tokens=64, temperature=0),
    )
    first = await Runner.run(agent, QUESTIONS[0])
    second = await Runner.run(agent, [*first.to_input_list(), {"role": "user", "content": QUESTIONS[1]}])
    third = Runner.run_streamed(agent, QUESTIONS[2], previous_response_id=second.last_response_id)
    kinds = [event.type async for event in third.stream_events()]
    runs = (first, second, third)
    report = {
        "outputs": [run.final_output for run in runs],
        "responses": [[response.response_id for response in run.raw_responses] for run in runs],
        "tool_outputs": [item.output for item in first.new_items if item.type == "tool_call_output_item"],
        "streamed_events": sorted(set(kinds)),
    }
    print(json.dumps(report))
    await client.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
