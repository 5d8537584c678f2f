"""`pools:`: several served models on one gateway, each with its own replicas, weight versions, routing and
trajectory stream (docs/serving.md, "Several pools").

A pool is the whole gateway for one model: the settings a pool does not give are the top-level ones, and its
Redis keys live under `<store.prefix><model>:` (`pool_prefix`), so its version record, update lock, sessions and
trajectory stream are its own while the pools share one Redis. Without `pools:`, the top-level `model:` and
`replicas:` are the one pool, under `store.prefix` itself (every existing deployment keeps its keys).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, PlainSerializer

from gateway.config.replicas import Replicas, ReplicasFrom
from gateway.config.section import Seconds, Section

__all__ = ["POOL_MODEL_PATTERN", "PoolConfig", "PoolRole", "Pools", "TeacherConfig", "pool_prefix"]

PoolRole = Literal["policy", "teacher"]

POOL_MODEL_PATTERN = r"^[A-Za-z0-9_.\-/]{1,128}$"
"""A pool's model name: it becomes part of Redis keys (no `:` nor braces, which the key schema uses) and a label."""


def pool_prefix(prefix: str, model: str) -> str:
    """The Redis key prefix of pool `model` under the store prefix `prefix` (`rg:` and `tiny` → `rg:tiny:`)."""
    return f"{prefix}{model}:"


def _read_only(overrides: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(overrides))


Overrides = Annotated[Mapping[str, Any], AfterValidator(_read_only), PlainSerializer(dict)]
"""A pool's own keys of a section; the rest are the top-level section's (checked when the settings are made)."""


class TeacherConfig(Section):
    """The teacher pool that scores a policy's finished samples (on-policy distillation, docs/serving.md): the
    engines' log-probability of each response token, stored beside the sample before the trainer gets it."""

    model: str = Field(pattern=POOL_MODEL_PATTERN, description="The teacher pool's model: the default teacher.")
    by_metadata: str | None = Field(
        None, min_length=1, description="A session metadata key whose value picks the teacher (several teachers)."
    )
    models: Mapping[str, str] = Field(
        default_factory=dict, description="by_metadata's value → the teacher pool's model; other values: model."
    )
    top_k: int = Field(0, ge=0, le=20, description="The teacher's k best tokens kept per position (0: none).")
    deadline_s: Seconds = Field(
        300.0, description="A sample the teacher could not score by then is delivered, marked unscored."
    )

    def teachers(self) -> set[str]:
        return {self.model, *self.models.values()}

    def __hash__(self) -> int:
        return hash((self.model, self.by_metadata, tuple(sorted(self.models.items())), self.top_k, self.deadline_s))


class PoolConfig(Section):
    """One served model: its name (the requests' `model`), its replicas and what it sets apart from the top level."""

    model: str = Field(pattern=POOL_MODEL_PATTERN, description="The model name agents send; sent to the engines too.")
    role: PoolRole = Field(
        "policy",
        description="policy: the model being trained (versions, trajectories); teacher: scores policies' samples.",
    )
    teacher: TeacherConfig | None = Field(None, description="A policy's teacher pool (on-policy distillation).")
    base_model: str | None = Field(
        None, min_length=1, description="A LoRA adapter on engines serving this model (as model.base_model)."
    )
    tokenizer: Path | None = Field(None, description="Local tokenizer folder; null: model.tokenizer.")
    replicas: Replicas = Field((), description="The pool's engine replicas at startup (as the top-level replicas).")
    replicas_from: ReplicasFrom = Field(None, description="More replicas followed at run time (dns:// or file://).")
    keys: tuple[str, ...] = Field(
        (), description="Ids of the API keys that may use this pool (empty: every key); others get 403."
    )
    weights: Overrides = Field(default_factory=dict, description="The pool's own keys of weights:.")
    routing: Overrides = Field(default_factory=dict, description="The pool's own keys of routing:.")
    generation: Overrides = Field(default_factory=dict, description="The pool's own keys of generation:.")

    def __hash__(self) -> int:
        return hash(
            (self.model, self.role, self.teacher, self.base_model, self.tokenizer, self.replicas, self.replicas_from)
        )


def _distinct_models(pools: tuple[PoolConfig, ...]) -> tuple[PoolConfig, ...]:
    for name, count in Counter(p.model for p in pools).items():
        if count > 1:
            raise ValueError(f"the model {name!r} has {count} pools (one each)")
    roles = {p.model: p.role for p in pools}
    for index, pool in enumerate(pools):
        if pool.teacher is None:
            continue
        if pool.role == "teacher":
            raise ValueError(f"pools[{index}] ({pool.model!r}) is a teacher: it has no teacher of its own")
        for name in sorted(pool.teacher.teachers()):
            if roles.get(name) != "teacher":
                teachers = ", ".join(repr(m) for m, role in roles.items() if role == "teacher") or "none"
                raise ValueError(
                    f"pools[{index}].teacher names {name!r}, which is no teacher pool (the teacher pools: {teachers})"
                )
    return pools


Pools = Annotated[tuple[PoolConfig, ...], AfterValidator(_distinct_models)]
"""`pools:`, each model once; a teacher named by a policy is a teacher pool."""
