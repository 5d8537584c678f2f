"""Acknowledging stream entries (see gateway/trainer/consumer.py): XACK and XDEL; for a real entry the XACK
removed, SREM the session from `rg:pending:sessions` and expire (or delete) the session's keys."""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from gateway.store.keys import Keys
from gateway.trainer.entries import Entry, is_real, parse_entry, split_id, store_errors

__all__ = ["resolve", "settle"]


async def resolve(client: aioredis.Redis, keys: Keys, ids: Sequence[str]) -> tuple[list[Entry], list[str]]:
    """Split ids this consumer did not hand out into real entries and the rest (XACK only)."""
    if not ids:
        return [], []
    pipe = client.pipeline(transaction=False)
    for entry_id in ids:
        raw, partition = split_id(entry_id)
        pipe.xrange(keys.stream(partition), raw, raw)
    with store_errors("look up entries"):
        found = await pipe.execute()
    entries = [parse_entry(i, hits[0][1]) if hits else None for i, hits in zip(ids, found, strict=True)]
    known = [e for e in entries if e is not None]
    pipe = client.pipeline(transaction=False)
    for entry in known:
        pipe.hget(keys.meta(entry.session_id), "stream_id")
        pipe.exists(keys.meta(entry.session_id))
    with store_errors("look up sessions"):
        replies = await pipe.execute() if known else []
    pairs = zip(known, replies[::2], replies[1::2], strict=True)
    real = [e for e, sid, exists in pairs if not exists or is_real(sid, e)]
    real_ids = {e.entry_id for e in real}
    return real, [i for i in ids if i not in real_ids]


async def settle(
    client: aioredis.Redis, keys: Keys, group: str, ack_ttl_s: float, real: Sequence[Entry], others: Sequence[str]
) -> int:
    """XACK and XDEL every entry; for real ones the XACK removed, SREM the session from `rg:pending:sessions` and
    expire the session's keys. Returns how many entries the XACK removed from the pending list."""
    if not real and not others:
        return 0
    ids = [*(e.entry_id for e in real), *others]
    by_stream: dict[str, list[str]] = {}
    pipe = client.pipeline(transaction=False)
    for entry_id in ids:
        raw, partition = split_id(entry_id)
        pipe.xack(keys.stream(partition), group, raw)
        by_stream.setdefault(keys.stream(partition), []).append(raw)
    for stream, raws in by_stream.items():
        pipe.xdel(stream, *raws)
    with store_errors("acknowledge entries"):
        replies = await pipe.execute()
    acked: list[int] = replies[: len(ids)]
    removed = [e for e, count in zip(real, acked, strict=False) if count]
    if removed:
        pipe = client.pipeline(transaction=False)
        pipe.incrby(keys.acked, len(removed))  # counted for the operator (the dashboard's consumed/s)
        for entry in removed:
            pipe.srem(keys.pending, entry.session_id)
            session_keys = [keys.meta(entry.session_id)]
            session_keys += [keys.sample(entry.session_id, i) for i in range(max(entry.samples, 0))]
            if ack_ttl_s > 0:
                for key in session_keys:
                    pipe.pexpire(key, max(1, int(ack_ttl_s * 1000)))
            else:
                pipe.delete(*session_keys)  # one hash tag: one slot
        with store_errors("release acknowledged sessions"):
            await pipe.execute()
    return sum(acked)
