"""`sampling:`: what an agent may choose of how its turns are sampled, per API key (`gateway.turns.sampling_policy`
applies it).

Black-box agents (CLI and SDK agents) send their own temperature, top_p, max_tokens..., and their side calls (a
title, a compaction) others again. A policy says, per sampling field, `allow` (the agent's value, or the route's
default), `forbid` (a request that names the field is a 400 naming it) or `{pin: <value>}` (the value the engine
gets, whatever the agent sent or left out), and `max_tokens_cap` (a larger budget is lowered to it, and a request
without one gets it). `default` is every key's policy but those `keys` names by key id (`gateway.config.api_keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    Field,
    PlainSerializer,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from gateway.config.api_keys import KEY_ID_PATTERN
from gateway.config.section import Section

__all__ = ["FORBID_ONLY", "PINNABLE", "Choice", "Pin", "SamplingConfig", "SamplingPolicy"]

T = TypeVar("T")

Choice = Literal["allow", "forbid"]


class Pin(Section, Generic[T]):
    """The value the engine gets for a field, whatever the agent sends."""

    pin: T

    @classmethod
    def __repr_name__(cls) -> str:  # not `Pin[Annotated[float, FieldInfo(...)]]`
        return "Pin"


_INT32 = 2**31 - 1
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=_INT32)]
Budget = Annotated[int, Field(ge=1, le=_INT32)]
Count = Annotated[int, Field(ge=0, le=_INT32)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
Stops = Annotated[tuple[Annotated[str, Field(min_length=1)], ...], Field(max_length=8)]
StopIds = Annotated[tuple[Annotated[int, Field(ge=0, le=_INT32)], ...], Field(max_length=1024)]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]

PINNABLE = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
    "top_logprobs",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
)
"""The fields a policy may pin: those the engine request carries (`gateway.turns.request.Sampling`)."""

FORBID_ONLY = ("n",)
"""Fields a policy may forbid but not pin: `n`, the choices an answer returns (not how each is sampled)."""


class SamplingPolicy(Section):
    """Per sampling field: `allow` (the default), `forbid`, or `{pin: <value>}`; and a cap on the budget. A field
    covers each name the routes give it: `max_tokens` is also `max_completion_tokens` (chat), `max_output_tokens`
    (Responses); `stop` also `stop_sequences` (Anthropic); `top_logprobs` also the completions' `logprobs`."""

    temperature: Choice | Pin[Temperature] = "allow"
    top_p: Choice | Pin[TopP] = "allow"
    top_k: Choice | Pin[TopK | None] = "allow"
    seed: Choice | Pin[Seed | None] = "allow"
    max_tokens: Choice | Pin[Budget] = "allow"
    stop: Choice | Pin[Stops] = "allow"
    stop_token_ids: Choice | Pin[StopIds] = "allow"
    min_tokens: Choice | Pin[Count] = "allow"
    ignore_eos: Choice | Pin[bool] = "allow"
    top_logprobs: Choice | Pin[TopLogprobs] = "allow"
    min_p: Choice | Pin[MinP | None] = "allow"
    presence_penalty: Choice | Pin[Penalty | None] = "allow"
    frequency_penalty: Choice | Pin[Penalty | None] = "allow"
    n: Choice = "allow"
    max_tokens_cap: Budget | None = Field(
        None, description="A larger max_tokens is lowered to it; a request without one gets it (None: no cap)."
    )

    @field_validator(*PINNABLE, mode="wrap")
    @classmethod
    def _one_rule(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """One message for a rule that is neither choice nor pin (pydantic's names each member of the union)."""
        try:
            return handler(value)
        except ValidationError as exc:
            pinned = [err for err in exc.errors() if len(err["loc"]) > 1 and str(err["loc"][0]).startswith("Pin")]
            detail = "".join(f" ({'.'.join(map(str, err['loc'][1:]))}: {err['msg']})" for err in pinned)
            raise ValueError(f"must be allow, forbid or {{pin: <value>}}{detail}") from None

    @model_validator(mode="after")
    def _pin_within_cap(self) -> SamplingPolicy:
        pinned = self.max_tokens
        if isinstance(pinned, Pin) and self.max_tokens_cap is not None and pinned.pin > self.max_tokens_cap:
            raise ValueError(f"max_tokens is pinned to {pinned.pin}, above max_tokens_cap {self.max_tokens_cap}")
        return self

    def forbidden(self, field: str) -> bool:
        rule: object = getattr(self, field)
        return rule == "forbid"

    def pins(self) -> dict[str, object]:
        """The pinned fields and their values."""
        return {name: rule.pin for name in PINNABLE if isinstance(rule := getattr(self, name), Pin)}

    @property
    def budget_bound(self) -> int | None:
        """The largest max_tokens this policy lets through (a pin, else the cap; None: the agent's own)."""
        pinned = self.max_tokens
        return pinned.pin if isinstance(pinned, Pin) else self.max_tokens_cap


def _key_ids(policies: Mapping[str, SamplingPolicy]) -> Mapping[str, SamplingPolicy]:
    return MappingProxyType(dict(policies))


KeyId = Annotated[str, Field(pattern=KEY_ID_PATTERN)]


class SamplingConfig(Section):
    """The sampling policy of each API key: `keys` by key id, `default` for every other (and for the callers of a
    gateway without keys). A key id that names no configured key is a start-up error (`Settings`)."""

    default: SamplingPolicy = SamplingPolicy()
    keys: Annotated[
        Mapping[KeyId, SamplingPolicy],
        AfterValidator(_key_ids),
        PlainSerializer(lambda keys: {k: v.model_dump() for k, v in keys.items()}),
    ] = Field(default_factory=dict, description="Policies by key id (server.api_keys), over the default.")

    def policy_for(self, key_id: str) -> SamplingPolicy:
        """The policy of the key `key_id` (`default` unless `keys` names it)."""
        return self.keys.get(key_id, self.default)

    def policy_name(self, key_id: str) -> str:
        """Where the policy of `key_id` is configured, for messages: `sampling.keys.<id>` or `sampling.default`."""
        return f"sampling.keys.{key_id}" if key_id in self.keys else "sampling.default"

    def __hash__(self) -> int:
        # `keys` is a mapping, which does not hash: its sorted items do.
        return hash((self.default, tuple(sorted(self.keys.items()))))
