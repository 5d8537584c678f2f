"""The session manager over the real trajectory store (embedded Redis): its cache of samples, and the choice of
the sample a turn extends.

A turn runs as `TurnRunner` runs it: take the session's lock, `begin_*_turn`, generate, `record`, save the
sample, release the lock. The cache is LRU-bounded; the first tests make it tiny so that other sessions evict one
while its turn is in flight.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis
from tokenizers import pre_tokenizers
from tokenizers.normalizers import NFC

from backends.base import SamplingParams
from gateway.config import DEFAULT_TOKENIZER
from gateway.generation import GenerationRequest, GenerationState, sampling_used
from gateway.session.samples import SessionManager, Turn
from gateway.session.working_sample import WorkingSample
from gateway.store import Keys, TrajectoryStore
from gateway.tokenization import ChatTokenizer, TextCheck

TOKENIZER = ChatTokenizer.load(DEFAULT_TOKENIZER)


def sampled(turn: Turn, output_ids: list[int]) -> GenerationState:
    request = GenerationRequest("r", turn.prompt_ids, SamplingParams(max_tokens=len(output_ids)))
    state = GenerationState(request, output_ids=list(output_ids), logprobs=[-0.5] * len(output_ids))
    state.versions = [0] * len(output_ids)
    state.finish_reason = "length"
    return state


async def finish_turn(sessions: SessionManager, store: TrajectoryStore, turn: Turn, output_ids: list[int]) -> None:
    sample = sessions.record(turn, sampled(turn, output_ids), None)
    await store.save_sample(turn.session_id, turn.sample.index, sample)


async def one_turn(sessions: SessionManager, store: TrajectoryStore, session_id: str, prompt: list[int]) -> Turn:
    async with sessions.lock(session_id):
        turn = await sessions.begin_completion_turn(session_id, prompt)
        await finish_turn(sessions, store, turn, [7, 8])
    return turn


async def test_a_session_evicted_from_the_cache_during_its_turn_keeps_every_sample(redis: Redis) -> None:
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store, cache_size=1)
    for session_id in ("a", "b"):
        await store.ensure_session(session_id, {})
    await one_turn(sessions, store, "a", [1, 2, 3])  # sample 0

    lock = sessions.lock("a")
    async with lock:
        second = await sessions.begin_completion_turn("a", [4, 5, 6])  # extends nothing: sample 1
        await one_turn(sessions, store, "b", [9, 9])  # another session's turn meanwhile: "a" leaves the cache
        await finish_turn(sessions, store, second, [10, 11])
    assert second.sample.index == 1
    third = await one_turn(sessions, store, "a", [12, 13])  # a third unrelated prompt: sample 2, not 1 again

    assert third.sample.index == 2
    stored = await store.load_samples("a")
    assert [s.prompt_ids.tolist() for s in stored] == [[1, 2, 3], [4, 5, 6], [12, 13]]


async def test_a_raw_completion_extends_only_a_sample_whose_every_id_it_repeats(redis: Redis) -> None:
    """The match checks a sample's last id first (cheap, in a session of many samples), then all of them."""
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store)
    await store.ensure_session("p", {})
    await one_turn(sessions, store, "p", [1, 2, 3])  # sample 0: [1, 2, 3] + [7, 8]
    same_end = await one_turn(sessions, store, "p", [1, 9, 3, 7, 8, 4])  # sample 0's last id in place, not its 2nd
    assert same_end.new_sample and same_end.sample.index == 1
    other_end = await one_turn(sessions, store, "p", [1, 2, 3, 7, 6, 4])
    assert other_end.new_sample and other_end.sample.index == 2
    extends = await one_turn(sessions, store, "p", [1, 2, 3, 7, 8, 5])
    assert not extends.new_sample and extends.sample.index == 0 and extends.env_ids == [5]
    assert [s.prompt_ids.tolist() + s.response_ids.tolist() for s in await store.load_samples("p")] == [
        [1, 2, 3, 7, 8, 5, 7, 8],
        [1, 9, 3, 7, 8, 4, 7, 8],
        [1, 2, 3, 7, 6, 4, 7, 8],
    ]


def scanned(samples: list[WorkingSample], prompt: list[int]) -> WorkingSample | None:
    """What a raw completion extends, by the definition: a scan from the most recent sample for one with turns, not
    cancelled, whose ids are a proper prefix of the prompt."""
    for sample in reversed(samples):
        ids = sample.ids
        if sample.num_turns and not sample.cancelled and len(ids) < len(prompt) and prompt[: len(ids)] == ids:
            return sample
    return None


async def test_raw_completions_find_their_sample_as_a_scan_of_every_sample_would(redis: Redis) -> None:
    """The index of samples by where they end (`_Known`) against the plain scan, over 400 turns of one session:
    prompts that extend a random earlier sample (or one of its prefixes, or nothing), nested prefixes, branches
    (n = 3), cancelled turns and empty replies."""
    rng = random.Random(7)
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store)
    await store.ensure_session("many", {})
    extended = 0
    for step in range(400):
        samples = await sessions.samples("many")
        base = rng.choice(samples) if samples and rng.random() < 0.6 else None
        ids = base.ids if base is not None else []
        if ids and rng.random() < 0.2:
            ids = ids[: rng.randrange(len(ids))]  # a prefix of a sample: may extend an older, shorter one
        prompt = ids + [rng.randrange(3, 40) for _ in range(rng.randrange(1, 4))]
        expected = scanned(samples, prompt)
        async with sessions.lock("many"):
            turn = await sessions.begin_completion_turn("many", prompt)
            assert turn.new_sample == (expected is None), step
            if expected is not None:
                assert turn.sample is expected, step
                extended += 1
            turns = sessions.branch(turn, 3) if step % 17 == 0 else [turn]
            for branch in turns:
                state = sampled(branch, [rng.randrange(3, 40) for _ in range(rng.randrange(0, 3))])
                state.cancelled = rng.random() < 0.05
                sessions.record(branch, state, None)
    samples = await sessions.samples("many")
    assert extended > 100 and len(samples) > 100
    # The index holds every sample once, under its current end (nothing left behind where a sample used to end).
    ends = sessions._cache["many"].ends
    assert ends is not None
    filed = [
        ((length, last), sample)
        for length, by_last in ends.items()
        for last, bucket in by_last.items()
        for sample in bucket
    ]
    assert sorted(id(sample) for _, sample in filed) == sorted(id(sample) for sample in samples)
    assert all(end == (sample.length, (sample.response_ids or sample.prompt_ids)[-1]) for end, sample in filed)


async def test_a_session_with_a_turn_in_flight_keeps_its_lock_when_evicted(redis: Redis) -> None:
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store, cache_size=1)
    for session_id in ("a", "b"):
        await store.ensure_session(session_id, {})
    lock = sessions.lock("a")
    async with lock:
        await sessions.begin_completion_turn("a", [1, 2, 3])
        await one_turn(sessions, store, "b", [9, 9])
        assert sessions.lock("a") is lock  # a second turn of "a" would wait for this one


async def served_turn(sessions: SessionManager, session_id: str, prompt: list[int], output_ids: list[int]) -> Turn:
    """A turn as `TurnRunner` serves it: open the session, begin, record, save."""
    store = sessions.store
    assert isinstance(store, TrajectoryStore)
    async with sessions.lock(session_id):
        if await sessions.open(session_id) is None:
            await store.create_session({}, session_id, absent=True)
        turn = await sessions.begin_completion_turn(session_id, prompt)
        await sessions.save(turn, sessions.record(turn, sampled(turn, output_ids), None))
    return turn


async def test_a_process_reads_a_session_back_once_another_one_served_it(redis: Redis) -> None:
    """Two gateway processes on one Redis: each keeps the sessions it served, and trusts that copy only at the
    revision it last saw; in between, its own turns read nothing back."""
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    here, there = SessionManager(TOKENIZER, store), SessionManager(TOKENIZER, store)
    first = await served_turn(here, "roam", [1, 2, 3], [4, 5])
    second = await served_turn(here, "roam", [1, 2, 3, 4, 5, 6], [7])
    assert here.reloads == 0 and not second.new_sample  # the process's own turns: its copy is current
    third = await served_turn(there, "roam", [*second.prompt_ids, 7, 8], [9])  # never served "roam": reads it
    assert not third.new_sample and third.env_ids == [8] and there.reloads == 0
    fourth = await served_turn(here, "roam", [*third.prompt_ids, 9, 10], [11])  # one turn behind: reads it back
    assert here.reloads == 1 and not fourth.new_sample and fourth.env_ids == [10]
    fifth = await served_turn(there, "elsewhere", [20], [21])  # another session: nothing to read back
    assert fifth.new_sample and there.reloads == 0
    unrelated = await served_turn(there, "roam", [30, 31], [32])  # a new sample after one `there` did not see
    assert there.reloads == 1 and unrelated.new_sample and unrelated.sample.index == 1

    [sample, other] = await store.load_samples("roam")
    assert sample.num_turns == 4 and first.sample.index == 0
    assert sample.response_ids.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sample.loss_mask.tolist() == [1, 1, 0, 1, 0, 1, 0, 1]
    assert other.prompt_ids.tolist() == [30, 31]


async def test_turns_of_one_session_served_at_once_by_two_processes_are_both_kept(redis: Redis) -> None:
    """Two processes begin a turn extending the same sample before either records it: the later write moves to a
    new sample instead of replacing the other turn, and its process reads the session back next turn."""
    here = SessionManager(TOKENIZER, TrajectoryStore(redis, Keys(), sweep_interval_s=None))
    there = SessionManager(TOKENIZER, TrajectoryStore(redis, Keys(), sweep_interval_s=None))
    await served_turn(here, "twice", [1, 2, 3], [4, 5])
    async with here.lock("twice"), there.lock("twice"):  # one lock per process: nothing orders the two
        await here.open("twice")
        await there.open("twice")
        mine = await here.begin_completion_turn("twice", [1, 2, 3, 4, 5, 6])
        theirs = await there.begin_completion_turn("twice", [1, 2, 3, 4, 5, 7])
        assert mine.sample.index == theirs.sample.index == 0
        await there.save(theirs, there.record(theirs, sampled(theirs, [8]), None))
        await here.save(mine, here.record(mine, sampled(mine, [9]), None))
    assert (theirs.stored_index, mine.stored_index) == (0, 1)

    store = here.store
    assert isinstance(store, TrajectoryStore)
    kept, moved = await store.load_samples("twice")
    assert kept.response_ids.tolist() == [4, 5, 7, 8] and kept.loss_mask.tolist() == [1, 1, 0, 1]
    assert moved.response_ids.tolist() == [4, 5, 6, 9] and moved.loss_mask.tolist() == [1, 1, 0, 1]
    following = await served_turn(here, "twice", [1, 2, 3, 4, 5, 6, 9, 10], [11])  # continues its own reply
    assert here.reloads == 1 and not following.new_sample and following.stored_index == 1
    assert [s.num_turns for s in await store.load_samples("twice")] == [2, 3]


async def experts_turn(sessions: SessionManager, store: TrajectoryStore, prompt: list[int], output: list[int]) -> Turn:
    """A completion turn of session "r3" whose engine reported the routed experts of every new position."""
    async with sessions.lock("r3"):
        if await sessions.open("r3") is None:
            await store.create_session({}, "r3", absent=True)
        turn = await sessions.begin_completion_turn("r3", prompt)
        state = sampled(turn, output)
        rows = len(turn.prompt_ids) + len(output) - 1 - turn.experts_start  # position p's ids: 2p, 2p + 1 (mod 50)
        state.routed_experts = (np.arange(rows * 2).reshape(rows, 1, 2) + 2 * turn.experts_start) % 50
        state.routed_experts_start = turn.experts_start
        await sessions.save(turn, sessions.record(turn, state, None))
    return turn


async def test_each_turn_stores_only_the_routed_experts_it_added(redis: Redis) -> None:
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    here, there = SessionManager(TOKENIZER, store), SessionManager(TOKENIZER, store)
    await experts_turn(here, store, [1, 2, 3], [4, 5])  # positions 0-3
    await experts_turn(here, store, [1, 2, 3, 4, 5, 6], [7])  # 4-5: a second chunk
    key = Keys().sample("r3", 0)
    assert await redis.hget(key, "chunk_ends") == b"2:4,4:6"
    await experts_turn(there, store, [1, 2, 3, 4, 5, 6, 7, 8], [9])  # read back by another process: written whole
    assert await redis.hget(key, "chunk_ends") == b"6:8"
    await experts_turn(there, store, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11])
    assert await redis.hget(key, "chunk_ends") == b"6:8,8:10"

    [sample] = await store.load_samples("r3")
    rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
    assert sample.routed_experts is not None and sample.routed_experts.shape == (rows, 1, 2)
    assert sample.routed_experts.reshape(-1).tolist() == [i % 50 for i in range(rows * 2)]


# -- which sample a chat turn extends ---------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a careful agent."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def reply_ids(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return [*tokenizer.encode(text), tokenizer.end_of_turn_id]


def record_reply(sessions: SessionManager, turn: Turn, text: str) -> None:
    """The turn ends with the model's reply `text` (its end-of-turn token sampled)."""
    assistant = {"role": "assistant", "content": text}
    sessions.record(turn, sampled(turn, reply_ids(sessions.tokenizer, text)), assistant)


def assert_extends(tokenizer: ChatTokenizer, turn: Turn, sample_index: int, messages: list[dict[str, str]]) -> None:
    """The turn extends that sample by exactly the template's delta (the reference: both whole renderings)."""
    assert not turn.new_sample and turn.sample.index == sample_index
    previous = turn.sample.conversation
    assert turn.env_ids == tokenizer.extension_of(messages).by_ids(previous, None)
    assert turn.prompt_ids == turn.sample.ids + turn.env_ids


async def test_a_turn_continues_the_branch_whose_reply_its_messages_hold(redis: Redis) -> None:
    sessions = SessionManager(TOKENIZER, TrajectoryStore(redis, Keys(), sweep_interval_s=None))
    first = [SYSTEM, user("Pick a number.")]
    turn = await sessions.begin_chat_turn("g", first, None)
    branches = sessions.branch(turn, 4)  # n=4: samples 0-3, the same prompt, different replies
    for index, branch in enumerate(branches):
        record_reply(sessions, branch, f"I pick {index}.")

    for chosen in (1, 3, 0):
        messages = [*first, {"role": "assistant", "content": f"I pick {chosen}."}, user("Why?")]
        assert_extends(TOKENIZER, await sessions.begin_chat_turn("g", messages, None), chosen, messages)


async def test_a_session_shared_by_conversations_starts_one_sample_each_and_continues_the_older(redis: Redis) -> None:
    sessions = SessionManager(TOKENIZER, TrajectoryStore(redis, Keys(), sweep_interval_s=None))
    conversations = [[SYSTEM, user(f"Task {i}: sort these.")] for i in range(3)]
    for index, messages in enumerate(conversations):
        turn = await sessions.begin_chat_turn("shared", messages, None)
        assert turn.new_sample and turn.sample.index == index
        record_reply(sessions, turn, f"Sorted {index}.")

    older = [*conversations[0], {"role": "assistant", "content": "Sorted 0."}, user("Now reverse them.")]
    turn = await sessions.begin_chat_turn("shared", older, None)
    assert_extends(TOKENIZER, turn, 0, older)
    record_reply(sessions, turn, "Reversed.")  # sample 0 was matched against before: its conversation changed
    oldest = [*older, {"role": "assistant", "content": "Reversed."}, user("Thanks.")]
    assert_extends(TOKENIZER, await sessions.begin_chat_turn("shared", oldest, None), 0, oldest)
    rewritten = [*conversations[1], {"role": "assistant", "content": "Unsorted."}, user("Now reverse them.")]
    fresh = await sessions.begin_chat_turn("shared", rewritten, None)
    assert fresh.new_sample and fresh.sample.index == 3
    assert fresh.prompt_ids == TOKENIZER.render(rewritten)
    # Byte-level BPE without a normalizer: a text that does not extend is final, no conversation was tokenized whole.
    assert TOKENIZER.extension_of(rewritten).texts_decide
    assert all(sample.rendering.prefix_ids is None for sample in await sessions.samples("shared"))


def tiny_tokenizer_with(**parts: Any) -> ChatTokenizer:
    """The tiny tokenizer with some parts of its pipeline replaced (`normalizer`, `pre_tokenizer`)."""
    from transformers import AutoTokenizer

    fast = AutoTokenizer.from_pretrained(str(DEFAULT_TOKENIZER), local_files_only=True)
    for name, part in parts.items():
        setattr(fast.backend_tokenizer, name, part)
    return ChatTokenizer(fast)


def normalizing_tokenizer() -> ChatTokenizer:
    """The tiny tokenizer with an NFC normalizer: two texts that differ (é composed or not) give the same ids."""
    return tiny_tokenizer_with(normalizer=NFC())


@pytest.mark.parametrize(
    ("parts", "decides"),
    [
        pytest.param({}, True, id="byte-level"),
        pytest.param({"normalizer": NFC()}, False, id="nfc"),
        pytest.param({"pre_tokenizer": pre_tokenizers.ByteLevel(add_prefix_space=True)}, False, id="prefix-space"),
        pytest.param({"pre_tokenizer": pre_tokenizers.Whitespace()}, False, id="not-byte-level"),
        pytest.param(
            {
                "pre_tokenizer": pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(), pre_tokenizers.ByteLevel(add_prefix_space=False)]
                )
            },
            True,
            id="sequence",
        ),
    ],
)
def test_texts_decide_only_where_different_texts_always_give_different_ids(
    parts: dict[str, Any], decides: bool
) -> None:
    assert tiny_tokenizer_with(**parts).extension_of([user("hi")]).texts_decide is decides


async def test_a_conversation_whose_text_differs_but_whose_ids_extend_a_sample_extends_it(redis: Redis) -> None:
    tokenizer = normalizing_tokenizer()
    sessions = SessionManager(tokenizer, TrajectoryStore(redis, Keys(), sweep_interval_s=None))
    decomposed, composed = [SYSTEM, user("Un cafe\u0301.")], [SYSTEM, user("Un caf\u00e9.")]
    assert tokenizer.render(decomposed) == tokenizer.render(composed)
    turn = await sessions.begin_chat_turn("nfc", decomposed, None)
    record_reply(sessions, turn, "Voilà.")
    later = await sessions.begin_chat_turn("nfc", [SYSTEM, user("Autre chose.")], None)  # a newer, unrelated sample
    record_reply(sessions, later, "Bien sûr.")

    messages = [*composed, {"role": "assistant", "content": "Voilà."}, user("Merci.")]
    assert tokenizer.extension_of(messages).by_text(turn.sample.conversation, None) is TextCheck.DIFFERENT
    assert not tokenizer.extension_of(messages).texts_decide  # the ids decide
    assert_extends(tokenizer, await sessions.begin_chat_turn("nfc", messages, None), 0, messages)


def lists_of(turn: Turn) -> list[list[Any]]:
    sample = turn.sample
    return [
        values.tolist()
        for values in (sample.prompt_ids, sample.response_ids, sample.loss_mask, sample.logprobs, sample.versions)
    ]


def arrays_of(stored: Any) -> list[list[Any]]:
    fields = ("prompt_ids", "response_ids", "loss_mask", "logprobs", "versions")
    return [getattr(stored, name).tolist() for name in fields]


async def test_a_growing_sample_writes_what_it_holds(redis: Redis) -> None:
    """Each turn's write holds exactly the sample's typed arrays, whether this process made the sample or read it
    back; the arrays written are read-only copies (the sample grows in place after them); a partial write (a
    segment boundary) changes nothing of the sample."""
    store = TrajectoryStore(redis, Keys(), sweep_interval_s=None)
    sessions = SessionManager(TOKENIZER, store)
    prompt = [1, 2, 3]
    for turn_no in range(3):
        turn = await served_turn(sessions, "grow", prompt, [40 + turn_no, 50 + turn_no])
        written = turn.sample.arrays()
        assert arrays_of(written) == lists_of(turn)
        assert not written.response_ids.flags.writeable  # shared by the samples written: never changed in place
        turn.sample.response_ids.append(99)  # not a view: the sample's array may grow while a write holds a copy
        assert arrays_of(written) != lists_of(turn)
        turn.sample.response_ids.pop()
        prompt = turn.sample.ids + [60 + turn_no]
    (stored,) = await store.load_samples("grow")
    assert arrays_of(stored) == lists_of(turn)

    async with sessions.lock("grow"):
        turn = await sessions.begin_completion_turn("grow", prompt)
        before = lists_of(turn)
        state = sampled(turn, [70, 71])
        partial = sessions.partial(turn, state)
        assert partial.conversation_stored  # its last write stored the conversation: this one leaves it out
        assert arrays_of(partial)[1] == before[1] + turn.env_ids + [70, 71]
        assert arrays_of(partial)[2] == before[2] + [0] * len(turn.env_ids) + [1, 1]
        assert lists_of(turn) == before and arrays_of(turn.sample.arrays()) == before  # the sample is untouched

    elsewhere = SessionManager(TOKENIZER, store)  # another process: reads the sample back, then extends it
    turn = await served_turn(elsewhere, "grow", prompt, [80])
    assert not turn.new_sample
    (stored,) = await store.load_samples("grow")
    assert arrays_of(stored) == lists_of(turn) == arrays_of(turn.sample.arrays())


def test_segments_sampled_alike_share_one_mapping() -> None:
    """A segment keeps what it was sampled with until its session ends: equal settings are one mapping for the whole
    process (not a dict a turn), different ones stay apart, and 1 stays apart from 1.0 (stored as given)."""

    def used(**sampling: Any) -> Any:
        return sampling_used(GenerationRequest("r", [1, 2], SamplingParams(max_tokens=8, **sampling)))

    assert used(temperature=0.5) is used(temperature=0.5)
    assert used(temperature=0.5)["temperature"] == 0.5 and used(temperature=0.7)["temperature"] == 0.7
    assert used(top_k=20)["top_k"] == 20 and used()["top_k"] is None
    assert type(used(temperature=1)["temperature"]) is int and type(used(temperature=1.0)["temperature"]) is float
