"""`benchmarks.loadgen` against a simulator replica: episodes (`episode_turns`) end a stream's session after so many
turns and open a new one with a fresh conversation; and the counters `benchmarks.updates` reads from an engine's
`/metrics` after such a load."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import replace

import httpx
from tokenizers import Tokenizer

from benchmarks.loadgen import LoadGen, Spec, session_of
from benchmarks.update_engine import EngineCounters
from benchmarks.update_timeline import COUNTERS, SimCounters
from gateway.config import DEFAULT_TOKENIZER
from tests.conftest import SimFactory


async def test_episodes_start_new_sessions_with_a_fresh_conversation(
    make_sim: SimFactory, http: httpx.AsyncClient
) -> None:
    sim = await make_sim("vllm", tokenizer_path=str(DEFAULT_TOKENIZER))
    (await http.post(f"{sim.url}/sim/prompt_log", json={"head": 8})).raise_for_status()
    spec = Spec(
        urls=[sim.url],
        tag=6,
        sessions=2,
        turns=0,
        requests=8,
        min_tokens=2,
        max_tokens=2,
        stream=True,
        grow=True,
        echo=True,
        prompt_words=8,
        episode_turns=2,
    )
    result = await LoadGen(spec).run(spec.tag, 0, spec.requests)
    assert (result.ok, result.errors) == (8, 0), result.error_samples

    tokenizer = Tokenizer.from_file(str(DEFAULT_TOKENIZER / "tokenizer.json"))
    prompt_lengths: dict[int, list[int]] = defaultdict(list)  # per session number, in order
    for head, length, _ in (await http.get(f"{sim.url}/sim/prompt_log")).json()["requests"]:
        found = session_of(tokenizer.decode(head))
        assert found is not None and found[0] == spec.tag
        prompt_lengths[found[1]].append(length)
    assert sum(map(len, prompt_lengths.values())) == 8
    assert len(prompt_lengths) >= 4 and all(len(turns) <= 2 for turns in prompt_lengths.values()), prompt_lengths
    # Each episode opens with the first turn's prompt again, not the previous episode's conversation.
    openings = [turns[0] for turns in prompt_lengths.values()]
    assert max(openings) < min(turns[1] for turns in prompt_lengths.values() if len(turns) == 2)


async def test_an_engines_metrics_read_as_the_simulators_counters(make_sim: SimFactory) -> None:
    """The simulator's vLLM dialect exports its counters under vLLM's metric names: read through `/metrics`
    (`EngineCounters`, the `--engine vllm` source of `benchmarks.updates`) they equal `/sim/state`'s."""
    sim = await make_sim("vllm", tokenizer_path=str(DEFAULT_TOKENIZER))
    spec = Spec(urls=[sim.url], tag=8, sessions=2, turns=3, requests=0, min_tokens=4, max_tokens=8, stream=True)
    assert (await LoadGen(replace(spec, grow=True, echo=True)).run(spec.tag, spec.turns, 0)).ok == 6
    async with httpx.AsyncClient() as client:
        engine, sim_state = (
            await EngineCounters("vllm", sim.url).counters(client),
            await SimCounters((sim.url,)).counters(client),
        )
        assert not await EngineCounters("vllm", sim.url).busy(client)
    assert sim_state["generation_tokens"] >= 6 * 4 and sim_state["prefix_cache_queries"] > 0
    assert {name: engine[name] for name in COUNTERS} == {name: sim_state[name] for name in COUNTERS}
    assert math.isnan(engine["recomputed_tokens"])  # vLLM counts none
