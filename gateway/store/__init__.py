"""Everything the gateway keeps in Redis. All keys are named here, and redis errors become `StoreError` here.

One module per concept:

- `keys`: the schema (every key, its type and lifetime), `Keys`, `connect`, the redis error boundary;
- `scripts`: the Lua scripts, each atomic on one session's slot, as redis-py script objects;
- `core`: what the parts share (client, batcher, scripts, counters, the session-slot transaction);
- `records`: session metas (create, read, activity, metadata), and each GRPO group's replica (`GroupRecords`);
  `backpressure`: `rg:pending:sessions` and the staleness budget's count;
- `samples`: sample writes and reads; `buffer`: the write buffer and its flusher (Redis outages);
- `locks`: `SessionLocks`, the per-session locks of this process (a session's turns; its sample writes);
- `open_sessions`: `OpenSessions`, the open sessions of each API key (`server.max_open_sessions_per_key`);
- `slot_clients`: where a key's writes run: a session's transaction, and writes acknowledged once replicas hold
  them (`Durability`: `WAIT` on the connection that wrote);
- `finish`: the idempotent finish; `delivery`: to the stream, and the repair sweeper; `sweepers`: idle sessions;
- `responses`: the Responses API's stored responses, and a sample's conversation read without its arrays;
- `weights_bus`: `WeightsBus` (weight version, update lock, control channel); `weights_events`: its typed events;
- `inspection`: what the command line shows of the store;
- `trajectory_store`: `TrajectoryStore`, the one object the gateway holds, composed of those parts.
"""

from __future__ import annotations

from gateway.store.core import StoreStats
from gateway.store.inspection import inspect_store, tail_trajectories
from gateway.store.keys import Keys, connect
from gateway.store.locks import SessionLocks
from gateway.store.open_sessions import OpenSessions
from gateway.store.records import metadata_additions
from gateway.store.samples import SampleWrite
from gateway.store.slot_clients import Durability, NotReplicated
from gateway.store.trajectory_store import TrajectoryStore
from gateway.store.weights_bus import WeightsBus, WeightsRecord
from gateway.store.weights_events import Commit, Drained, Pausing, Serving, Subscribed, WeightsEvent

_SampleWrite = SampleWrite  # its name before the store was split in modules (tests build one)

__all__ = [
    "Commit",
    "Drained",
    "Durability",
    "Keys",
    "NotReplicated",
    "OpenSessions",
    "Pausing",
    "Serving",
    "SessionLocks",
    "StoreStats",
    "Subscribed",
    "TrajectoryStore",
    "WeightsBus",
    "WeightsEvent",
    "WeightsRecord",
    "connect",
    "inspect_store",
    "metadata_additions",
    "tail_trajectories",
]
