"""OpenAI chat and completion requests as the turn the gateway runs (`gateway.turns.request.TurnRequest`)."""

from __future__ import annotations

from typing import Any

from gateway.api.openai.models import ChatCompletionRequest, ChatSettings, CompletionRequest, Sampled
from gateway.turns.request import Conversation, Sampling, TextPrompt, TokenPrompt, TurnRequest, template_kwargs_of

__all__ = ["chat_request", "completion_request", "offered_tools", "sampling_of"]

DEFAULT_COMPLETION_TOKENS = 16
"""A completion's `max_tokens` when the request leaves it out, as OpenAI's."""


def chat_request(body: ChatCompletionRequest, metadata: dict[str, str] | None) -> TurnRequest:
    """The chat turn `body` asks for; `metadata` the session's, as the route found it (`session_of`)."""
    kwargs = template_kwargs_of(body.chat_template_kwargs, body.reasoning_effort)
    conversation = Conversation([m.to_template() for m in body.messages], offered_tools(body), kwargs)
    sampling = sampling_of(body, body.budget, body.top_logprobs or 0)
    return TurnRequest(conversation, sampling, body.model, body.stream, metadata, body.group)


def completion_request(body: CompletionRequest, metadata: dict[str, str] | None) -> TurnRequest:
    """The raw completion turn `body` asks for (a text prompt, or token ids)."""
    prompt = TextPrompt(body.prompt) if isinstance(body.prompt, str) else TokenPrompt(list(body.prompt))
    sampling = sampling_of(body, body.max_tokens or DEFAULT_COMPLETION_TOKENS, body.logprobs or 0)
    return TurnRequest(prompt, sampling, body.model, body.stream, metadata, body.group)


def sampling_of(body: Sampled, max_tokens: int | None, top_logprobs: int) -> Sampling:
    """What a request samples with (its budget and logprobs are named differently per kind of request)."""
    return Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=tuple(body.stops),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        top_logprobs=top_logprobs,
        min_p=body.min_p,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        n=body.n,
    )


def offered_tools(body: ChatSettings) -> list[dict[str, Any]] | None:
    """The tools a request's template renders: its tools, unless `tool_choice` is none."""
    if body.tools and body.tool_choice != "none":
        return [t.model_dump(exclude_none=True) for t in body.tools]
    return None
