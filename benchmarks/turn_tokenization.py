"""Tokenizing a chat turn of a long session: the new tail alone vs the whole conversation, side by side.

Every chat turn of a session needs the ids the new messages add after the previous turn's exact ids
(`ChatTokenizer.render_delta`). The reference way renders and tokenizes the previous conversation and the new
one and takes the difference: its cost grows with the conversation, so an episode costs O(turns²). The text
way renders both conversations' text (cheap) and tokenizes only the new tail, where that provably gives the
same ids (see `ConversationMatch` in gateway/tokenization/conversation.py). Each row checks that both ways
agree before timing them.

A second table times the choice of the sample a chat turn extends, in a session that holds many (the n samples
of one request, or unrelated conversations under one session id): the session manager's matching (texts first,
the new conversation rendered once, each sample's rendering kept between turns) against the reference way (both
whole conversations rendered and tokenized for every sample, newest first, until one is a prefix). The session
manager runs in both history modes (`sessions.history`): `template`, and `tokens` (with the token history a gateway
with the default config builds for the tokenizer, as gateway/services.py does), where a turn that replays a
sample's conversation goes on from its ids plus what the template writes after a reply.

    python -m benchmarks.turn_tokenization               # 2, 10, 40 and 80 turns of ~200 words per message
    python -m benchmarks.turn_tokenization --quick
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis

from benchmarks._harness import machine_line, make_console, print_table
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.config import ModelConfig
from gateway.embedded_redis import EmbeddedRedis
from gateway.history import TokenHistory, family_of, token_history_for
from gateway.session.samples import SessionManager
from gateway.session.working_sample import WorkingSample
from gateway.store import Keys, TrajectoryStore
from gateway.tokenization import ChatTokenizer, NotAPrefix
from gateway.trajectory import Sample

WORDS = "alpha beta gamma delta river stone cloud forest — 你好 🙂".split()


def conversation(turns: int, words: int) -> list[dict[str, Any]]:
    """A system prompt, then `turns` user/assistant pairs of `words` words each."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(words))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: {text}"})
        messages.append({"role": "assistant", "content": f"answer {turn}: {text}"})
    return messages


def session_of(tokenizer: ChatTokenizer, conversations: list[list[dict[str, Any]]]) -> list[Sample]:
    """One finished turn per conversation, each its own sample (the reply's ids are its template rendering)."""
    samples = []
    for index, messages in enumerate(conversations):
        prompt = tokenizer.render(messages[:-1])
        reply = tokenizer.render_prefix(messages)[len(prompt) :]
        working = WorkingSample(index, prompt, reply, [1] * len(reply), [0.0] * len(reply), [0] * len(reply))
        working.conversation, working.num_turns = messages, 1
        samples.append(working.to_sample())
    return samples


def reference_choice(tokenizer: ChatTokenizer, samples: list[Sample], messages: list[dict[str, Any]]) -> int | None:
    """The sample the messages extend, newest first, each tried with both whole conversations tokenized."""
    for index in range(len(samples) - 1, -1, -1):
        try:
            tokenizer.extension_of(messages).by_ids(samples[index].conversation or [], None)
        except NotAPrefix:
            continue
        return index
    return None


async def matched_choice(
    manager: SessionManager, session_id: str, messages: list[dict[str, Any]]
) -> tuple[int | None, list[int]]:
    """The sample the manager's turn extends (None: a new one) and the turn's prompt ids."""
    turn = await manager.begin_chat_turn(session_id, messages, None)
    return None if turn.new_sample else turn.sample.index, turn.prompt_ids


def default_token_history(tokenizer: ChatTokenizer) -> TokenHistory:
    """The token history of `sessions.history: tokens` for this tokenizer, as gateway/services.py builds it with the
    default model config (its parsers name the family); an error if the template has no verified rule."""
    model = ModelConfig()
    family = family_of(tokenizer.chat_template, model.tool_parser, model.reasoning_parser)
    history = token_history_for(tokenizer, family, "tokens", explicit=True)
    assert history is not None  # explicit: refused with the reason, never None
    return history


async def timed_choice(
    new_manager: Callable[[], SessionManager],
    session_id: str,
    messages: list[dict[str, Any]],
    warm: bool,
    repeat: int,
) -> tuple[tuple[int | None, list[int]], float]:
    """A manager's choice for `messages` (`matched_choice`) and its median seconds over `repeat` fresh managers;
    each reads the session back from Redis before the clock starts and, with `warm`, makes one choice before (each
    sample's rendering kept)."""
    times, chosen = [], None
    for _ in range(repeat):
        manager = new_manager()
        await manager.samples(session_id)
        if warm:
            await matched_choice(manager, session_id, [*messages[:-1], {"role": "user", "content": "warm-up"}])
        started = time.perf_counter()
        chosen = await matched_choice(manager, session_id, messages)
        times.append(time.perf_counter() - started)
    assert chosen is not None
    return chosen, statistics.median(times)


async def stored_session(store: TrajectoryStore, session_id: str, samples: list[Sample]) -> None:
    await store.ensure_session(session_id, {})
    for index, sample in enumerate(samples):
        await store.save_sample(session_id, index, sample)


def sample_rows(tokenizer: ChatTokenizer, counts: Sequence[int], words: int, repeat: int) -> list[list[str]] | None:
    """Per session size: (case, reference ms, session manager ms in template and tokens mode, speed-ups); None if
    any two choose differently. The sessions live in the real store (an embedded Redis); reading them back is not
    timed."""
    with EmbeddedRedis() as server:
        return asyncio.run(_sample_rows(tokenizer, counts, words, repeat, server.url))


async def _sample_rows(
    tokenizer: ChatTokenizer, counts: Sequence[int], words: int, repeat: int, url: str
) -> list[list[str]] | None:
    client = Redis.from_url(url)
    store = TrajectoryStore(client, Keys(), sweep_interval_s=None)
    try:
        return await _timed_rows(tokenizer, store, counts, words, repeat)
    finally:
        await store.aclose()
        await client.aclose()


async def _timed_rows(
    tokenizer: ChatTokenizer, store: TrajectoryStore, counts: Sequence[int], words: int, repeat: int
) -> list[list[str]] | None:
    rows = []
    history = default_token_history(tokenizer)
    for count in counts:
        branches = [
            [*conversation(4, words)[:-1], {"role": "assistant", "content": f"reply {i}"}] for i in range(count)
        ]
        unrelated = [
            [
                *conversation(4, words)[:-2],
                {"role": "user", "content": f"task {i}"},
                {"role": "assistant", "content": "ok"},
            ]
            for i in range(count)
        ]
        cases = [
            (
                f"n={count}: continue the first reply",
                branches,
                [*branches[0], {"role": "user", "content": "why?"}],
                False,
            ),
            (
                f"{count} conversations: a new one",
                unrelated,
                [*conversation(4, words)[:-2], {"role": "user", "content": "new"}],
                False,
            ),
            (
                f"{count} conversations: a new one, again",
                unrelated,
                [*conversation(4, words)[:-2], {"role": "user", "content": "newer"}],
                True,
            ),
        ]
        for case, (label, conversations, messages, warm) in enumerate(cases):
            samples = session_of(tokenizer, conversations)
            started = time.perf_counter()
            expected = reference_choice(tokenizer, samples, messages)
            reference_s = time.perf_counter() - started
            session_id = f"bench-{count}-{case}"
            await stored_session(store, session_id, samples)
            template = await timed_choice(lambda: SessionManager(tokenizer, store), session_id, messages, warm, repeat)
            tokens = await timed_choice(
                lambda: SessionManager(tokenizer, store, token_history=history), session_id, messages, warm, repeat
            )
            # Both modes choose the reference's sample and prompt the engine with the same ids (the tiny
            # tokenizer's ChatML template writes after a reply exactly what it writes of a whole conversation).
            if template[0][0] != expected or template[0] != tokens[0]:
                return None
            rows.append(
                [
                    label,
                    f"{reference_s * 1e3:.1f}",
                    f"{template[1] * 1e3:.1f}",
                    f"{tokens[1] * 1e3:.1f}",
                    f"{reference_s / template[1]:.1f}×",
                    f"{reference_s / tokens[1]:.1f}×",
                ]
            )
    return rows


def raw_rows(tokenizer: ChatTokenizer, counts: Sequence[int], words: int, repeat: int) -> list[list[str]] | None:
    """Per conversation length: the next turn's whole text tokenized, against continued from the previous prompt's
    prefix; None if the two ever differ."""
    return asyncio.run(_raw_rows(tokenizer, counts, words, repeat))


async def _raw_rows(tokenizer: ChatTokenizer, counts: Sequence[int], words: int, repeat: int) -> list[list[str]] | None:
    rows = []
    for turns in counts:
        previous = conversation(turns, words)
        new = [*previous, {"role": "user", "content": "and now? " + " ".join(WORDS)}]
        _, prefix = await tokenizer.encode_continuing(tokenizer.render_text(previous[:-1]), None)
        text = tokenizer.render_text(new)
        whole = tokenizer.encode(text)
        if (await tokenizer.encode_continuing(text, prefix))[0] != whole:
            return None
        whole_s = seconds_per_call(lambda t=text: tokenizer.encode(t), repeat)
        started = time.perf_counter()
        for _ in range(repeat):
            await tokenizer.encode_continuing(text, prefix)
        continued_s = (time.perf_counter() - started) / repeat
        rows.append(
            [
                f"{turns}",
                f"{len(whole):,}",
                f"{whole_s * 1e3:.2f}",
                f"{continued_s * 1e3:.2f}",
                f"{whole_s / continued_s:.1f}×",
            ]
        )
    return rows


def seconds_per_call(call: Callable[[], object], repeat: int) -> float:
    call()  # warm
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.turn_tokenization", description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[2, 10, 40, 80])
    parser.add_argument("--words", type=int, default=200, help="words per message")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--samples", type=int, nargs="+", default=[10, 100], help="samples of the session (table 2)")
    parser.add_argument("--quick", action="store_true", help="2 and 10 turns, 5 repeats, 10 samples")
    options = parser.parse_args(argv)
    if options.quick:
        options.turns, options.repeat, options.samples = [2, 10], 5, [10]
    console = make_console()
    tokenizer = ChatTokenizer.load(TINY_TOKENIZER_DIR)
    rows = []
    for turns in options.turns:
        previous = conversation(turns, options.words)
        new = [*previous, {"role": "user", "content": "and now? " + " ".join(WORDS)}]
        by_text = tokenizer.render_delta(previous, new)
        by_ids = tokenizer.extension_of(new).by_ids(previous, None)
        if by_text != by_ids:
            console.print(f"[red]{turns} turns: the two ways disagree[/]")
            return 1
        text_s = seconds_per_call(lambda p=previous, n=new: tokenizer.render_delta(p, n), options.repeat)
        ids_s = seconds_per_call(lambda p=previous, n=new: tokenizer.extension_of(n).by_ids(p, None), options.repeat)
        size = len(tokenizer.render(new))
        rows.append(
            [
                f"{turns}",
                f"{size:,}",
                f"{len(by_text):,}",
                f"{ids_s * 1e3:.2f}",
                f"{text_s * 1e3:.2f}",
                f"{ids_s / text_s:.1f}×",
            ]
        )
    print_table(
        console,
        f"Tokenizing one chat turn — {machine_line()}",
        ["turns before", "conversation ids", "new ids", "whole conversation ms", "new tail only ms", "speed-up"],
        rows,
        "ms per turn on one core; the gateway does this once per chat turn of a session (per candidate sample).",
    )
    raw = raw_rows(tokenizer, options.turns, options.words, options.repeat)
    if raw is None:
        console.print("[red]a continued encode differs from the whole text's[/]")
        return 1
    print_table(
        console,
        "Tokenizing one raw completion turn (the conversation's ChatML text, sent whole at every turn)",
        ["turns before", "prompt ids", "whole text ms", "continued ms", "speed-up"],
        raw,
        "ms per turn on one core; 'continued' reuses the ids of the previous prompt up to its last stop token "
        "(`ChatTokenizer.encode_continuing`, what a session's raw completion turns get) and tokenizes the rest.",
    )
    matches = sample_rows(tokenizer, options.samples, options.words, options.repeat)
    if matches is None:
        console.print("[red]the session manager (in a history mode) and the reference chose different samples[/]")
        return 1
    print_table(
        console,
        "Choosing the sample a chat turn extends, in a session of many (4-turn conversations)",
        ["case", "reference ms", "template mode ms", "tokens mode ms", "speed-up, template", "speed-up, tokens"],
        matches,
        "ms for one turn's choice: the reference one run, the session manager the median of --repeat runs, each with a "
        "fresh manager; the reference tokenizes both whole conversations for every sample "
        "tried; the session manager's figures also hold the rendering of a new sample's prompt, and in tokens mode "
        "the ids the template writes after the replayed reply (sessions.history).",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
