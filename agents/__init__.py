"""Example agents written against the official `openai` client, and a concurrent GRPO episode runner.

- `agents.tasks`: deterministic arithmetic tasks with known answers.
- `agents.calculator`: the safe calculator behind the tool agent's `calculator` tool.
- `agents.math_agent`: one chat turn, reward = exact answer match.
- `agents.tool_agent`: multi-turn, OpenAI tool calls to `calculator`, reward = exact answer match.
- `agents.session_client`: the gateway's session routes for an episode runner (create, finish), with bounded retries.
- `agents.runner`: many episodes concurrently in GRPO groups; `python -m agents.runner --help`.

Nothing is imported here, so `python -m agents.runner` does not import its own module twice.
"""
