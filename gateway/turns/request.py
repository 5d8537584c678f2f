"""What a turn asks for, in the domain's own terms: every protocol adapter (OpenAI chat and completions, Anthropic
Messages, OpenAI Responses, `POST /generate`) maps its validated body to a `TurnRequest`, and the turn knows
nothing of their shapes (docs/architecture.md §7).

The bounds of each field (an int32 budget, an int64 seed, ...) are the adapters' (`gateway.api.bounds`): a request
here is valid already.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INT64_MIN",
    "Conversation",
    "Sampling",
    "TextPrompt",
    "TokenPrompt",
    "TurnRequest",
    "template_kwargs_of",
    "wrapped_seed",
]

INT64_MIN = -(2**63)

Message = dict[str, Any]
Tool = dict[str, Any]


def wrapped_seed(seed: int) -> int:
    """`seed` wrapped into the signed 64-bit range (the seed of choice i of n is the request's seed + i)."""
    return (seed - INT64_MIN) % 2**64 + INT64_MIN


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a turn samples each of its `n` choices. `max_tokens` None: what the context leaves after the prompt.
    `stop`: stop strings (empty ones left out); `top_logprobs`: alternatives per token (0: none); `min_p` and the
    penalties None: left out of the engine request (the engine's default)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    top_logprobs: int = 0
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int = 1


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat turn's prompt: its messages in the chat template's form (OpenAI field names, as
    `ChatMessage.to_template` gives them) and the tools the template offers (None: none offered). The reply is split
    into reasoning, content and tool calls. `template_kwargs`: the chat template's extra arguments the request
    sets (vLLM's `chat_template_kwargs`, e.g. `{"enable_thinking": false}`), over the configured default."""

    messages: list[Message]
    tools: list[Tool] | None = None
    template_kwargs: Mapping[str, Any] | None = None


def template_kwargs_of(kwargs: Mapping[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any] | None:
    """The chat template's arguments a request sets, as vLLM renders them: its `chat_template_kwargs`, and a
    `reasoning_effort` the template gets too, with `enable_thinking` following it ("none": off) unless set."""
    merged = dict(kwargs or {})
    if reasoning_effort is not None:
        merged["reasoning_effort"] = reasoning_effort
        merged.setdefault("enable_thinking", reasoning_effort != "none")
    return merged or None


@dataclass(frozen=True, slots=True)
class TextPrompt:
    """A raw completion's text prompt, tokenized by the gateway."""

    text: str


@dataclass(frozen=True, slots=True)
class TokenPrompt:
    """A prompt of token ids. `checked`: the caller checked them against the vocabulary and the context
    (`POST /generate`, token-in/token-out: its reply is neither decoded nor recorded as a chat message)."""

    ids: list[int]
    checked: bool = False


@dataclass(slots=True)
class TurnRequest:
    """One turn as a protocol asks for it. `model`: the model the request names (None: it names none, as
    `/generate`). `metadata`: what goes to the session (`gateway.session.lifecycle`). `group`: the n choices become
    the first turns of n new sessions (`gateway.turns.group`). `want_routed_experts`: the caller asks for the routed
    experts of every position (else as the replicas are configured)."""

    prompt: Conversation | TextPrompt | TokenPrompt
    sampling: Sampling
    model: str | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    group: bool = False
    want_routed_experts: bool = False

    @property
    def kind(self) -> str:
        """The name of new session ids of this kind of turn: `chat` or `cmpl`."""
        return "chat" if isinstance(self.prompt, Conversation) else "cmpl"
