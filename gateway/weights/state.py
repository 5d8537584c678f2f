"""The weight coordinator's states and the one table of the transitions between them.

A transition the table does not list raises `IllegalTransition` (a bug in the coordinator, never a request's
fault). The machine records every transition it took (`taken`): the tests prove each one in the table is reached.
A later state (an adapter update) is added to this table, not beside it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class State(enum.StrEnum):
    """What the coordinator of one gateway process is doing (`GET /admin/status`'s `state`)."""

    SERVING = "serving"  # requests dispatch
    PAUSING = "pausing"  # this process coordinates an update: other processes drain, then every replica pauses
    PAUSED = "paused"  # an out-of-band sync holds the replicas paused (`POST /admin/pause` … `/admin/resume`)
    # An in-memory transfer (`POST /admin/weights` with `transfer`): every replica paused, the engines' transfer sides
    # open, the trainer pushing tensors into them until it commits (`POST /admin/weights/{version}/commit`).
    TRANSFERRING = "transferring"
    UPDATING = "updating"  # loading or relabelling the paused replicas, and reading their labels back
    RESUMING = "resuming"  # resuming every replica
    FOLLOWING = "following"  # another process coordinates an update: no request dispatches until its result


TRANSITIONS: Mapping[State, frozenset[State]] = {
    State.SERVING: frozenset({State.PAUSING, State.FOLLOWING}),
    # PAUSING → SERVING: the pause (or the wait for the other processes' drain) failed or outlasted
    # `weights.update_timeout_s`; the update ends with no replica loaded.
    State.PAUSING: frozenset({State.UPDATING, State.PAUSED, State.TRANSFERRING, State.SERVING}),
    State.PAUSED: frozenset({State.UPDATING}),  # the out-of-band sync resumed, or ended at its deadline
    # The transfer committed (finish every engine with the label), or ended at its deadline (reload or hold out).
    State.TRANSFERRING: frozenset({State.UPDATING}),
    # UPDATING → SERVING: the load outlasted `weights.update_timeout_s`.
    State.UPDATING: frozenset({State.RESUMING, State.SERVING}),
    State.RESUMING: frozenset({State.SERVING}),
    # FOLLOWING → PAUSING: this process recovers from an update whose coordinator died (or it coordinates one of
    # its own after missing the followed one's result).
    State.FOLLOWING: frozenset({State.SERVING, State.PAUSING}),
}
"""Every allowed transition: from a state to the states it may go to."""


class IllegalTransition(RuntimeError):
    """The coordinator tried a transition `TRANSITIONS` does not allow."""


class StateMachine:
    """The current state, moved only along `TRANSITIONS`."""

    __slots__ = ("state", "taken")

    def __init__(self, state: State = State.SERVING) -> None:
        self.state = state
        self.taken: set[tuple[State, State]] = set()  # every transition taken (at most the table's size)

    def to(self, new: State) -> None:
        """Go to `new`; `IllegalTransition` where the table does not allow it from the current state."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"weights: no transition from {self.state} to {new}")
        self.taken.add((self.state, new))
        self.state = new


def all_transitions() -> set[tuple[State, State]]:
    """Every (from, to) pair of `TRANSITIONS`."""
    return {(old, new) for old, targets in TRANSITIONS.items() for new in targets}
