"""Replica discovery: the pool follows a DNS name or a YAML file (`replicas_from`, docs/serving.md).

Each round (every `discovery.interval_s`) the source lists the replicas it knows. One that is new is probed
(`GET /health`) and admitted through `Services.add_replica`, which brings it to the current weight version before
it serves; one the source no longer lists is removed through `Services.remove_replica`, which fails its in-flight
streams over to the other replicas with every token kept. Replicas from `replicas` or the admin API are never
touched. A source that cannot be read (the name does not resolve, the file is missing or malformed) changes
nothing: the pool keeps what it has until the source answers again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

import dns.asyncresolver
import dns.exception
import dns.resolver
import yaml
from pydantic import TypeAdapter, ValidationError

from gateway.background import stop
from gateway.config import DiscoveryConfig, ReplicaConfig, ReplicaFields

logger = logging.getLogger(__name__)

_REPLICA_LIST = TypeAdapter(list[ReplicaConfig])


class ReplicaSource(Protocol):
    """Where discovered replicas come from."""

    description: str

    async def replicas(self) -> list[ReplicaConfig] | None:
        """The replicas the source lists now; None when it cannot be read (keep the pool as it is)."""
        ...


class DnsSource:
    """Every A and AAAA record of `host` is a replica at `http://address:port` with the fields of `template` (a
    Kubernetes headless Service lists its ready pods so)."""

    def __init__(
        self, host: str, port: int, template: ReplicaFields, resolver: dns.asyncresolver.Resolver | None = None
    ) -> None:
        self.host, self.port, self.template = host, port, template
        self.resolver = resolver if resolver is not None else dns.asyncresolver.Resolver()
        self.description = f"dns://{host}:{port}"

    async def replicas(self) -> list[ReplicaConfig] | None:
        addresses: list[str] = []
        failures = 0
        for kind in ("A", "AAAA"):
            try:
                # search: a short name (a Service's) is looked up in the pod's search domains, as resolv.conf says.
                answer = await self.resolver.resolve(self.host, kind, search=True)
            except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
                continue  # no record of this kind (or none at all: an empty Service lists no replica)
            except dns.exception.DNSException as exc:
                logger.warning("%s: %s lookup failed: %s", self.description, kind, exc)
                failures += 1
                continue
            addresses += [record.to_text() for record in answer]
        if failures:
            return None  # a server that did not answer proves nothing about which replicas are gone
        return [self._replica(address) for address in sorted(set(addresses))]

    def _replica(self, address: str) -> ReplicaConfig:
        host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return ReplicaConfig(url=f"http://{host}:{self.port}", **self.template.model_dump())


class FileSource:
    """A YAML list of replica entries (the keys of `replicas` in config.yaml), read again when it changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.description = f"file://{path}"
        self._seen: tuple[int, int] | None = None  # (mtime_ns, size) of the last good read
        self._last: list[ReplicaConfig] | None = None

    async def replicas(self) -> list[ReplicaConfig] | None:
        try:
            stat = self.path.stat()
        except OSError as exc:
            logger.warning("%s: cannot read it: %s", self.description, exc)
            return None
        if self._seen == (stat.st_mtime_ns, stat.st_size):
            return self._last
        try:
            data = yaml.safe_load(await asyncio.to_thread(self.path.read_text))
            replicas = _REPLICA_LIST.validate_python(data if data is not None else [])
        except (OSError, yaml.YAMLError, ValidationError) as exc:
            logger.warning("%s: not a list of replicas, ignored until it changes: %s", self.description, exc)
            return None
        self._seen, self._last = (stat.st_mtime_ns, stat.st_size), replicas
        return replicas


def make_source(replicas_from: str, settings: DiscoveryConfig) -> ReplicaSource:
    """The source `replicas_from` names (validated by the configuration)."""
    parts = urlsplit(replicas_from)
    if parts.scheme == "dns":
        assert parts.hostname is not None and parts.port is not None
        return DnsSource(parts.hostname, parts.port, settings.replica, resolver(settings.nameserver))
    return FileSource(Path(unquote(parts.netloc + parts.path)).expanduser())


def resolver(nameserver: str | None, timeout_s: float = 2.0) -> dns.asyncresolver.Resolver:
    """A resolver asking `nameserver` (host:port), or the system's; one lookup takes `timeout_s` at most."""
    if nameserver is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        host, _, port = nameserver.rpartition(":")
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    resolver.lifetime = timeout_s
    return resolver


class Discovery:
    """Keeps the replicas this gateway discovered equal to what `source` lists."""

    def __init__(
        self,
        source: ReplicaSource,
        interval_s: float,
        admit: Callable[[ReplicaConfig], Awaitable[bool]],
        remove: Callable[[str], Awaitable[None]],
        is_known: Callable[[str], bool],
    ) -> None:
        self.source = source
        self.interval_s = interval_s
        self._admit, self._remove, self._is_known = admit, remove, is_known
        self.discovered: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    async def sync(self) -> None:
        """One round: remove what the source dropped, admit what it added (each new one once it is healthy)."""
        listed = await self.source.replicas()
        if listed is None:
            return
        wanted = {replica.id: replica for replica in listed}
        for replica_id in sorted(self.discovered - wanted.keys()):
            logger.warning("%s no longer lists replica %s: removed", self.source.description, replica_id)
            self.discovered.discard(replica_id)
            if self._is_known(replica_id):
                await self._remove(replica_id)
        for replica_id, replica in wanted.items():
            if replica_id in self.discovered:
                continue
            if self._is_known(replica_id):
                continue  # configured or added by the admin API: not ours to manage
            if await self._admit(replica):
                logger.warning("%s lists replica %s: admitted", self.source.description, replica_id)
                self.discovered.add(replica_id)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="replica-discovery")

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception:  # a bug in one round must not end discovery for good
                logger.exception("replica discovery round failed")
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        if self._task is not None:
            await stop(self._task)
            self._task = None


__all__ = ["Discovery", "DnsSource", "FileSource", "ReplicaSource", "make_source"]
