"""A session's history as tokens: how a turn whose messages replay the session's conversation goes on from the
exact ids of the sample (docs/architecture.md §7, "History modes")."""

from gateway.history.anchor import REPLY_MARK, anchored, reply_tail
from gateway.history.families import FAMILIES, family_of
from gateway.history.replay import Forgiven, Replay, ReplayMatch, as_said, replayed, same_messages
from gateway.history.suffix import TokenHistory
from gateway.history.verify import HistoryCheck, check_template, token_history_for

__all__ = [
    "FAMILIES",
    "Forgiven",
    "REPLY_MARK",
    "Replay",
    "ReplayMatch",
    "HistoryCheck",
    "TokenHistory",
    "anchored",
    "as_said",
    "check_template",
    "family_of",
    "replayed",
    "reply_tail",
    "same_messages",
    "token_history_for",
]
