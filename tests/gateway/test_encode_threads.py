"""Long texts tokenized in worker threads (`gateway.encode_threads`): the same ids as on the event loop, the loop
serving meanwhile, and the gateway's turns recorded exactly when their texts take the threads."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.assets import TINY_TOKENIZER_DIR
from gateway.encode_threads import EncodeThreads, encode_ids, private_copy
from gateway.tokenization import ChatTokenizer, EncodedPrefix
from tests.conftest import GatewayFactory, SimFactory
from tests.tokenizer_helpers import metaspace_first_dir, tokenizer_dir
from tests.tool_schemas import ADD_TOOL

TEXT = st.lists(
    st.text(st.characters(blacklist_categories=["Cs"]), max_size=20)
    | st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "  \n", "你好", "🙂"]),
    max_size=6,
).map("".join)
CONTENT = st.text(st.characters(blacklist_categories=["Cs"]).filter(lambda c: c != "\x00"), max_size=40)


@pytest.fixture(scope="module")
def threaded() -> Iterator[ChatTokenizer]:
    """Every text, however short, tokenized in the threads."""
    tokenizer = ChatTokenizer.load(TINY_TOKENIZER_DIR, encode_threads=2, encode_thread_min_chars=0)
    yield tokenizer
    tokenizer.close()


@pytest.fixture(scope="module")
def inline() -> ChatTokenizer:
    return ChatTokenizer.load(TINY_TOKENIZER_DIR)


@settings(max_examples=100, deadline=None)
@given(text=TEXT)
async def test_a_thread_encodes_as_the_loop_does(threaded: ChatTokenizer, inline: ChatTokenizer, text: str) -> None:
    before = threaded.thread_encodes
    assert await threaded.encode_async(text) == inline.encode(text)
    assert threaded.thread_encodes == before + 1


@settings(max_examples=60, deadline=None)
@given(system=CONTENT, user=CONTENT, tools=st.booleans())
async def test_a_conversation_rendered_in_a_thread_has_the_templates_ids(
    threaded: ChatTokenizer, inline: ChatTokenizer, system: str, user: str, tools: bool
) -> None:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    schemas = [ADD_TOOL] if tools else None
    before = threaded.thread_encodes
    assert await threaded.render_async(messages, schemas) == inline.render(messages, schemas)
    assert threaded.thread_encodes == before + 1


@pytest.mark.parametrize("content", ["<|im_end|> fake end", "see <tool_call>", "<|endoftext|>"])
async def test_a_conversation_holding_a_token_text_is_rendered_by_the_template(
    threaded: ChatTokenizer, inline: ChatTokenizer, content: str
) -> None:
    """Sanitizing encodes such text as plain text: only the template's own tokenizing does that."""
    messages = [{"role": "user", "content": content}]
    before = threaded.thread_encodes
    assert await threaded.render_async(messages) == inline.render(messages)
    assert threaded.thread_encodes == before


async def test_short_texts_stay_on_the_loop(inline: ChatTokenizer) -> None:
    tokenizer = ChatTokenizer.load(TINY_TOKENIZER_DIR, encode_threads=1, encode_thread_min_chars=1000)
    short = [{"role": "user", "content": "hi"}]
    try:
        assert await tokenizer.encode_async("x" * 999) == inline.encode("x" * 999)
        assert await tokenizer.render_async(short) == inline.render(short)
        assert tokenizer.thread_encodes == 0
        assert await tokenizer.encode_async("x" * 1000) == inline.encode("x" * 1000)
        assert await tokenizer.render_async([{"role": "user", "content": "x" * 1000}]) == inline.render(
            [{"role": "user", "content": "x" * 1000}]
        )
        assert tokenizer.thread_encodes == 2
    finally:
        tokenizer.close()


async def test_without_threads_every_text_stays_on_the_loop(inline: ChatTokenizer) -> None:
    text = "word " * 2000
    assert await inline.encode_async(text) == inline.encode(text)
    assert inline.thread_encodes == 0


async def test_the_loop_serves_while_a_thread_encodes(threaded: ChatTokenizer, inline: ChatTokenizer) -> None:
    """A task that only yields runs while the text is tokenized; encoded on the loop, it would not run at all."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    text = "the quick brown fox, 你好 🙂 " * 8000
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)  # the ticker starts
    ticks = 0
    ids = await threaded.encode_async(text)
    ticked = ticks
    task.cancel()
    assert ids == inline.encode(text)
    assert ticked > 0


def test_a_private_copy_shares_no_settings() -> None:
    """The threads' copy encodes whole texts whatever the original is set to afterwards (and before: a truncation
    set on the original is not copied)."""
    original = ChatTokenizer.load(TINY_TOKENIZER_DIR).backend
    expected = encode_ids(original, "one two three four five six")
    original.enable_truncation(max_length=3)
    copy = private_copy(original)
    original.enable_truncation(max_length=2)
    assert encode_ids(copy, "one two three four five six") == expected
    assert len(encode_ids(original, "one two three four five six")) == 2


async def test_closed_threads_take_no_more_texts() -> None:
    threads = EncodeThreads(private_copy(ChatTokenizer.load(TINY_TOKENIZER_DIR).backend), 1)
    assert await threads.encode("hello") == encode_ids(threads._tokenizer, "hello")
    threads.close()
    with pytest.raises(RuntimeError):
        await threads.encode("hello")


def test_thread_counts_are_checked() -> None:
    with pytest.raises(ValueError, match="at least one thread"):
        EncodeThreads(private_copy(ChatTokenizer.load(TINY_TOKENIZER_DIR).backend), 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        ChatTokenizer.load(TINY_TOKENIZER_DIR, encode_threads=-1)


async def test_turns_whose_texts_take_the_threads_are_recorded_exactly(
    make_sim: SimFactory, make_gateway: GatewayFactory, inline: ChatTokenizer
) -> None:
    """Through the gateway, with every text of 40 characters or more tokenized in the threads: a new conversation,
    a chat turn's new tail, and raw completion prompts; the stored samples hold the template's exact ids."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim], model={"encode_threads": 2, "encode_thread_min_chars": 40})
    tokenizer = gw.services.turns.tokenizer
    api = openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key="unused", default_headers={"X-Session-ID": "long"}, max_retries=0
    )
    try:
        user_1 = {"role": "user", "content": "Read this file and tell me what it does. " * 4}
        first = await api.chat.completions.create(model="tiny", messages=[user_1], max_tokens=5, temperature=0)
        assert tokenizer.thread_encodes == 1  # the whole conversation's text
        reply: dict[str, Any] = first.choices[0].message.model_dump(exclude_none=True)
        user_2 = {"role": "user", "content": "Now the tests, please: they are long too. " * 4}
        messages = [user_1, reply, user_2]
        second = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
        assert second.model_extra is not None
        assert second.model_extra["rollout"]["choices"][0]["sample_index"] == 0  # the sample, extended
        assert tokenizer.thread_encodes == 2  # the new tail alone
        sample = (await gw.services.store.load_samples("long"))[0]
        prompt = inline.render([user_1])
        assert sample.prompt_ids.tolist() == prompt
        sampled = first.model_extra["rollout"]["choices"][0]["output_ids"]  # type: ignore[index]
        if first.choices[0].finish_reason == "length":  # cut by max_tokens: the gateway closes the turn itself
            sampled = [*sampled, inline.end_of_turn_id]
        delta = inline.render_delta([user_1, reply], messages)
        assert sample.response_ids.tolist()[: len(sampled) + len(delta)] == sampled + delta

        raw = openai.AsyncOpenAI(
            base_url=f"{gw.url}/v1", api_key="unused", default_headers={"X-Session-ID": "raw"}, max_retries=0
        )
        text = "def add(a, b):\n    return a + b\n\n# and now a longer function body\n"
        completion = await raw.completions.create(model="tiny", prompt=text, max_tokens=4, temperature=0)
        assert completion.model_extra is not None
        assert tokenizer.thread_encodes == 3
        stored = (await gw.services.store.load_samples("raw"))[0]
        assert stored.prompt_ids.tolist() == inline.encode(text)
        await raw.close()
    finally:
        await api.close()


# -- continuing a text's encode (raw completion turns) ------------------------------------------------------------

PIECE = st.one_of(
    st.text(st.characters(blacklist_categories=["Cs"]), max_size=24),
    st.sampled_from(["<|im_end|>", "<|im_start|>", "<|endoftext|>", "\n", " ", "assistant\n", "<tool_call>", "<|im"]),
)
TURN = st.lists(PIECE, max_size=6).map("".join)


async def continued(tokenizer: ChatTokenizer, texts: list[str]) -> list[list[int]]:
    """Each text encoded by `encode_continuing`, handing each call the prefix the previous one returned."""
    prefix: EncodedPrefix | None = None
    out = []
    for text in texts:
        ids, prefix = await tokenizer.encode_continuing(text, prefix)
        out.append(ids)
    return out


@settings(max_examples=150, deadline=None)
@given(turns=st.lists(TURN, min_size=1, max_size=4), other=TURN, threads=st.booleans())
async def test_a_continued_encode_is_the_whole_encode(
    threaded: ChatTokenizer, inline: ChatTokenizer, turns: list[str], other: str, threads: bool
) -> None:
    """Texts that each extend the previous one (a conversation resent at every turn), then one that starts over:
    every encode equals the whole text's, whichever prefix it was handed."""
    texts = list(itertools.accumulate(turns)) + [other]
    tokenizer = threaded if threads else inline
    assert await continued(tokenizer, texts) == [inline.encode(text) for text in texts]


async def test_a_conversation_resent_at_every_turn_tokenizes_only_its_new_text(inline: ChatTokenizer) -> None:
    turn = "<|im_start|>user\nHow far is it? 🙂<|im_end|>\n<|im_start|>assistant\nFar enough.<|im_end|>\n"
    texts = [turn * n + "<|im_start|>assistant\n" for n in (1, 2, 3)]
    before = inline.reused_ids
    assert await continued(inline, texts) == [inline.encode(text) for text in texts]
    # The second text reuses the first's ids up to its last <|im_end|>, the third the second's.
    one, two = (len(inline.encode((turn * n).removesuffix("\n"))) for n in (1, 2))
    assert inline.reused_ids - before == one + two


async def test_a_text_without_stop_tokens_has_no_prefix(inline: ChatTokenizer) -> None:
    ids, prefix = await inline.encode_continuing("plain text, no turns", None)
    assert ids == inline.encode("plain text, no turns") and prefix is None


@pytest.fixture(scope="module")
def metaspace_first(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    return ChatTokenizer.load(metaspace_first_dir(tmp_path_factory.mktemp("metaspace")))


@settings(max_examples=100, deadline=None)
@given(turns=st.lists(TURN, min_size=1, max_size=4), other=TURN)
async def test_a_continued_encode_is_the_whole_encode_for_a_first_piece_marking_tokenizer(
    metaspace_first: ChatTokenizer, turns: list[str], other: str
) -> None:
    """SentencePiece's `Metaspace` "first": the pieces after a stop token are tokenized after one (`encode_tail`)."""
    texts = list(itertools.accumulate(turns)) + [other]
    assert await continued(metaspace_first, texts) == [metaspace_first.encode(text) for text in texts]


async def test_a_first_piece_marking_tokenizer_reuses_prefixes(metaspace_first: ChatTokenizer) -> None:
    text = "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"
    longer = text + "fine thanks<|im_end|>\n<|im_start|>user\nand you?<|im_end|>\n"
    before = metaspace_first.reused_ids
    assert await continued(metaspace_first, [text, longer]) == [metaspace_first.encode(t) for t in (text, longer)]
    assert metaspace_first.reused_ids > before


async def test_an_added_token_holding_a_stop_tokens_text_turns_the_reuse_off(tmp_path: Path) -> None:
    """`<|im_end|>!` as a token of its own: a text cut after `<|im_end|>` could continue with `!`, and the whole
    text then holds the longer token where the parts hold `<|im_end|>` and `!`."""
    folder = tokenizer_dir(tmp_path)
    model = json.loads((folder / "tokenizer.json").read_text())
    longer = {"id": len(model["model"]["vocab"]) + len(model["added_tokens"]), "content": "<|im_end|>!"}
    flags = {"single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    model["added_tokens"].append(longer | flags)
    (folder / "tokenizer.json").write_text(json.dumps(model))
    tokenizer = ChatTokenizer.load(folder)
    texts = ["hi<|im_end|>", "hi<|im_end|>!there"]
    assert tokenizer.encode(texts[1])[1] == tokenizer.backend.token_to_id("<|im_end|>!")
    assert await continued(tokenizer, texts) == [tokenizer.encode(text) for text in texts]


async def test_raw_completion_turns_send_the_whole_texts_ids(
    make_sim: SimFactory, make_gateway: GatewayFactory, inline: ChatTokenizer
) -> None:
    """A session's raw prompts, each the previous one plus the reply and a new user turn: the engine gets exactly
    the whole text's ids, while the gateway tokenized only what followed the previous prompt's last stop token."""
    sim = await make_sim("vllm")
    gw = await make_gateway([sim])
    tokenizer = gw.services.turns.tokenizer
    api = openai.AsyncOpenAI(
        base_url=f"{gw.url}/v1", api_key="unused", default_headers={"X-Session-ID": "raw-turns"}, max_retries=0
    )
    async with httpx.AsyncClient() as http:
        (await http.post(f"{sim.url}/sim/prompt_log", json={"head": 64})).raise_for_status()
        text = "<|im_start|>system\nYou add numbers.<|im_end|>\n<|im_start|>user\n2 + 3?<|im_end|>\n"
        sent = []
        for question in ("4 + 4?", "1 + 1?", "9 + 0?"):
            text += "<|im_start|>assistant\n"
            completion = await api.completions.create(model="tiny", prompt=text, max_tokens=4, temperature=0)
            sent.append(text)
            text += completion.choices[0].text + f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
        logged = (await http.get(f"{sim.url}/sim/prompt_log")).json()["requests"]
    await api.close()
    expected = [inline.encode(t) for t in sent]
    assert [(head, length) for head, length, _ in logged] == [(ids[:64], len(ids)) for ids in expected]
    stored = [sample.input_ids.tolist() for sample in await gw.services.store.load_samples("raw-turns")]
    assert all(any(ids == sample[: len(ids)] for sample in stored) for ids in expected)  # recorded as sent
    assert tokenizer.reused_ids > 0


@pytest.mark.parametrize("threads", [0, 1])
async def test_a_tail_is_tokenized_as_within_the_whole_text(tmp_path: Path, threads: int) -> None:
    """`encode_tail_async` (a chat turn's new tail), inline and in a thread, for a tokenizer that encodes tails
    alone and for one that encodes them after a stop token."""
    for tokenizer in (
        ChatTokenizer.load(TINY_TOKENIZER_DIR, encode_threads=threads, encode_thread_min_chars=0),
        ChatTokenizer.load(metaspace_first_dir(tmp_path), encode_threads=threads, encode_thread_min_chars=0),
    ):
        head = "<|im_start|>user\nhi<|im_end|>"
        for tail in ("\n<|im_start|>assistant\n", "hello there", " spaced", "\u2581x"):
            assert tokenizer.encode(head) + await tokenizer.encode_tail_async(tail) == tokenizer.encode(head + tail)
        tokenizer.close()


async def test_callers_of_one_text_share_its_encode_and_get_lists_of_their_own(
    threaded: ChatTokenizer, inline: ChatTokenizer
) -> None:
    """A GRPO group's requests share their prompt and arrive together: the text is encoded once."""
    text = "a long shared task description, 你好 🙂 " * 2000
    before = threaded.thread_encodes
    results = await asyncio.gather(*(threaded.encode_async(text) for _ in range(8)))
    assert threaded.thread_encodes == before + 1
    assert all(ids == inline.encode(text) for ids in results)
    results[0].append(-1)
    assert results[1] == inline.encode(text)  # each caller's list is its own


async def test_a_cancelled_caller_leaves_the_others_their_ids(threaded: ChatTokenizer, inline: ChatTokenizer) -> None:
    text = "another long shared text, with words " * 4000
    first = asyncio.create_task(threaded.encode_async(text))
    second = asyncio.create_task(threaded.encode_async(text))
    await asyncio.sleep(0)
    first.cancel()
    assert await second == inline.encode(text)
    with contextlib.suppress(asyncio.CancelledError):
        await first
    assert first.cancelled()
    # Everyone gone before the encode ends: a later caller of the same text gets its ids all the same.
    alone = asyncio.create_task(threaded.encode_async(text + "!"))
    await asyncio.sleep(0)
    alone.cancel()
    await asyncio.sleep(0)  # its cancellation withdraws the text; the entry goes only at the next pass
    assert await threaded.encode_async(text + "!") == inline.encode(text + "!")
