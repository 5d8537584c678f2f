"""`benchmarks.loadgen` against a simulator replica: episodes (`episode_turns`) end a stream's session after so many
turns and open a new one with a fresh conversation."""

from __future__ import annotations

from collections import defaultdict

import httpx
from tokenizers import Tokenizer

from benchmarks.loadgen import LoadGen, Spec, session_of
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
