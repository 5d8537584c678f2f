"""Tokenizing a chat turn of a long session: the new tail alone vs the whole conversation, side by side.

Every chat turn of a session needs the ids the new messages add after the previous turn's exact ids
(`ChatTokenizer.render_delta`). The reference way renders and tokenizes the previous conversation and the new
one and takes the difference: its cost grows with the conversation, so an episode costs O(turns²). The text
way renders both conversations' text (cheap) and tokenizes only the new tail, where that provably gives the
same ids (see `ConversationMatch` in gateway/tokenization.py). Each row checks that both ways agree before timing them.

    python -m benchmarks.turn_tokenization               # 2, 10, 40 and 80 turns of ~200 words per message
    python -m benchmarks.turn_tokenization --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._harness import machine_line, make_console, print_table
from gateway.assets import TINY_TOKENIZER_DIR
from gateway.tokenization import ChatTokenizer

WORDS = "alpha beta gamma delta river stone cloud forest — 你好 🙂".split()


def conversation(turns: int, words: int) -> list[dict[str, Any]]:
    """A system prompt, then `turns` user/assistant pairs of `words` words each."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(words))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a careful agent."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}: {text}"})
        messages.append({"role": "assistant", "content": f"answer {turn}: {text}"})
    return messages


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
    parser.add_argument("--quick", action="store_true", help="2 and 10 turns, 5 repeats")
    options = parser.parse_args(argv)
    if options.quick:
        options.turns, options.repeat = [2, 10], 5
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
