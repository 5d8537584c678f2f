"""What the parser tests render through each family's chat template, as calls of the gateway's renderer: a user
prompt with the generation prompt (and with thinking switched off), a system prompt, replies with reasoning (as a
field or in think tags), with tool calls, tool results, two turns, and gpt-oss's harmony conversations.

scripts/parsers/golden_renders.py records what the published templates render for them (goldens/<name>.json);
test_own_templates.py checks that the project's own templates (templates/<name>.jinja) render the same."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tests.gateway.parsers.test_harmony import TOOLS as HARMONY_TOOLS
from tests.gateway.parsers.test_harmony import USER as HARMONY_USER
from tests.gateway.parsers.tool_families import TOOLS

Message = dict[str, Any]


@dataclass(frozen=True)
class Render:
    """One call of the chat template, as the gateway makes it (`gateway.tokenization.chat_template`)."""

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    kwargs: dict[str, Any] | None = None

    def key(self) -> str:
        """The call as text: the same for the same call, recorded or not."""
        return render_key(self.messages, self.tools, self.add_generation_prompt, self.kwargs)


def render_key(messages: Any, tools: Any, add_generation_prompt: bool, kwargs: Any) -> str:
    return json.dumps([messages, tools, add_generation_prompt, kwargs], sort_keys=True, ensure_ascii=False)


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# Ids as Kimi K2 writes them, which are also long enough for Mistral's template (nine characters at least).
ADD_CALL = _call("functions.add:0", "add", {"a": 2, "b": 2})
WEATHER_CALL = _call("functions.get_weather:1", "get_weather", {"city": "Zürich 🏔"})

SYSTEM = {"role": "system", "content": "Answer briefly."}
USER = {"role": "user", "content": "What is 2 + 2?"}
NEXT_USER = {"role": "user", "content": "And 3 + 3?"}
ANSWER = {"role": "assistant", "content": "It is 4."}
REASONED = {"role": "assistant", "content": "It is 4.", "reasoning_content": "Add them."}
REASONED_AGAIN = {"role": "assistant", "content": "It is 6.", "reasoning_content": "Add them again."}
THOUGHT_IN_CONTENT = {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\nIt is 4."}
CALLS = {"role": "assistant", "content": None, "tool_calls": [ADD_CALL]}
REASONED_CALLS = {"role": "assistant", "content": "", "reasoning_content": "Use add.", "tool_calls": [ADD_CALL]}
TWO_CALLS = {"role": "assistant", "content": "Checking both.", "tool_calls": [ADD_CALL, WEATHER_CALL]}
RESULT = {"role": "tool", "tool_call_id": ADD_CALL["id"], "content": "4"}
WEATHER_RESULT = {"role": "tool", "tool_call_id": WEATHER_CALL["id"], "content": "Sunny, 21 °C"}
BARE_RESULT = {"role": "tool", "content": "result"}  # no call before it: the tokenizer's probe of what opens a turn

COMMON = [
    Render([USER]),
    Render([USER], kwargs={"enable_thinking": False}),
    Render([SYSTEM, USER]),
    Render([USER], TOOLS),
    Render([USER, ANSWER], add_generation_prompt=False),
    Render([USER, ANSWER, NEXT_USER]),
    Render([USER, ANSWER, NEXT_USER], add_generation_prompt=False),
    Render([USER, ANSWER, BARE_RESULT], add_generation_prompt=False),
    # Reasoning: which earlier turns keep it.
    Render([USER, REASONED], add_generation_prompt=False),
    Render([USER, REASONED, NEXT_USER]),
    Render([USER, THOUGHT_IN_CONTENT, NEXT_USER]),
    Render([USER, REASONED, NEXT_USER, REASONED_AGAIN], add_generation_prompt=False),
    Render([USER, REASONED, NEXT_USER, REASONED_CALLS, RESULT]),
    # Tool calls: the reply the served tests script, its result, and more.
    Render([USER, CALLS], TOOLS, add_generation_prompt=False),
    Render([USER, CALLS, RESULT], TOOLS),
    Render([USER, REASONED_CALLS, RESULT], TOOLS),
    Render([SYSTEM, USER, TWO_CALLS, RESULT, WEATHER_RESULT], TOOLS),
    Render([USER, CALLS, RESULT, ANSWER, NEXT_USER], TOOLS),
]

_HARMONY_CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
HARMONY = [
    Render(HARMONY_USER),
    Render(HARMONY_USER, HARMONY_TOOLS),
    Render(HARMONY_USER, HARMONY_TOOLS, kwargs={"reasoning_effort": "low"}),
    Render(
        [*HARMONY_USER, {"role": "assistant", "thinking": "Easy: sunny.", "content": "Sunny, 21 °C."}],
        HARMONY_TOOLS,
        add_generation_prompt=False,
    ),
    Render(
        [*HARMONY_USER, {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [_HARMONY_CALL]}],
        HARMONY_TOOLS,
        add_generation_prompt=False,
    ),
    Render(
        [
            *HARMONY_USER,
            {"role": "assistant", "thinking": "Use the tool.", "tool_calls": [_HARMONY_CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21 °C."},
        ],
        HARMONY_TOOLS,
    ),
]

CASES: dict[str, list[Render]] = {
    name: COMMON + (HARMONY if name == "gpt_oss" else [])
    for name in (
        "qwen3",
        "qwen3_coder",
        "deepseek_r1",
        "deepseek_v3",
        "glm45",
        "kimi_k2",
        "llama3_json",
        "mistral",
        "gpt_oss",
    )
}
"""The renders recorded for each template (its name in templates/ and goldens/)."""
