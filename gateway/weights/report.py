"""`UpdateReport`: what one weight update did, for the admin API, the metrics and the dashboard."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from backends.base import PauseMode

UpdateStatus = Literal["updated", "partial", "failed"]

SLOW_DRAIN_S = 10.0
"""How long a `wait` update waits for requests to drain (this process's, or the other processes' reports) before
it says in the log, at WARNING, what it still waits for (then every heartbeat, for the others' reports)."""


@dataclass
class UpdateReport:
    """What one update did, for the admin API and metrics: the replicas that run `version` (`updated`), those
    held out (`stale`), those rolled back onto the previous weights after a failed update (`kept`), and the
    engines' errors by replica."""

    version: int
    mode: PauseMode
    updated: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    flush_pending: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    # Wall-clock times of its phases (the dashboard's timeline): pause asked, every replica paused, the weights
    # loaded and verified, serving again. 0.0: the phase was not reached.
    started_at: float = 0.0
    paused_at: float = 0.0
    loaded_at: float = 0.0
    finished_at: float = 0.0
    # Replicas whose engine refused the load and said it kept its weights: rolled back if no replica updated.
    refused: list[str] = field(default_factory=list)

    def note(self, replica: str, error: str) -> None:
        """Record a replica's failure (after any earlier one of the same update)."""
        earlier = self.errors.get(replica)
        self.errors[replica] = f"{earlier}; {error}" if earlier else error

    @property
    def status(self) -> UpdateStatus:
        """`updated`: every replica runs `version`; `partial`: some do, the others are stale; `failed`: none do."""
        if not self.updated:
            return "failed"
        return "partial" if self.stale else "updated"
