"""Replica discovery (`replicas_from`): a YAML file re-read when it changes, and a DNS name re-resolved, from a real
DNS server on loopback (dnslib's) asked by the gateway's resolver. A replica that appears is admitted once healthy;
one that disappears is removed while its streams go on elsewhere with every token."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from dnslib import QTYPE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer

from backends.sim.engine import EngineSettings
from backends.sim.server import SimServerSettings, bind_socket, serve_in_process
from gateway.config import ReplicaConfig
from gateway.routing.discovery import FileSource
from tests.conftest import GatewayFactory, SimFactory
from tests.gateway_helpers import expected_tokens, generate_body, slow, streams_under_way
from tests.sim_helpers import wait_for

NAME = "engines.rollout.test."


def replica_entry(url: str, dialect: str = "vllm") -> dict[str, Any]:
    return {"url": url, "backend": "sim", "dialect": dialect}


def write_replicas(path: Path, entries: list[dict[str, Any]]) -> None:
    """Replace the file in one step, as a config manager does (a reader never sees half a list)."""
    partial = path.with_suffix(".partial")
    partial.write_text(yaml.safe_dump(entries))
    partial.replace(path)


async def test_a_replica_listed_in_the_file_is_admitted_and_one_dropped_is_removed_its_streams_kept(
    make_sim: SimFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    static = await make_sim(*slow("vllm", 0.005))
    listed = await make_sim(*slow("vllm", 0.005))
    path = tmp_path / "replicas.yaml"
    write_replicas(path, [replica_entry(listed.url)])
    gw = await make_gateway(
        [static], replicas_from=f"file://{path}", discovery={"interval_s": 0.1}, routing={"balance_factor": 0.0}
    )
    pool = gw.services.pool
    listed_id = listed.url.removeprefix("http://")
    await wait_for(lambda: pool.get(listed_id) in pool.candidates(), what="the listed replica admitted")

    prompts = [[7, i, 5] for i in range(6)]
    total = 300
    async with streams_under_way(gw, prompts, total, "file") as tasks:
        await wait_for(lambda: (r := pool.get(listed_id)) is not None and r.in_flight > 0, what="a stream on it")
        write_replicas(path, [])
        await wait_for(lambda: pool.get(listed_id) is None, what="the dropped replica removed")
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    moved = 0
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None and result.final["finish_reason"] == "length"
        assert result.output_ids == expected_tokens(prompt, result.final["versions"], total)
        moved += listed_id in result.final["replicas"]
    assert moved >= 1
    assert [r.id for r in pool.all()] == [static.url.removeprefix("http://")]  # the configured one is not touched


async def test_a_malformed_or_missing_file_changes_nothing(
    make_sim: SimFactory, make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    listed = await make_sim("vllm")
    path = tmp_path / "replicas.yaml"
    write_replicas(path, [replica_entry(listed.url)])
    gw = await make_gateway([], replicas_from=f"file://{path}", discovery={"interval_s": 0.05})
    pool = gw.services.pool
    listed_id = listed.url.removeprefix("http://")
    await wait_for(lambda: pool.get(listed_id) is not None, what="the listed replica admitted")
    source = FileSource(path)
    for broken in ("- url: [not, a, url]\n", "{: no yaml\n"):
        path.write_text(broken)
        assert await source.replicas() is None
        await asyncio.sleep(0.3)  # several rounds: the replica stays
        assert pool.get(listed_id) is not None
    path.unlink()
    await asyncio.sleep(0.3)
    assert pool.get(listed_id) is not None
    write_replicas(path, [])
    await wait_for(lambda: pool.get(listed_id) is None, what="removed once the file says so")


async def test_a_listed_replica_that_does_not_answer_is_admitted_once_it_does(
    make_gateway: GatewayFactory, tmp_path: Path
) -> None:
    sock = bind_socket()  # the port is reserved; nothing answers on it yet
    port = sock.getsockname()[1]
    sock.close()
    path = tmp_path / "replicas.yaml"
    url = f"http://127.0.0.1:{port}"
    write_replicas(path, [replica_entry(url)])
    gw = await make_gateway([], replicas_from=f"file://{path}", discovery={"interval_s": 0.05})
    await asyncio.sleep(0.3)
    assert gw.services.pool.all() == []  # probed each round, never admitted while it does not answer
    async with serve_in_process(SimServerSettings(dialect="vllm", engine=EngineSettings()), port=port):
        await wait_for(lambda: gw.services.pool.get(f"127.0.0.1:{port}") is not None, what="admitted when up")


class Records(BaseResolver):  # type: ignore[misc]
    """A zone of one name whose A records the test changes while the server runs."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        question = request.q
        if str(question.qname) == NAME and question.qtype == QTYPE.A:
            with self.lock:
                for address in self.addresses:
                    reply.add_answer(RR(NAME, QTYPE.A, rdata=A(address), ttl=1))
        return reply


@contextlib.contextmanager
def dns_server(records: Records) -> Iterator[int]:
    """dnslib's UDP server on 127.0.0.1 (a free port), in a thread; yields its port."""
    server = DNSServer(records, address="127.0.0.1", port=0, logger=DNSLogger("-request,-reply,-truncated", logf=print))
    server.start_thread()
    try:
        yield server.server.server_address[1]
    finally:
        server.stop()
        server.server.server_close()


@contextlib.asynccontextmanager
async def sims_on_one_port(hosts: list[str]) -> AsyncIterator[int]:
    """A simulator on each loopback address of `hosts`, all on one port (a DNS name gives addresses, not ports)."""
    probe = bind_socket(hosts[0])
    port = probe.getsockname()[1]
    probe.close()
    async with contextlib.AsyncExitStack() as stack:
        for host in hosts:
            settings = SimServerSettings(dialect="vllm", engine=EngineSettings(token_delay_s=0.005))
            await stack.enter_async_context(serve_in_process(settings, host=host, port=port))
        yield port


async def test_every_a_record_of_the_name_is_a_replica_followed_as_the_records_change(
    make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    records = Records()
    records.addresses = ["127.0.0.2"]
    hosts = ["127.0.0.2", "127.0.0.3"]
    with dns_server(records) as dns_port:
        async with sims_on_one_port(hosts) as port:
            gw = await make_gateway(
                [],
                replicas_from=f"dns://{NAME.rstrip('.')}:{port}",
                discovery={"interval_s": 0.1, "nameserver": f"127.0.0.1:{dns_port}", "replica": {"backend": "sim"}},
            )
            pool = gw.services.pool
            ids = [f"{host}:{port}" for host in hosts]
            await wait_for(lambda: [r.id for r in pool.candidates()] == ids[:1], what="the first record admitted")
            with records.lock:
                records.addresses = list(hosts)
            await wait_for(lambda: sorted(r.id for r in pool.candidates()) == ids, what="the second one admitted")
            for prompt in ([3, 1, 4], [2, 7, 1], [8, 2, 8]):  # served by whichever replica the session lands on
                answer = await http.post(f"{gw.url}/generate", json=generate_body(prompt, 8))
                assert answer.status_code == 200, answer.text
                assert answer.json()["output_ids"] == expected_tokens(prompt, [0] * 8, 8)
            with records.lock:
                records.addresses = ["127.0.0.3"]
            await wait_for(lambda: [r.id for r in pool.all()] == ids[1:], what="the first one removed")


async def test_a_dns_server_that_does_not_answer_changes_nothing(make_gateway: GatewayFactory) -> None:
    records = Records()
    records.addresses = ["127.0.0.2"]
    async with sims_on_one_port(["127.0.0.2"]) as port:
        with dns_server(records) as dns_port:
            gw = await make_gateway(
                [],
                replicas_from=f"dns://{NAME.rstrip('.')}:{port}",
                discovery={"interval_s": 0.1, "nameserver": f"127.0.0.1:{dns_port}", "replica": {"backend": "sim"}},
            )
            await wait_for(lambda: len(gw.services.pool.all()) == 1, what="admitted")
        # The server is gone: every lookup times out, which proves nothing about the replica; it stays.
        await asyncio.sleep(2.5)
        assert len(gw.services.pool.all()) == 1


@pytest.mark.parametrize(
    ("source", "error"),
    [
        ("dns://engines", "names a host and the engines' port"),
        ("http://engines:8000", "dns://name:port or file://path"),
        ("file://", "names a YAML file"),
    ],
)
def test_a_bad_source_is_a_config_error(source: str, error: str) -> None:
    from gateway.config import Settings

    with pytest.raises(ValueError, match=error):
        Settings(replicas_from=source)


def test_the_replica_template_is_checked_like_a_replica() -> None:
    from gateway.config import Settings

    with pytest.raises(ValueError, match="contradicts backend"):
        Settings(discovery={"replica": {"backend": "vllm", "dialect": "sglang"}})
    with pytest.raises(ValueError, match="url"):
        Settings(discovery={"replica": {"backend": "vllm", "url": "http://a:1"}})
    assert ReplicaConfig(url="http://a:1", backend="vllm").id == "a:1"
