"""`store:` and `sessions:`: the Redis layout and trajectory lifecycle, and how agents name their sessions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.config.section import Seconds, Section
from gateway.session.identity import Identity


class StoreConfig(Section):
    """Redis layout and trajectory lifecycle (docs/architecture.md §8)."""

    prefix: str = Field("rg:", min_length=1, description="Prefix of every Redis key.")
    max_pending: int = Field(10000, ge=1, description="Unconsumed trajectories before new sessions get 429.")
    ttl_s: int = Field(86400, gt=0, description="Expiry of finished session data, seconds.")
    session_idle_ttl_s: int = Field(1800, gt=0, description="Idle time before a session is abandoned, seconds.")
    claim_idle_s: Seconds = Field(60.0, description="Pending time before a dead consumer's entry is reclaimed.")
    stream_partitions: int = Field(
        1, ge=1, le=1024, description="Partitions of the trajectory stream (spread over a Redis Cluster's masters)."
    )
    session_cache_size: int = Field(
        100_000,
        ge=1,
        description="Sessions whose samples this process keeps between turns (LRU; the byte bound binds first).",
    )
    session_cache_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="Estimated bytes of the sessions this process keeps (LRU beyond it)."
    )
    max_session_metadata_bytes: int = Field(
        64 * 1024,
        gt=0,
        description=(
            "The most a session's metadata may take as JSON, all its requests' together (each is 16 KiB at most); "
            "a turn or finish past it is a 400 and stores nothing."
        ),
    )
    response_cache_size: int = Field(
        4096, ge=0, description="Stored Responses API answers this process keeps for chained turns (LRU; 0: none)."
    )


class SessionsConfig(Section):
    """How agents name their sessions (docs/architecture.md §1, `gateway.session.identity`)."""

    identity: Identity = Field(
        "header", description="header (path, X-Session-ID, body) | api_key (the agent's API key names it too)."
    )
    history: Literal["tokens", "template"] = Field(
        "tokens",
        description=(
            "tokens: a turn that replays the session's conversation goes on from the sample's exact ids (one sample "
            "per episode whatever the template drops); template: the template renders the whole conversation again "
            "(a new sample where that rewrites history). Unset, a template without a verified rule runs in template "
            "mode with a warning; set to tokens, the gateway refuses it."
        ),
    )
    replay_match: Literal["loose", "strict"] = Field(
        "loose",
        description=(
            "What an agent's replay of the conversation may change and still continue the sample. strict: only a "
            "reply's reasoning (left out or changed) and empty fields; loose: also tool-call arguments re-serialized, "
            "re-minted tool-call ids, whitespace, a text as a list of text parts."
        ),
    )
