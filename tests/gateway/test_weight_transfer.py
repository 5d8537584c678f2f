"""The two-phase in-memory weight update (issue 53 §1) over real simulator replicas, real sockets and Redis: the
trainer (this test) hosts the rendezvous, pushes the tensors straight into the engines, and commits; or never does.

The simulated model's one parameter is its weights' identity, so a transfer of `ckpt-N` must sample exactly as a load
of the path `ckpt-N` (`expected_tokens`)."""

from __future__ import annotations

import asyncio
import base64
import pickle
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch

from backends.sim.server import SimProcess
from gateway.config import ReplicaConfig
from gateway.weights import State
from tests.conftest import ADMIN, GatewayFactory, SimFactory
from tests.gateway.test_weight_states import SCENARIOS
from tests.gateway_helpers import PROMPT, expected_tokens, generate_body, publish
from tests.sim_helpers import sim_state
from trainers.tensor_transfer import serialize

TRANSFER = SCENARIOS["an in-memory transfer, committed or ended at its deadline"]


def replica_id(url: str) -> str:
    return url.removeprefix("http://")


def inline(identity: str, name: str = "weights") -> str:
    """SGLang's serialized named tensors, as the reference trainer sends them: the simulated model's one parameter,
    the identity's bytes."""
    return serialize([(name, torch.tensor(list(identity.encode()), dtype=torch.uint8))])


@pytest.fixture
async def rendezvous() -> AsyncIterator[tuple[int, asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]]:
    """The trainer as rank 0: it hosts the rendezvous; each engine that joins is a connection."""
    joined: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()

    async def on_join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await joined.put((reader, writer))

    server = await asyncio.start_server(on_join, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], joined
    finally:
        while not joined.empty():
            joined.get_nowait()[1].close()
        server.close()
        await server.wait_closed()


async def until_healthy(http: httpx.AsyncClient, url: str, replica: str, healthy: bool) -> None:
    """Until the gateway's health probes see `replica` (un)healthy."""
    async with asyncio.timeout(10):
        while True:
            status = (await http.get(f"{url}/admin/status", headers=ADMIN)).json()
            if {r["id"]: r["healthy"] for r in status["replicas"]}[replica] is healthy:
                return
            await asyncio.sleep(0.05)  # a poll's period, not synchronisation


async def open_tensor_transfer(http: httpx.AsyncClient, url: str, version: int, engines: int) -> None:
    """Begin an inline-tensor transfer of `version` through the gateway at `url`; return once the side of each of
    its `engines` is open."""
    body = {"version": version, "transfer": {"backend": "tensor"}}
    begun = await http.post(f"{url}/admin/weights", json=body, headers=ADMIN)
    assert begun.status_code == 202, begun.text
    opened = (await http.get(f"{url}/admin/weights/{version}", params={"wait_s": 10}, headers=ADMIN)).json()
    assert [e["state"] for e in opened["engines"]] == ["open"] * engines, opened


async def generate(http: httpx.AsyncClient, url: str, n: int, session: str) -> dict[str, object]:
    response = await http.post(f"{url}/generate", json=generate_body(PROMPT, n, session_id=session))
    assert response.status_code == 200, response.text
    answer: dict[str, object] = response.json()
    return answer


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
async def test_a_vllm_group_transfer_committed_serves_the_new_weights_exactly(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    rendezvous: tuple[int, asyncio.Queue],
    backend: str,
) -> None:
    """Over a process group per engine (`nccl`; `gloo`, vLLM's CPU build with the project's plugin), the trainer
    its rank 0: the layout, the engine joining, the broadcast, the commit, then exactly the new weights."""
    port, joined = rendezvous
    sim = await make_sim("vllm", weight_transfer=backend)
    gw = await make_gateway([ReplicaConfig(url=sim.url, backend="sim", dialect="vllm", weight_transfer=backend)])
    body = {"version": 1, "transfer": {"backend": backend, "master_address": "127.0.0.1", "master_port": port}}

    begun = await http.post(f"{gw.url}/admin/weights", json=body, headers=ADMIN)
    assert begun.status_code == 202, begun.text
    layout = begun.json()
    assert (layout["version"], layout["backend"], layout["commit"]) == (1, backend, "/admin/weights/1/commit")
    [engine] = layout["engines"]
    assert (engine["url"], engine["master_port"], engine["rank_offset"], engine["world_size"]) == (sim.url, port, 1, 2)
    assert engine["rendezvous"] is True  # told at once: the trainer knows to join before the engine is asked to

    joiner = await asyncio.wait_for(joined.get(), 10)  # the engine joined the trainer's group
    await joined.put(joiner)  # closed by the fixture
    channel = joiner[1]
    opened = (await http.get(f"{gw.url}/admin/weights/1", params={"wait_s": 10}, headers=ADMIN)).json()
    assert opened["status"] == "open" and opened["engines"][0]["state"] == "open"
    assert opened["engines"][0]["rendezvous"] is True
    assert gw.services.weights.state is State.TRANSFERRING
    other = await publish(http, gw.url, 2)
    assert other.status_code == 409 and "transfer of version 1" in other.json()["error"]["message"]

    # The trainer broadcasts the tensors straight into the engine: the update's metadata, then the bytes.
    data = b"ckpt-1"
    channel.write(data)
    await channel.drain()
    info = {"names": ["weights"], "dtype_names": ["uint8"], "shapes": [[len(data)]]}
    pushed = await http.post(f"{sim.url}/update_weights", json={"update_info": info})
    assert pushed.status_code == 200, pushed.text

    committed = await http.post(f"{gw.url}/admin/weights/1/commit", headers=ADMIN)
    assert committed.status_code == 200, committed.text
    assert committed.json()["status"] == "updated" and committed.json()["updated"] == [replica_id(sim.url)]
    assert gw.services.weights.machine.taken == TRANSFER
    state = await sim_state(http, sim.url)
    assert (state["weights"], state["version"]) == ("ckpt-1", "1")
    after = await generate(http, gw.url, 8, "after")
    assert after["versions"] == [1] * 8
    assert after["output_ids"] == expected_tokens(PROMPT, [1] * 8, 8)  # exactly as a load of the path ckpt-1
    again = await http.post(f"{gw.url}/admin/weights/1/commit", headers=ADMIN)
    assert again.status_code == 409


@pytest.mark.parametrize(("dialect", "backend"), [("vllm", "gloo"), ("sglang", "nccl")])
async def test_with_a_manifest_the_gateway_makes_the_engines_receiving_calls_and_the_trainer_only_broadcasts(
    make_sim: SimFactory,
    make_gateway: GatewayFactory,
    http: httpx.AsyncClient,
    rendezvous: tuple[int, asyncio.Queue],
    dialect: str,
    backend: str,
) -> None:
    """The manifest names the chunks the trainer will broadcast: the gateway calls each engine's receiving route per
    chunk (vLLM `/update_weights`, SGLang `/update_weights_from_distributed`), so the trainer never calls an engine.
    A manifest that declares more than the trainer broadcasts fails the engine at the commit deadline (held out)."""
    port, joined = rendezvous
    sim = await make_sim(dialect, weight_transfer=backend) if dialect == "vllm" else await make_sim(dialect)
    replica = ReplicaConfig(
        url=sim.url, backend="sim", dialect=dialect, weight_transfer=backend if dialect == "vllm" else None
    )
    gw = await make_gateway([replica], weights={"transfer_commit_timeout_s": 2.0})

    def transfer(data: bytes, chunks: int) -> dict[str, object]:
        chunk = [{"name": "weights", "dtype": "uint8", "shape": [len(data)]}]
        spec = {"backend": backend, "master_address": "127.0.0.1", "master_port": port, "manifest": [chunk] * chunks}
        return {"version": 1 if chunks == 1 else 2, "transfer": spec}

    begun = await http.post(f"{gw.url}/admin/weights", json=transfer(b"ckpt-1", 1), headers=ADMIN)
    assert begun.status_code == 202, begun.text
    channel = (await asyncio.wait_for(joined.get(), 10))[1]
    opened = (await http.get(f"{gw.url}/admin/weights/1", params={"wait_s": 10}, headers=ADMIN)).json()
    assert opened["engines"][0]["state"] == "open", opened
    channel.write(b"ckpt-1")  # the broadcast: nothing else from the trainer until the commit
    await channel.drain()
    committed = await http.post(f"{gw.url}/admin/weights/1/commit", headers=ADMIN)
    assert committed.status_code == 200 and committed.json()["status"] == "updated", committed.text
    shown = (await http.get(f"{gw.url}/admin/weights/1", headers=ADMIN)).json()
    assert shown["engines"][0]["state"] == "received"
    after = await generate(http, gw.url, 8, "after")
    assert after["versions"] == [1] * 8 and after["output_ids"] == expected_tokens(PROMPT, [1] * 8, 8)

    # Two chunks declared, one broadcast: the second receiving call waits for tensors that never come.
    begun = await http.post(f"{gw.url}/admin/weights", json=transfer(b"ckpt-2", 2), headers=ADMIN)
    assert begun.status_code == 202 and begun.json()["engines"][0]["rendezvous"] is False  # the group is kept
    assert (await http.get(f"{gw.url}/admin/weights/2", params={"wait_s": 10}, headers=ADMIN)).status_code == 200
    channel.write(b"ckpt-2")
    await channel.drain()
    committed = await http.post(f"{gw.url}/admin/weights/2/commit", headers=ADMIN)
    assert committed.status_code == 502, committed.text
    assert "manifest declared" in str(committed.json()), committed.text
    status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
    assert status["version"] == 1 and status["replicas"][0]["stale"] is True  # it may hold part of version 2
    channel.close()


async def test_a_manifest_is_validated(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang")
    gw = await make_gateway([sim])
    url = f"{gw.url}/admin/weights"
    tensor = {"name": "weights", "dtype": "uint8", "shape": [3]}
    inline = {"backend": "tensor", "manifest": [[tensor]]}
    refused = await http.post(url, json={"version": 1, "transfer": inline}, headers=ADMIN)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "transfer.manifest", refused.text
    grouped = {"backend": "nccl", "master_address": "127.0.0.1", "master_port": 29500}
    for manifest in ([[]], [[tensor | {"dtype": "float33"}]], [[tensor | {"shape": [-1]}]], [[{"name": "w"}]]):
        bad = await http.post(url, json={"version": 1, "transfer": grouped | {"manifest": manifest}}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", (manifest, bad.text)
    assert gw.services.weights.state is State.SERVING


async def test_a_transfer_never_committed_is_reloaded_from_the_last_path_and_serves_no_mixed_weights(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sims = [await make_sim("sglang") for _ in range(2)]
    gw = await make_gateway(sims, weights={"transfer_commit_timeout_s": 1.0})
    assert (await publish(http, gw.url, 1)).status_code == 200  # ckpt-1, a path the gateway knows
    before = await generate(http, gw.url, 8, "before")

    begun = await http.post(
        f"{gw.url}/admin/weights", json={"version": 2, "transfer": {"backend": "tensor"}}, headers=ADMIN
    )
    assert begun.status_code == 202, begun.text
    opened = (await http.get(f"{gw.url}/admin/weights/2", params={"wait_s": 10}, headers=ADMIN)).json()
    assert [e["state"] for e in opened["engines"]] == ["open", "open"]
    # Half the tensors land: one engine runs ckpt-2 under the label 1 (mixed weights), and then the trainer dies.
    pushed = await http.post(
        f"{sims[0].url}/update_weights_from_tensor", json={"serialized_named_tensors": [inline("ckpt-2")]}
    )
    assert pushed.status_code == 200 and pushed.json()["success"] is True, pushed.text
    assert (await sim_state(http, sims[0].url))["weights"] == "ckpt-2"
    waiting = asyncio.create_task(generate(http, gw.url, 8, "during"))  # held until the update ends

    during = await waiting
    assert during["versions"] == [1] * 8 and during["output_ids"] == before["output_ids"]  # no token on mixed weights
    status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
    assert (status["version"], status["state"]) == (1, "serving")
    assert [(r["stale"], r["version"]) for r in status["replicas"]] == [(False, 1), (False, 1)]
    for sim in sims:
        state = await sim_state(http, sim.url)
        assert (state["weights"], state["version"]) == ("ckpt-1", "1")  # reloaded from the last path
    assert (
        gw.services.weights.machine.taken
        == {
            (State.SERVING, State.PAUSING),
            (State.PAUSING, State.UPDATING),
            (State.UPDATING, State.RESUMING),
            (State.RESUMING, State.SERVING),
        }
        | TRANSFER
    )
    late = await http.post(f"{gw.url}/admin/weights/2/commit", headers=ADMIN)
    assert late.status_code == 409 and "ended as a failed update" in late.json()["error"]["message"]
    assert (await publish(http, gw.url, 2)).status_code == 200  # the next update goes as usual


async def test_a_transfer_never_committed_without_a_known_path_holds_the_replicas_out(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("sglang")
    gw = await make_gateway([sim], weights={"transfer_commit_timeout_s": 0.5})
    begun = await http.post(
        f"{gw.url}/admin/weights", json={"version": 1, "transfer": {"backend": "tensor"}}, headers=ADMIN
    )
    assert begun.status_code == 202
    await http.get(f"{gw.url}/admin/weights/1", params={"wait_s": 10}, headers=ADMIN)
    await http.post(f"{sim.url}/update_weights_from_tensor", json={"serialized_named_tensors": [inline("ckpt-1")]})

    ended = (await http.get(f"{gw.url}/admin/weights/1", params={"wait_s": 10}, headers=ADMIN)).json()
    while ended["status"] not in ("failed", "committed"):
        await gw.services.weights.version_after(0, 0.2)
        ended = (await http.get(f"{gw.url}/admin/weights/1", headers=ADMIN)).json()
    assert ended["status"] == "failed"
    status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
    assert status["version"] == 0 and [r["stale"] for r in status["replicas"]] == [True]  # never served silently
    assert (await publish(http, gw.url, 2)).status_code == 200  # a later load brings it back
    after = await generate(http, gw.url, 6, "after")
    assert after["output_ids"] == expected_tokens(PROMPT, [2] * 6, 6)


async def test_a_transfer_request_is_validated(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm")  # no --weight-transfer-config
    gw = await make_gateway([sim])
    url = f"{gw.url}/admin/weights"
    tensor = {"backend": "tensor"}

    for extra, param in (({"path": "ckpt-1"}, "transfer"), ({"source": "external"}, "transfer")):
        both = await http.post(url, json={"version": 1, "transfer": tensor} | extra, headers=ADMIN)
        assert both.status_code == 400, both.text
        error = both.json()["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", param) and "exactly one" in error["message"]
    for backend in ("nccl", "gloo"):
        grouped = await http.post(url, json={"version": 1, "transfer": {"backend": backend}}, headers=ADMIN)
        message = grouped.json()["error"]["message"]
        assert grouped.status_code == 400 and f'a "{backend}" transfer needs "master_address"' in message
    unknown = await http.post(url, json={"version": 1, "transfer": {"backend": "carrier-pigeon"}}, headers=ADMIN)
    assert unknown.status_code == 400 and "error" in unknown.json()
    unable = await http.post(url, json={"version": 1, "transfer": tensor}, headers=ADMIN)
    assert unable.status_code == 400 and "take no 'tensor'" in unable.json()["error"]["message"]
    nothing = await http.post(f"{gw.url}/admin/weights/1/commit", headers=ADMIN)
    assert nothing.status_code == 409
    assert gw.services.weights.state is State.SERVING and (await sim_state(http, sim.url))["paused"] is False


async def test_the_simulator_keeps_the_engines_transfer_rules(make_sim: SimFactory, http: httpx.AsyncClient) -> None:
    sglang, vllm, bare = (
        await make_sim("sglang"),
        await make_sim("vllm", weight_transfer="nccl"),
        await make_sim("vllm"),
    )
    tensors = {"serialized_named_tensors": [inline("ckpt-9")]}
    outside = await http.post(f"{sglang.url}/update_weights_from_tensor", json=tensors)
    assert outside.status_code == 400 and "begin_weight_update" in outside.json()["message"]
    assert (await http.post(f"{sglang.url}/end_weight_update", json={})).status_code == 400
    assert (await http.post(f"{sglang.url}/begin_weight_update", json={})).status_code == 200
    assert (await http.post(f"{sglang.url}/begin_weight_update", json={})).status_code == 400  # one at a time
    unknown = {"serialized_named_tensors": [inline("x", name="lm_head")]}
    assert (await http.post(f"{sglang.url}/update_weights_from_tensor", json=unknown)).status_code == 400
    # A pickle is opened with an allow-list, as the engine's is: nothing but a tensor's own pieces is called.
    hostile = {"serialized_named_tensors": [base64.b64encode(pickle.dumps(Path("/"))).decode()]}
    refused = await http.post(f"{sglang.url}/update_weights_from_tensor", json=hostile)
    assert refused.status_code == 400 and "no part of a pickled tensor" in refused.json()["message"]
    for garbage in ([], ["%%%"], [base64.b64encode(b'{"weights": "ckpt-9"}').decode()]):
        body = {"serialized_named_tensors": garbage}
        assert (await http.post(f"{sglang.url}/update_weights_from_tensor", json=body)).status_code == 400, garbage
    labelled = await http.post(f"{sglang.url}/update_weights_from_tensor", json=tensors | {"weight_version": "9"})
    assert labelled.status_code == 200
    assert (await http.get(f"{sglang.url}/model_info")).json()["weight_version"] == "9"
    assert (await http.post(f"{sglang.url}/end_weight_update", json={})).status_code == 200

    info = {"update_info": {"names": ["weights"], "dtype_names": ["uint8"], "shapes": [[1]]}}
    assert (await http.post(f"{vllm.url}/update_weights", json=info)).status_code == 500  # start first
    assert (await http.post(f"{vllm.url}/finish_weight_update", json={})).status_code == 500
    assert (await http.get(f"{vllm.url}/get_world_size")).json() == {"world_size": 1}
    refused = await http.post(f"{bare.url}/start_weight_update")
    assert refused.status_code == 500 and "--weight-transfer-config" in refused.json()["error"]["message"]


async def test_a_commit_sent_to_another_gateway_is_relayed_to_the_one_holding_the_transfer(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Behind a load balancer the commit reaches any gateway of the fleet: the one that got it relays it on the
    weights bus, the holder commits, and its result is the answer, on both."""
    sims = [await make_sim("sglang") for _ in range(2)]
    holder, other = await make_gateway(sims), await make_gateway(sims)
    assert (await publish(http, holder.url, 1)).status_code == 200
    await open_tensor_transfer(http, holder.url, 2, engines=2)
    for sim in sims:
        pushed = await http.post(
            f"{sim.url}/update_weights_from_tensor", json={"serialized_named_tensors": [inline("ckpt-2")]}
        )
        assert pushed.status_code == 200 and pushed.json()["success"] is True, pushed.text

    committed = await http.post(f"{other.url}/admin/weights/2/commit", headers=ADMIN)
    assert committed.status_code == 200, committed.text
    assert committed.json()["status"] == "updated"
    assert sorted(committed.json()["updated"]) == sorted(replica_id(s.url) for s in sims)
    assert holder.services.weights.machine.taken >= TRANSFER  # the holder ran the commit
    for i, gw in enumerate((holder, other)):
        assert gw.services.weights.version == 2
        after = await generate(http, gw.url, 6, f"after-{i}")
        assert after["versions"] == [2] * 6 and after["output_ids"] == expected_tokens(PROMPT, [2] * 6, 6)
    again = await http.post(f"{other.url}/admin/weights/2/commit", headers=ADMIN)
    assert again.status_code == 409  # nothing held anywhere now


async def test_any_gateway_shows_the_transfer_another_one_holds(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """Behind a load balancer the trainer's `GET /admin/weights/{version}` reaches any gateway: each shows the layout
    and state of the transfer the holder coordinates (with `wait_s`, once its sides are open), then its end."""
    sims = [await make_sim("sglang") for _ in range(2)]
    holder, other = await make_gateway(sims), await make_gateway(sims)
    assert (await publish(http, holder.url, 1)).status_code == 200
    begun = await http.post(
        f"{holder.url}/admin/weights", json={"version": 2, "transfer": {"backend": "tensor"}}, headers=ADMIN
    )
    assert begun.status_code == 202, begun.text

    shown = await http.get(f"{other.url}/admin/weights/2", params={"wait_s": 10}, headers=ADMIN)
    assert shown.status_code == 200, shown.text
    layout = shown.json()
    assert layout["status"] == "open" and [e["state"] for e in layout["engines"]] == ["open", "open"], layout
    assert 0 < layout["deadline_s"] <= begun.json()["deadline_s"]
    own = (await http.get(f"{holder.url}/admin/weights/2", headers=ADMIN)).json()
    assert {**layout, "deadline_s": None} == {**own, "deadline_s": None}  # what the holder answers itself

    for sim in sims:
        tensors = {"serialized_named_tensors": [inline("ckpt-2")]}
        assert (await http.post(f"{sim.url}/update_weights_from_tensor", json=tensors)).status_code == 200
    assert (await http.post(f"{holder.url}/admin/weights/2/commit", headers=ADMIN)).status_code == 200
    ended = await http.get(f"{other.url}/admin/weights/2", headers=ADMIN)
    assert ended.status_code == 200 and ended.json()["status"] == "committed", ended.text
    assert (await http.get(f"{other.url}/admin/weights/3", headers=ADMIN)).status_code == 409


async def test_an_engine_killed_mid_transfer_is_held_out_and_comes_back_only_with_a_path_update(
    make_sim: SimFactory, make_gateway: GatewayFactory, http: httpx.AsyncClient
) -> None:
    """The commit finishes the transfer on the engines that answer (207, partial); the one killed after it took
    some tensors is held out, and when it restarts (on its initial weights) nothing of the transfer can be loaded
    into it again: it stays out until a path update, never served on weights its label does not name."""
    survivor = await make_sim("sglang")
    victim = await asyncio.to_thread(SimProcess(["--dialect", "sglang"]).start)
    try:
        replicas = [survivor, ReplicaConfig(url=victim.url, backend="sim", dialect="sglang")]
        gw = await make_gateway(replicas)
        assert (await publish(http, gw.url, 1)).status_code == 200
        await open_tensor_transfer(http, gw.url, 2, engines=2)
        for url in (survivor.url, victim.url):
            tensors = {"serialized_named_tensors": [inline("ckpt-2")]}
            assert (await http.post(f"{url}/update_weights_from_tensor", json=tensors)).status_code == 200
        await asyncio.to_thread(victim.kill)

        committed = await http.post(f"{gw.url}/admin/weights/2/commit", headers=ADMIN)
        assert committed.status_code == 207, committed.text
        answer = committed.json()
        assert (answer["updated"], answer["stale"]) == ([replica_id(survivor.url)], [replica_id(victim.url)])
        after = await generate(http, gw.url, 6, "after")
        assert after["versions"] == [2] * 6 and after["output_ids"] == expected_tokens(PROMPT, [2] * 6, 6)

        await until_healthy(http, gw.url, replica_id(victim.url), False)
        await asyncio.to_thread(victim.restart)  # its initial weights, the label "default"
        await until_healthy(http, gw.url, replica_id(victim.url), True)
        await asyncio.sleep(0.6)  # three more probes (every 0.2 s), each of which checks its version
        status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
        by_id = {r["id"]: r for r in status["replicas"]}
        assert by_id[replica_id(victim.url)]["stale"] is True  # no path to catch it up from
        assert (await sim_state(http, victim.url))["weights"] == "init"
        assert (await publish(http, gw.url, 3)).status_code == 200  # a path update brings it back
        status = (await http.get(f"{gw.url}/admin/status", headers=ADMIN)).json()
        assert [(r["stale"], r["version"]) for r in status["replicas"]] == [(False, 3), (False, 3)]
    finally:
        await asyncio.to_thread(victim.stop)


async def test_an_engine_restarted_since_its_group_formed_has_the_trainer_join_it_again(
    make_gateway: GatewayFactory, http: httpx.AsyncClient, rendezvous: tuple[int, asyncio.Queue]
) -> None:
    """A kept group saves the rendezvous; an engine that restarts holds none. Once a probe missed it, the next
    transfer forms its group again (the layout says `rendezvous`). Kept instead, SGLang would open the update on the
    restarted engine without a group, and nothing the trainer sends could reach it."""
    port, joined = rendezvous
    engine = await asyncio.to_thread(SimProcess(["--dialect", "sglang"]).start)
    channels: list[asyncio.StreamWriter] = []
    try:
        gw = await make_gateway([ReplicaConfig(url=engine.url, backend="sim", dialect="sglang")])
        spec = {"backend": "nccl", "master_address": "127.0.0.1", "master_port": port}

        async def transfer(version: int) -> bool:
            """One transfer of `ckpt-<version>`, committed; whether the engine joined the trainer's group for it."""
            body = {"version": version, "transfer": spec}
            begun = await http.post(f"{gw.url}/admin/weights", json=body, headers=ADMIN)
            assert begun.status_code == 202, begun.text
            [laid_out] = begun.json()["engines"]
            opened = await http.get(f"{gw.url}/admin/weights/{version}", params={"wait_s": 10}, headers=ADMIN)
            [side] = opened.json()["engines"]
            assert side["state"] == "open", side
            assert side["rendezvous"] == laid_out["rendezvous"]  # the 202 told the trainer whether to join
            if side["rendezvous"]:
                channels.append((await asyncio.wait_for(joined.get(), 10))[1])
            data = f"ckpt-{version}".encode()
            channels[-1].write(data)
            await channels[-1].drain()
            info = {"names": ["weights"], "dtypes": ["uint8"], "shapes": [[len(data)]]}
            pushed = await http.post(f"{engine.url}/update_weights_from_distributed", json=info)
            assert pushed.status_code == 200, pushed.text
            assert (await http.post(f"{gw.url}/admin/weights/{version}/commit", headers=ADMIN)).status_code == 200
            state = await sim_state(http, engine.url)
            assert (state["weights"], state["version"]) == (f"ckpt-{version}", str(version))
            return bool(side["rendezvous"])

        assert await transfer(1)  # formed
        assert not await transfer(2)  # kept
        await asyncio.to_thread(engine.kill)
        await until_healthy(http, gw.url, replica_id(engine.url), False)
        await asyncio.to_thread(engine.restart)
        await until_healthy(http, gw.url, replica_id(engine.url), True)
        assert await transfer(3)  # formed again: the trainer joined it
        after = await generate(http, gw.url, 6, "after")
        assert after["versions"] == [3] * 6 and after["output_ids"] == expected_tokens(PROMPT, [3] * 6, 6)
    finally:
        for channel in channels:
            channel.close()
        await asyncio.to_thread(engine.stop)
