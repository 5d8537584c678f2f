"""The caller's sampling policy on a request's sampling (`gateway.turns.sampling_policy`), and the route's bound on
the budget the engine will get (`server.max_tokens_limit`): one call per protocol route, before the turn starts.

Each route names its sampling fields as the policy names them (`ParamFields`); a field counts as named when the body
sets it to a value (`null` is leaving it out).
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import Request
from pydantic import BaseModel

from gateway.api.deps import agent_key
from gateway.api.limits import check_max_tokens
from gateway.config import Settings
from gateway.turns.request import Sampling
from gateway.turns.sampling_policy import governed

__all__ = [
    "ANTHROPIC_FIELDS",
    "CHAT_FIELDS",
    "COMPLETION_FIELDS",
    "GENERATE_FIELDS",
    "RESPONSES_FIELDS",
    "ParamFields",
    "governed_sampling",
]

ParamFields = Mapping[str, str]
"""A route's sampling parameter → the policy field it sets."""


def _same(*names: str) -> dict[str, str]:
    """Parameters the policy names as the route does."""
    return {name: name for name in names}


_SHARED = _same("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "min_tokens")
_OPENAI = _SHARED | _same("max_tokens", "stop", "n", "min_p", "presence_penalty", "frequency_penalty")

CHAT_FIELDS: ParamFields = _OPENAI | {"max_completion_tokens": "max_tokens", "top_logprobs": "top_logprobs"}
COMPLETION_FIELDS: ParamFields = _OPENAI | {"logprobs": "top_logprobs"}
ANTHROPIC_FIELDS: ParamFields = _same("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos") | {
    "stop_sequences": "stop"
}
RESPONSES_FIELDS: ParamFields = _SHARED | _same("stop", "min_p") | {"max_output_tokens": "max_tokens"}
GENERATE_FIELDS: ParamFields = _SHARED | _same(
    "max_tokens", "top_logprobs", "min_p", "presence_penalty", "frequency_penalty"
)


def governed_sampling(
    raw: Request,
    settings: Settings,
    sampling: Sampling,
    body: BaseModel,
    fields: ParamFields,
    budget_param: str,
    prefix: str = "",
) -> Sampling:
    """`sampling` as the caller's key's policy has it (a forbidden field named: 400), its budget checked against
    `server.max_tokens_limit` (`budget_param`: the parameter a refusal names when the agent named none). `prefix`:
    where the body's fields sit in the request (`sampling_params.` for `/generate`)."""
    key = agent_key(raw)
    named = {
        field: prefix + param
        for param, field in fields.items()
        if param in body.model_fields_set and getattr(body, param) is not None
    }
    config = settings.sampling
    result = governed(config.policy_for(key), sampling, named, config.policy_name(key))
    check_max_tokens(result.max_tokens, named.get("max_tokens", prefix + budget_param), settings.server)
    return result
