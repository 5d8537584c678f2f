"""Redis commands packed by hiredis in the asyncio client, as redis-py's sync client already packs them.

redis-py's asyncio `Connection` packs every command into the RESP wire format in Python, argument by argument,
even when hiredis is installed (its sync `Connection` uses hiredis's C packer then). A session turn's pipeline
(the sample write's script and fields, the meta read, the touch) costs several times more to pack that way than
with hiredis, a visible share of a profile of short `/v1/completions` turns (docs/benchmarks.md).

The bytes on the wire are the same: hiredis's packer, which the sync client uses, and for what that packer does
not take as it is (a command name with a space, memoryviews, arguments of other types) the sync client's own
wrapper of it (`redis.connection.HiredisRespSerializer`), which splits the name, converts memoryviews and refuses
the rest with `DataError`, as the Python packer does. Only who builds the bytes changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar, cast

from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    import hiredis

__all__ = ["with_hiredis_packing"]

C = TypeVar("C", bound=AbstractConnection)

_PACKER = HiredisRespSerializer()
_PACKED: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _pack(args: tuple[Any, ...]) -> bytes:
    """One command in RESP. The common command (a name without a space, arguments of the types hiredis takes) goes
    to hiredis at once; the rest through redis-py's serializer (slower, pure Python), which splits
    the name, converts memoryviews and raises `DataError` for arguments Redis cannot take."""
    name = args[0]
    if (" " not in name) if isinstance(name, str) else (b" " not in name):
        try:
            packed: bytes = hiredis.pack_command(args)
            return packed
        except TypeError:
            pass
    slow: bytes = _PACKER.pack(*args)[0]
    return slow


class _HiredisPacking:
    """Overrides a redis.asyncio connection class's packing (mixed in before it)."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [_pack(args)]

    def pack_commands(self, commands: Iterable[Iterable[Any]]) -> list[bytes]:
        # One buffer for the whole pipeline, as the Python packer joins its small pieces (one socket write either way).
        return [b"".join([_pack(tuple(command)) for command in commands])]


def with_hiredis_packing(connection_class: type[C]) -> type[C]:
    """`connection_class` (a redis.asyncio connection class: TCP, Unix socket, TLS) packing with hiredis; the class
    itself where hiredis is not installed."""
    if not HIREDIS_AVAILABLE:
        return connection_class
    packed = _PACKED.get(connection_class)
    if packed is None:
        name = f"HiredisPacked{connection_class.__name__}"
        packed = _PACKED[connection_class] = type(name, (_HiredisPacking, connection_class), {})
    return cast("type[C]", packed)
