"""The gateway's Redis client packs commands with hiredis: the same bytes as redis-py's Python packer, a real server
reads them back, and arguments Redis cannot take fail as they did."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import DataError

from gateway.embedded_redis import EmbeddedRedis
from gateway.fastpath.redis_packing import with_hiredis_packing
from gateway.store import connect

COMMANDS: list[tuple[Any, ...]] = [
    ("SET", "k", "héllo wörld"),
    ("HSET", "h", "int", -5, "big", 2**70, "float", 0.1, "inf", float("inf"), "bytes", b"\x00\xff" * 5000),
    ("SET", "view", memoryview(b"a memoryview")),
    ("CONFIG GET", "maxmemory"),  # a command name with a space is split, as redis-py does
    (b"CLIENT SETNAME", b"gateway"),
    ("EVAL", "return redis.call('GET', KEYS[1])", 1, "k"),
]


async def test_the_store_client_packs_as_redis_py_does(redis_server: EmbeddedRedis) -> None:
    client = connect(redis_server.url)
    pool = client.connection_pool
    pool.connection_class = with_hiredis_packing(pool.connection_class)  # as the gateway's services wire it
    try:
        connection_class = pool.connection_class
        assert connection_class.pack_command is not aioredis.Connection.pack_command, "not packed by hiredis"
        packed = connection_class(host="127.0.0.1")
        python = aioredis.Connection(host="127.0.0.1")
        assert b"".join(packed.pack_commands(COMMANDS)) == b"".join(python.pack_commands(COMMANDS))
        for command in COMMANDS:
            assert b"".join(packed.pack_command(*command)) == b"".join(python.pack_command(*command))
    finally:
        await client.aclose()


@pytest.mark.parametrize("over", ["tcp", "unix socket"])
async def test_a_real_server_reads_what_the_client_packs(redis_server: EmbeddedRedis, over: str) -> None:
    url = redis_server.url if over == "tcp" else redis_server.local_url
    assert url.startswith("unix://") == (over == "unix socket")
    client = connect(url)
    try:
        await client.flushall()
        async with client.pipeline(transaction=False) as pipe:
            for command in COMMANDS:
                pipe.execute_command(*command)
            replies = await pipe.execute()
        assert replies[0] is True and replies[1] == 5 and replies[2] is True
        assert replies[3] == {"maxmemory": "0"} and replies[4] == b"OK"
        assert replies[5] == "héllo wörld".encode()
        assert await client.get("view") == b"a memoryview"
        stored = await client.hgetall("h")
        assert stored == {
            b"int": b"-5",
            b"big": str(2**70).encode(),
            b"float": b"0.1",
            b"inf": b"inf",
            b"bytes": b"\x00\xff" * 5000,
        }
        with pytest.raises(DataError):
            await client.set("k", None)  # type: ignore[arg-type]
        assert await client.get("k") == "héllo wörld".encode(), "a refused command changed nothing"
    finally:
        await client.aclose()
