"""Whether a chat template's turns can go on from tokens (`check_template`), and the history a gateway runs with
(`token_history_for`): `tokens` where the template passes for a verified family, else `template` with a warning,
or a refusal to start where `tokens` was asked for explicitly."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import ConfigError, InvalidRequest
from gateway.history.anchor import anchored, reply_tail
from gateway.history.suffix import TokenHistory, turn_end_texts, writes_all
from gateway.tokenization import ChatTokenizer

Message = dict[str, Any]
Tool = dict[str, Any]
# What `check_template` renders with: messages, tools, add_generation_prompt, the template's arguments -> text.
Render = Callable[[Sequence[Message], Sequence[Tool] | None, bool, Mapping[str, Any] | None], str]

__all__ = ["SCENARIOS", "TOOLS", "HistoryCheck", "check_template", "token_history_for"]

logger = logging.getLogger(__name__)

TOOLS: list[Tool] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _call(call_id: str, city: str) -> dict[str, Any]:
    arguments = f'{{"city": "{city}"}}'
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


_ASK = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Paris?"}]
# Tool call ids as Mistral's templates want them: nine letters or digits.
_ONE_CALL = {"role": "assistant", "content": "", "tool_calls": [_call("call00001", "Paris")]}
_TWO_CALLS = {
    "role": "assistant",
    "content": "",
    "tool_calls": [_call("call00001", "Paris"), _call("call00002", "Rome")],
}
_ANSWER = {"role": "assistant", "content": "Sunny, 18 C."}

# name -> (conversation up to and including a reply, the messages that follow it): what a template must render the
# same way after any reply. A template may refuse some (Llama 3's: one tool call a reply; Mistral's: no system
# message after the first; DeepSeek-R1's: arguments as an object), not a user message.
SCENARIOS: dict[str, tuple[list[Message], list[Message]]] = {
    "tool_result": ([*_ASK, _ONE_CALL], [{"role": "tool", "tool_call_id": "call00001", "content": "18 C, sunny"}]),
    "user": ([*_ASK, _ANSWER], [{"role": "user", "content": "And Rome?"}]),
    "tool_results": (
        [*_ASK, _TWO_CALLS],
        [
            {"role": "tool", "tool_call_id": "call00001", "content": "18 C"},
            {"role": "tool", "tool_call_id": "call00002", "content": "21 C"},
        ],
    ),
    "system_reminder": (
        [*_ASK, _ANSWER],
        [{"role": "system", "content": "Reminder: answer briefly."}, {"role": "user", "content": "And Rome?"}],
    ),
}
_REQUIRED = ("user",)  # a template that refuses tool calls in a history refuses them in either mode
_REASONING = "The user wants the weather."


@dataclass
class HistoryCheck:
    """What `check_template` found: the suffix each scenario gives (None: the template refused it, or writes one of
    its new messages elsewhere: `unwritten`) and the problems that keep the template from `tokens` mode (none: it
    passes)."""

    suffixes: dict[str, str | None] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    unwritten: list[str] = field(default_factory=list)


def check_template(
    render: Render,
    end_texts: Sequence[str],
    next_turn_texts: Sequence[str],
    template_kwargs: Mapping[str, Any] | None = None,
) -> HistoryCheck:
    """Render each scenario with its reply marked (`anchored`), without and with reasoning, and cut what follows
    the reply (`reply_tail`): a template passes when that text is found for both and is the same (what follows a
    reply does not depend on it), for every scenario it renders and at least tool results and a user message."""
    check = HistoryCheck()
    for name, (conversation, new) in SCENARIOS.items():
        tails: set[str | None] = set()
        try:
            for reasoning in (None, _REASONING):
                text = render([*anchored(conversation, reasoning=reasoning), *new], TOOLS, True, template_kwargs)
                tails.add(reply_tail(text, end_texts, next_turn_texts))
        except InvalidRequest as refused:
            check.suffixes[name] = None
            if name in _REQUIRED:
                check.problems.append(f"{name}: the template refuses it ({refused})")
            continue
        (tail,) = tails if len(tails) == 1 else (None,)
        if tail is not None and not writes_all(tail, new):
            check.unwritten.append(name)  # those turns go the template's way (`TokenHistory.suffix_text`)
            tail = None
        check.suffixes[name] = tail
        if None in tails:
            check.problems.append(f"{name}: no end of the reply in the template's text")
        elif len(tails) > 1:
            check.problems.append(f"{name}: what follows a reply depends on the reply's reasoning")
    return check


HistoryMode = Literal["tokens", "template"]


def token_history_for(
    tokenizer: ChatTokenizer,
    family: str | None,
    mode: HistoryMode,
    *,
    explicit: bool,
    template_kwargs: Mapping[str, Any] | None = None,
) -> TokenHistory | None:
    """The token history the gateway runs with: None for `template` mode. `tokens` needs a verified family
    (`family_of`), a tokenizer whose text after a stop token is tokenized alone (`TextPath`) and a template that
    passes `check_template`; without them the gateway warns and runs in `template` mode, or, where `tokens` was
    set explicitly (`explicit`), refuses to start with the reason."""
    if mode == "template":
        return None
    reason = _why_not(tokenizer, family, template_kwargs)
    if reason is None:
        assert family is not None
        return TokenHistory(
            tokenizer,
            family,
            checked=template_kwargs,
            check=lambda kwargs: not _checked(tokenizer, kwargs).problems,
        )
    message = f"sessions.history: tokens is not available for this chat template: {reason}"
    if explicit:
        raise ConfigError(f"{message}; set sessions.history: template")
    logger.warning("%s; running in template mode (one sample per turn where the template rewrites history)", message)
    return None


def _why_not(tokenizer: ChatTokenizer, family: str | None, template_kwargs: Mapping[str, Any] | None) -> str | None:
    if family is None:
        return "its family (model.reasoning_parser, else model.tool_parser) has no verified suffix rule"
    if not tokenizer.text_path.stop_texts:
        return "the tokenizer does not tokenize the text after a stop token on its own (no text path)"

    check = _checked(tokenizer, template_kwargs)
    if check.problems:
        return f"the {family} family's rule does not hold for it: " + "; ".join(check.problems)
    return None


def _checked(tokenizer: ChatTokenizer, template_kwargs: Mapping[str, Any] | None) -> HistoryCheck:
    """`check_template` on the tokenizer's template, under `template_kwargs`."""

    def render(
        messages: Sequence[Message], tools: Sequence[Tool] | None, generation: bool, kwargs: Mapping[str, Any] | None
    ) -> str:
        return tokenizer.render_text(messages, tools, generation, chat_template_kwargs=kwargs)

    return check_template(render, *turn_end_texts(tokenizer), template_kwargs)
