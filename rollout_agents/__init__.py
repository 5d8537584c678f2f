"""Example agents written against the official `openai` client, and a concurrent GRPO episode runner.

- `rollout_agents.tasks`: deterministic arithmetic tasks with known answers.
- `rollout_agents.calculator`: the safe calculator behind the tool agent's `calculator` tool.
- `rollout_agents.math_agent`: one chat turn, reward = exact answer match.
- `rollout_agents.tool_agent`: multi-turn, OpenAI tool calls to `calculator`, reward = exact answer match.
- `rollout_agents.session_client`: the gateway's session routes for an episode runner (create, finish), with
  bounded retries.
- `rollout_agents.runner`: many episodes concurrently in GRPO groups; `python -m rollout_agents.runner --help`.

Nothing is imported here, so `python -m rollout_agents.runner` does not import its own module twice.
"""
