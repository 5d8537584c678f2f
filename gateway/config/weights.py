"""`weights:`: weight updates and versions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Seconds, Section

PauseMode = Literal["abort", "keep", "wait"]
KvAfterUpdate = Literal["keep", "recompute"]
OverBudget = Literal["hold", "refuse"]
StaleSamples = Literal["deliver", "drop"]


class WeightsConfig(Section):
    """Weight updates and versions (docs/architecture.md §5)."""

    pause_mode: PauseMode = Field("abort", description="abort | keep | wait; overridable per update.")
    cache_salt: bool = Field(
        True,
        description="Partition the engines' prefix caches by weight version (vLLM `cache_salt`, SGLang `extra_key`), "
        "so no update flushes them; false: flush after every update.",
    )
    kv_after_update: KvAfterUpdate = Field(
        "keep",
        description="keep | recompute: requests kept through an update go on with the KV they computed under the old "
        "weights, or recompute it (a flush that preempts them).",
    )
    max_staleness: int | None = Field(
        4,
        ge=0,
        description="The staleness budget (docs/architecture.md §5): new sessions are admitted while the samples "
        "started <= (version + this + 1) x the trainer's published batch size; a turn whose sample's first token is "
        "older than version - this is cut and its sample marked stale. Off until a consumer publishes its batch "
        "size; null: no budget.",
    )
    over_budget: OverBudget = Field(
        "hold", description="hold | refuse: a new session over the budget waits (up to hold_timeout_s) or gets 429."
    )
    hold_timeout_s: Seconds = Field(
        30.0, description="How long a held session waits for the trainer's next version before its 429, seconds."
    )
    stale_samples: StaleSamples = Field(
        "deliver",
        description="deliver | drop: a session with a sample cut for staleness reaches the trainer marked "
        "stale, or is recorded in rg:abandoned instead (a GRPO group's member is delivered either way).",
    )
    update_timeout_s: Seconds = Field(600.0, description="Deadline of pause → update → resume, seconds.")
    transfer_commit_timeout_s: Seconds = Field(
        300.0,
        description="An in-memory transfer (POST /admin/weights with transfer) not committed this long after it "
        "began ends as a failed update: the replicas it opened are reloaded from the last checkpoint path, or held "
        "out as stale, seconds; update_timeout_s where that is shorter (the other processes follow it that long).",
    )
    control_timeout_s: Seconds = Field(
        30.0, description="Timeout of one pause, resume, abort or version call to a replica, seconds."
    )
    member_ttl_s: Seconds = Field(
        10.0,
        description="A gateway process is on the weights bus this long after its heartbeat (every fifth of it); "
        "one coordinating an update is taken for dead after twice this without one, seconds.",
    )

    @property
    def transfer_deadline_s(self) -> float:
        """An in-memory transfer's deadline: `transfer_commit_timeout_s`, within `update_timeout_s` (the other gateway
        processes follow an update that long)."""
        return min(self.transfer_commit_timeout_s, self.update_timeout_s)

    @property
    def flushes_caches(self) -> bool:
        """Whether each update flushes the engines' prefix caches: without a salt (old KV would be reused), or where
        kept requests recompute their KV under the new weights (the flush preempts them)."""
        return not self.cache_salt or self.kv_after_update == "recompute"
