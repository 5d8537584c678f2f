"""What a completion is made of: the request, the state it builds as segments come, and the loop's settings."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from backends.base import SamplingParams
from backends.routed_experts import ExpertArray

RoutedExpertsPolicy = Literal["splice", "replace"]


StopChecker = Callable[[list[int]], int | None]
"""Given all output ids so far, the number of tokens to keep if a stop condition matched, else None."""


PartialHook = Callable[["GenerationState"], Awaitable[None]]
"""Persists the partial state at a segment boundary (the sessions layer writes the sample to Redis)."""


@dataclass(slots=True)
class GenerationRequest:
    """One completion to produce. `sampling.max_tokens` is the budget of the whole completion. Nothing changes it
    once made; not frozen for the reason `SamplingParams` gives (one per request).

    `experts_start`: the first position whose routed experts the caller wants (a later turn of a session
    already holds the experts of its earlier positions); `routed_experts` are those earlier positions' experts,
    replayed to engines that accept routing input. `on_partial` runs at every segment boundary.

    `stream`: the caller takes tokens as they come. A caller that takes only the finished completion, without stop
    strings to watch, gets each segment in one answer from its engine instead of an event per token (far less
    work per token; an abort still returns the segment's tokens, a replica failure loses them, and the
    continuation generates them again).

    `stop_strings`: the stop strings `stop` watches for, as the record of what the completion was sampled with
    (`sampling_used`).

    `group_id`: the GRPO group whose member session this completion is a turn of (the pool places a new member with
    its group, `gateway.routing.groups`).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    want_routed_experts: bool = False
    stop: StopChecker | None = None
    experts_start: int = 0
    routed_experts: ExpertArray | None = None
    on_partial: PartialHook | None = None
    stream: bool = True
    stop_strings: tuple[str, ...] = ()
    # The weight version of the first sampled token of the sample this completion extends (an earlier turn's; None:
    # its first token is this completion's): the staleness budget cuts the completion when that falls behind.
    first_version: int | None = None
    group_id: str | None = None


STALE = "stale"
"""The finish reason of a completion the staleness budget cut at a resume: its sample's first token fell more than
`weights.max_staleness` versions behind (docs/architecture.md §5). Its tokens are kept; its sample is marked stale."""


def sampling_used(request: GenerationRequest) -> Mapping[str, Any]:
    """What `request` is sampled with, as stored with the tokens it produced (`SampleSegment.sampling`): the engine
    request's sampling (the whole completion's budget; a resumed segment asks the engine for what is left of it)
    and the stop strings the gateway watches for. One mapping per distinct settings, shared by every segment sampled
    with them (`_shared_sampling`): never change it."""
    s = request.sampling
    return _shared_sampling(
        s.temperature,
        s.top_p,
        s.top_k,
        s.seed,
        s.max_tokens,
        tuple(request.stop_strings),
        tuple(s.stop_token_ids),
        s.min_tokens,
        s.ignore_eos,
        s.top_logprobs,
        s.min_p,
        s.presence_penalty,
        s.frequency_penalty,
    )


@functools.lru_cache(maxsize=4096, typed=True)  # typed: 1 and 1.0 are stored as the caller gave them
def _shared_sampling(
    temperature: float,
    top_p: float,
    top_k: int | None,
    seed: int | None,
    max_tokens: int,
    stop: tuple[str, ...],
    stop_token_ids: tuple[int, ...],
    min_tokens: int,
    ignore_eos: bool,
    top_logprobs: int,
    min_p: float | None,
    presence_penalty: float | None,
    frequency_penalty: float | None,
) -> Mapping[str, Any]:
    # A segment keeps its settings until its session ends: a dict (and two lists) a turn was the largest part of an
    # open session after its tokens (docs/scaling.md). Agents sample with a few settings, so a few mappings serve all.
    return {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "max_tokens": max_tokens,
        "stop": list(stop),
        "stop_token_ids": list(stop_token_ids),
        "min_tokens": min_tokens,
        "ignore_eos": ignore_eos,
        "top_logprobs": top_logprobs,
        "min_p": min_p,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
    }


@dataclass(slots=True)
class Segment:
    """Tokens [start, end) of the output, produced by one engine request on one replica."""

    replica: str
    start: int
    end: int
    finish: str | None


@dataclass(slots=True)
class Delta:
    """New tokens for the caller."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(slots=True)
class GenerationState:
    """Everything known about a completion; final once `finish_reason` is set."""

    request: GenerationRequest
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # Kept for a caller that takes the finished completion only (`GenerationRequest.stream` false): a streaming
    # caller gets them with each delta, and a turn of 4,000 tokens with 20 each would hold 80,000 tuples meanwhile.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routed_experts: ExpertArray | None = None
    routed_experts_complete: bool = True
    # The position of the first row of `routed_experts`: the request's `experts_start` when they are spliced, 0
    # when the engine's whole view replaces them (policy "replace").
    routed_experts_start: int = 0
    segments: list[Segment] = field(default_factory=list)
    num_resumes: int = 0
    num_failures: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cancelled: bool = False

    @property
    def finished(self) -> bool:
        """The completion ended as the engine ended it (stop, length), not cut short (client gone, an error)."""
        return self.finish_reason is not None and not self.cancelled

    @property
    def replica_ids(self) -> list[str]:
        return [s.replica for s in self.segments]


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    max_resumes: int = 32
    request_timeout_s: float = 600.0
    max_wait_s: float = 60.0
    routed_experts: RoutedExpertsPolicy = "splice"
    failure_backoff_s: float = 0.05
    failure_backoff_max_s: float = 2.0
    stall_timeout_s: float = 60.0  # a streamed segment silent this long after its first chunk: its replica failed
    first_token_timeout_s: float = 120.0  # ... or without a first chunk, while its replica sent no token at all
    cache_salt: bool = True  # each engine request salts its prefix cache with its replica's weight version
    adapter: str | None = None  # a LoRA policy: each engine request names its version's adapter (`backends.lora`)
