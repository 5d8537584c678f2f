"""`redis:`: where sessions, samples and the trajectory stream live, and how its URL is shown safely."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated
from urllib.parse import parse_qsl, urlencode, urlsplit

from pydantic import AfterValidator, Field, model_validator

from gateway.config.section import Seconds, Section

_CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
_DEFAULT_PORT = 6379


def _check_redis_url(url: str) -> str:
    scheme = urlsplit(url).scheme
    if url and scheme not in ("redis", "rediss", "unix", *_CLUSTER_SCHEMES):
        raise ValueError(
            'must be "" (embedded redis-server), a redis://, rediss:// or unix:// URL, or a Redis Cluster\'s '
            "redis+cluster://host:port[,host:port...] (rediss+cluster:// with TLS)"
        )
    if scheme in _CLUSTER_SCHEMES:
        cluster_nodes(url)
    return url


def cluster_nodes(url: str) -> list[tuple[str, int]]:
    """The startup nodes (host, port) a `redis+cluster://[user:password@]host[:port][,host[:port]...]` URL lists
    (port 6379 where none is given; an IPv6 host in brackets). A node without a host, or whose port is not one, is a
    `ValueError` that says which node by its place, never its text: a URL missing its `@` holds the password there."""
    addresses = urlsplit(url).netloc.rpartition("@")[2].split(",")
    return [_node(address, index, len(addresses)) for index, address in enumerate(addresses, 1)]


def _node(address: str, index: int, count: int) -> tuple[str, int]:
    if address.endswith("]") or ":" not in address:  # no port: a name, IPv4, or [IPv6]
        host, port = address, ""
    else:
        host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host:
        raise ValueError(f"Redis Cluster node {index} of {count} has no host (redis+cluster://host:port[,...])")
    if not port:
        return host, _DEFAULT_PORT
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"the port of Redis Cluster node {index} of {count} is not a number from 1 to 65535")
    return host, int(port)


def without_credentials(url: str) -> str:
    """`url` fit to print or show: without a user, password or `password=` query parameter (redis-py reads both
    `redis://:secret@host` and `?password=secret`); otherwise exactly as given (a unix:// URL included)."""
    parts = urlsplit(url)
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    query = [(key, value) for key, value in pairs if key != "password"]
    if "@" not in parts.netloc and len(query) == len(pairs):
        return url
    netloc = parts.netloc.rpartition("@")[2]
    rest = parts.path + (f"?{urlencode(query)}" if query else "") + (f"#{parts.fragment}" if parts.fragment else "")
    return f"{parts.scheme}://{netloc}{rest}"


RedisUrlStr = Annotated[str, AfterValidator(_check_redis_url)]


class RedisConfig(Section):
    """Where sessions, samples and the trajectory stream live."""

    url: RedisUrlStr = Field("", repr=False, description='"" starts an embedded redis-server on a free port.')
    data_dir: Path | None = Field(None, description="Data/AOF folder of the embedded server; None = a temp dir.")
    socket_timeout_s: Seconds = Field(5.0, description="Connect and per-command timeout, seconds.")
    retry_budget_s: Seconds = Field(30.0, description="How long writes are retried before StoreError, seconds.")
    max_connections: int = Field(
        512, ge=1, description="Size of the Redis connection pool; when all are busy, commands wait for one."
    )
    durable_replicas: int | None = Field(
        None,
        ge=0,
        description=(
            "Replicas that must hold a session's finish and the weight version record (rg:weights) before either is "
            "acknowledged (WAIT on the connection that wrote, on the master that owns the key); fewer: the finish is "
            "retried for retry_budget_s, then a 503, and a weight update a 503 weights_not_recorded. 0: no WAIT "
            "(asynchronous replication: a failover may lose the last writes). null: 1 on a Redis Cluster whose "
            "layout lists a replica, else 0 (a single server, a cluster of masters only)."
        ),
    )
    wait_timeout_ms: int = Field(
        1000,
        ge=1,
        description=(
            "How long one WAIT waits for durable_replicas replicas, milliseconds; below socket_timeout_s (left at its "
            "default, at most half socket_timeout_s)."
        ),
    )

    @model_validator(mode="after")
    def _wait_within_socket_timeout(self) -> RedisConfig:
        chosen = self.model_fields_set & {"wait_timeout_ms", "durable_replicas"}
        if chosen and self.durable_replicas != 0 and self.wait_timeout_ms >= self.socket_timeout_s * 1000:
            raise ValueError(
                f"wait_timeout_ms ({self.wait_timeout_ms}) must be below socket_timeout_s "
                f"({self.socket_timeout_s:g} s): the connection would time out before WAIT answers"
            )
        return self

    @property
    def wait_timeout_effective_ms(self) -> int:
        """The WAIT timeout sent: `wait_timeout_ms`, or, where neither it nor `durable_replicas` was set (a short
        `socket_timeout_s` alone must not refuse the configuration), at most half `socket_timeout_s`."""
        if self.model_fields_set & {"wait_timeout_ms", "durable_replicas"}:
            return self.wait_timeout_ms
        return min(self.wait_timeout_ms, max(1, int(self.socket_timeout_s * 500)))
