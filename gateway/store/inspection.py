"""What `rollout-gateway trajectories` shows of the store: counts, and the newest stream entries."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

from gateway.store.keys import Keys, call, text

__all__ = ["inspect_store", "tail_trajectories"]


async def inspect_store(client: aioredis.Redis, keys: Keys) -> dict[str, Any]:
    """Counts for `rollout-gateway trajectories stats`: stream, pending, sessions, weights, consumer groups."""

    async def read() -> dict[str, Any]:
        streams = (await recorded_keys(client, keys)).streams
        async with client.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xlen(stream)
            pipe.scard(keys.pending)
            pipe.zcard(keys.active_sessions)
            pipe.scard(keys.undelivered)
            pipe.xlen(keys.abandoned)
            pipe.hgetall(keys.weights)
            *lengths, pending, active, undelivered, abandoned, weights = await pipe.execute()
        stream = sum(lengths)
        groups: list[dict[str, Any]] = []
        for partition, (name, length) in enumerate(zip(streams, lengths, strict=True)):
            for group in await client.xinfo_groups(name) if length else []:
                row = {text(k): text(v) if isinstance(v, bytes) else v for k, v in group.items()}
                groups.append(row | {"partition": partition} if len(streams) > 1 else row)
        return {
            "stream_entries": stream,
            "pending": int(pending or 0),
            "active_sessions": active,
            "undelivered": undelivered,
            "abandoned": abandoned,
            "weights": {text(k): text(v) for k, v in weights.items()},
            "consumer_groups": groups,
        }

    return await call(read(), "inspect the store")


async def recorded_keys(client: aioredis.Redis, keys: Keys) -> Keys:
    """`keys` with the stream partitions the gateway recorded (`rg:trajectories:partitions`; none: 1)."""
    return keys.with_partitions(await client.get(keys.stream_partitions))


async def tail_trajectories(client: aioredis.Redis, keys: Keys, count: int) -> list[dict[str, Any]]:
    """The newest `count` entries of the trajectories stream, newest first, with their sessions' sample sizes."""

    async def read() -> list[dict[str, Any]]:
        entries: list[tuple[str, Any]] = []
        for stream in (await recorded_keys(client, keys)).streams:  # each partition's newest, merged
            entries += [(text(i or b""), f) for i, f in await client.xrevrange(stream, count=count) or []]
        entries.sort(key=lambda entry: tuple(int(n) for n in entry[0].split("-")), reverse=True)
        out: list[dict[str, Any]] = []
        for entry_id, fields in entries[:count]:
            row: dict[str, Any] = {"entry_id": entry_id}
            row |= {text(k): text(v) for k, v in (fields or {}).items()}
            found = await client.hgetall(keys.meta(str(row.get("session_id", ""))))
            meta = {text(k): text(v) for k, v in found.items()}
            row["status"] = meta.get("status", "expired")
            row["real"] = meta.get("stream_id", "") == row["entry_id"]
            out.append(row)
        return out

    return await call(read(), "read the trajectories stream")
