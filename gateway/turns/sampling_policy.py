"""A key's sampling policy applied to what a turn asks for (`sampling:` in the configuration,
`gateway.config.sampling`), the same on every protocol: each adapter says which of its fields the agent named, and
under which policy field (`max_completion_tokens` is `max_tokens`, `stop_sequences` is `stop`, ...).

In order: a forbidden field the agent named is a 400 naming the field as the agent sent it (nothing is prepared or
stored); then the pins replace the agent's values, or set those it left out; then `max_tokens_cap` lowers a larger
budget to the cap and gives one to a request without (a request that leaves its budget out would otherwise take all
the context leaves). The route's own bound (`server.max_tokens_limit`) is checked after, on what the engine will get.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gateway.config.sampling import SamplingPolicy
from gateway.errors import InvalidRequest
from gateway.turns.request import Sampling

__all__ = ["FORBIDDEN_CODE", "governed"]

FORBIDDEN_CODE = "sampling_param_forbidden"


def governed(policy: SamplingPolicy, sampling: Sampling, named: Mapping[str, str], where: str) -> Sampling:
    """`sampling` under `policy` (configured at `where`, for messages). `named`: each policy field the agent named
    (with a value) → the request's parameter that named it."""
    for field, param in named.items():
        if policy.forbidden(field):
            raise InvalidRequest(
                f"{param}: not accepted from this caller ({where}.{field} is forbid); leave it out",
                param=param,
                code=FORBIDDEN_CODE,
            )
    changes: dict[str, Any] = policy.pins()
    for sequence in ("stop", "stop_token_ids"):
        if sequence in changes:
            changes[sequence] = tuple(changes[sequence])
    cap = policy.max_tokens_cap
    if cap is not None:
        budget = changes.get("max_tokens", sampling.max_tokens)
        changes["max_tokens"] = cap if budget is None else min(budget, cap)
    return replace(sampling, **changes) if changes else sampling
