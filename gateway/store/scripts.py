"""The store's server-side Lua scripts, each one atomic on one session's slot, registered as redis-py script
objects (`register_script`).

Every script's KEYS share the session's hash tag `{id}` (its meta, its samples), so it runs on one Redis Cluster
slot; nothing that crosses slots (the activity index, the undelivered set, the streams) is touched by a script.
A script with more than one outcome answers a Lua table, `{outcome, value}`, which Python reads as a list.

A direct call (`await scripts.touch(keys=..., args=...)`) runs by SHA and loads the script where the server does
not know it (e.g. after a restart). Batched pipelines (`gateway.fastpath.redis_batching`) queue a script by SHA too
(`queue`); a NOSCRIPT reply there means the script did not run, and `rerun_unknown` runs it directly. The one
exception is `FINISH_ACTIVE`, sent as source (EVAL) in a pipeline whose later command must not run without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from gateway.trajectory import CHUNKED

__all__ = ["CLAIM_STREAM_ID", "FINISH_ACTIVE", "Scripts", "queue", "rerun_unknown"]

# One atomic write per sample on the session's slot. A script rather than MULTI or WATCH: the write must be
# refused when the session is no longer active (a finished trajectory never changes after delivery) and
# `sample_count` must only grow; MULTI cannot branch on what it reads, and WATCH costs a read round trip plus
# retries under contention, while the script does read, check and write in one round trip.
# A write either replaces the sample (kept = 0) or keeps its first `kept` chunks (gateway/trajectory.py), which
# it expects to end where `ends` says (`Sample.to_redis_extending`), and sets chunk `kept` and the fields it sends
# (the conversation and tools stay as stored when it sends none).
# A write that names its `writer` (the turn writing) replaces only what that writer or its `base` (the writer of
# what it extends; "" for a new sample) wrote last: a sample another turn wrote meanwhile (another process serving
# the same session) is left as it is.
# Answers {'saved', revision} (every write bumps the meta's `revision`); {'refused', status} where the session is
# not active ('missing' where it does not exist); {'rewrite'} where the stored chunks are not those expected
# (nothing written: the caller then sends the whole sample); {'taken', N} where another turn wrote the sample,
# N being the session's first free index.
# KEYS: meta, sample. ARGV: index + 1, now, replica ("" keeps the recorded one), TTL, kept, ends, writer, base,
# field, value, ...
SAVE_SAMPLE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'refused', 'missing'} end
if status ~= 'active' then return {'refused', status} end
if ARGV[7] ~= '' then
    local last = redis.call('HGET', KEYS[2], 'writer') or ''
    if last ~= ARGV[7] and last ~= ARGV[8] then
        return {'taken', tonumber(redis.call('HGET', KEYS[1], 'sample_count') or '0')}
    end
end
local kept = tonumber(ARGV[5])
if kept == 0 then
    redis.call('DEL', KEYS[2])
else
    local stored = redis.call('HGET', KEYS[2], 'chunk_ends')
    local ends = ARGV[6]
    if not stored or (stored ~= ends and string.sub(stored, 1, #ends + 1) ~= ends .. ',') then return {'rewrite'} end
    local _, commas = string.gsub(stored, ',', '')
    for chunk = kept + 1, commas do
        for _, name in ipairs({CHUNKED_NAMES}) do redis.call('HDEL', KEYS[2], name .. '.' .. chunk) end
    end
end
redis.call('HSET', KEYS[2], unpack(ARGV, 9))
redis.call('EXPIRE', KEYS[2], ARGV[4])
if tonumber(ARGV[1]) > tonumber(redis.call('HGET', KEYS[1], 'sample_count') or '0') then
    redis.call('HSET', KEYS[1], 'sample_count', ARGV[1])
end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'replica', ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ARGV[4])
return {'saved', redis.call('HINCRBY', KEYS[1], 'revision', 1)}
""".replace("CHUNKED_NAMES", ", ".join(f"'{name}'" for name in CHUNKED))

# Activity on an active session without a sample write (a new turn begins). Never creates a meta.
# Answers 1 where it recorded activity, 0 where the session is not active.
# KEYS: meta. ARGV: now, TTL.
TOUCH = """
if redis.call('HGET', KEYS[1], 'status') ~= 'active' then return 0 end
redis.call('HSET', KEYS[1], 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

# Step (4) of finish: set `stream_id` where it is not set, but only on an existing meta (a plain HSETNX on an
# expired or deleted meta would create a stub hash without TTL). Answers the id now stored, i.e. the winner (nil
# where the meta is gone). Re-running it after a lost reply answers the same winner, so the client's own retries
# are harmless. The winner is written again where it was stored already: every run is then a write Redis
# replicates, so a WAIT after it on the same connection covers the session's earlier writes too, whoever made
# them (gateway/store/slot_clients.py; a run that wrote nothing would leave WAIT counting an older write).
# A meta that is not finished answers an error, NOTFINISHED, and is left as it is: its finish was lost (a
# failover promoted a replica that never had it), and the finish, retried, finishes it again before any claim.
# KEYS: meta. ARGV: the entry id just added.
CLAIM_STREAM_ID = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status ~= 'finished' then return redis.error_reply('NOTFINISHED the session is ' .. status) end
local stored = redis.call('HGET', KEYS[1], 'stream_id') or ARGV[1]
redis.call('HSET', KEYS[1], 'stream_id', stored)
return stored
"""

# A named session's creation, unless its meta exists: one script instead of a WATCHed read and transaction (three
# round trips). Answers {'created'}, or {'exists', meta} with the existing meta (HGETALL: field, value, ...),
# which the caller reuses or refuses.
# KEYS: meta. ARGV: TTL, field, value, ...
CREATE_ABSENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists', redis.call('HGETALL', KEYS[1])} end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return {'created'}
"""

# Step (2) of a finish that brings no metadata to merge, in one script on the session's slot (the general
# path's WATCHed read and transaction take three round trips): an active session becomes finished with its reward,
# and its meta and samples get TTL `ttl_s`. Answers {'finished', meta} with the meta as it now is (HGETALL), or
# {'refused', status} for any other session, left as it is ('missing', 'abandoned', 'finished'), for the general
# path. The sample keys are named from ARGV: they share the meta's hash tag, so they live on its slot.
# KEYS: meta. ARGV: now, TTL, reward ('' for none), the sample keys' prefix (the index follows).
FINISH_ACTIVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'refused', 'missing'} end
if status ~= 'active' then return {'refused', status} end
redis.call('HSET', KEYS[1], 'status', 'finished', 'reward', ARGV[3], 'finished_at', ARGV[1], 'updated_at', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
for index = 0, tonumber(redis.call('HGET', KEYS[1], 'sample_count') or '0') - 1 do
    redis.call('EXPIRE', ARGV[4] .. index, ARGV[2])
end
return {'finished', redis.call('HGETALL', KEYS[1])}
"""


class Scripts:
    """The store's scripts, registered on one client (all but `FINISH_ACTIVE`, see the module docstring)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.save_sample: AsyncScript = client.register_script(SAVE_SAMPLE)
        self.touch: AsyncScript = client.register_script(TOUCH)
        self.claim_stream_id: AsyncScript = client.register_script(CLAIM_STREAM_ID)
        self.create_absent: AsyncScript = client.register_script(CREATE_ABSENT)


def queue(pipe: Pipeline, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> None:
    """Queue `script` by SHA on a pipeline; its reply goes through `rerun_unknown`. A Redis Cluster pipeline
    (redis-py refuses EVALSHA there) queues its source instead (EVAL, routed by the keys' slot)."""
    if isinstance(pipe, ClusterPipeline):
        pipe.eval(script.script, len(keys), *keys, *args)
    else:
        pipe.evalsha(script.sha, len(keys), *keys, *args)


async def rerun_unknown(reply: Any, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """A queued script's reply as it came (an error too, as an exception object), except NOSCRIPT (the server forgot
    the script, e.g. it restarted, so the script did not run): then the script's answer, run directly, which
    loads it."""
    if isinstance(reply, NoScriptError):
        return await script(keys=keys, args=args)
    return reply
