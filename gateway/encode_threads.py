"""`EncodeThreads`: long texts tokenized in worker threads, off the event loop.

Tokenizing is the one step of a request whose cost grows with the request's text, so a long prompt holds the event
loop for as long as its encode takes, during which no stream of any other agent moves and no other request is read
(`benchmarks/long_prompts.py`, docs/benchmarks.md). The Rust tokenizer releases the
GIL while it encodes, so a worker thread can encode a long text while the loop goes on serving (and, on a machine
with a spare core, at the same time). Handing a text to a thread and back has a cost of its own on the loop, so
only texts of at least a threshold go there (`ChatTokenizer.encode_async` decides).

The threads encode with a tokenizer of their own, a copy made from the original's serialized form, never touched
by the event loop's thread: transformers sets truncation, padding and special-token splitting on its tokenizer
when a call asks for other settings than the last one, and a setting changed while a worker encodes with the same
object would fail that encode.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from tokenizers import Tokenizer

__all__ = ["EncodeThreads", "encode_ids", "encode_pieces"]


def encode_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of `text` with no special tokens added (special-token strings in `text` do become those tokens).

    The batch encode without offsets (tokenizers >= 0.21) gives the same ids without computing the offsets, in less
    time; older versions encode with offsets."""
    if hasattr(tokenizer, "encode_batch_fast"):
        return tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
    return tokenizer.encode(text, add_special_tokens=False).ids


def encode_pieces(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """`encode_ids` of each text, in one call."""
    if hasattr(tokenizer, "encode_batch_fast"):
        return [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
    return [encoding.ids for encoding in tokenizer.encode_batch(texts, add_special_tokens=False)]


def private_copy(tokenizer: Tokenizer) -> Tokenizer:
    """A tokenizer that encodes as `tokenizer` does now and shares no state with it: no truncation, no padding,
    special tokens split as `tokenizer` splits them."""
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = tokenizer.encode_special_tokens
    return copy


class _Pending:
    """A text being encoded, and how many callers wait for its ids."""

    __slots__ = ("callers", "future")

    def __init__(self, future: asyncio.Future[list[int]]) -> None:
        self.future = future
        self.callers = 0


class EncodeThreads:
    """`threads` worker threads (started on first use) that encode with `tokenizer`, a copy of the model's
    tokenizer that nothing else uses (`private_copy`)."""

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"EncodeThreads needs at least one thread, not {threads}")
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="rg-encode")
        self._pending: dict[str, _Pending] = {}  # texts being encoded, by text
        self.encodes = 0  # texts handed to the threads so far (`ChatTokenizer.thread_encodes`)

    async def encode(self, text: str) -> list[int]:
        """Ids of `text` (as `encode_ids`), encoded in a worker thread, and once for callers that ask for the same
        text while it is being encoded (a GRPO group's requests, which share their prompt, arrive together). Each
        caller gets a list of its own. A text no worker has started on is withdrawn once all its callers are
        cancelled; one already started runs to its end, its ids dropped."""
        pending = self._pending.get(text)
        if pending is None or pending.future.cancelled():  # (withdrawn: its entry goes at the loop's next pass)
            future = asyncio.get_running_loop().run_in_executor(self._executor, encode_ids, self._tokenizer, text)
            pending = self._pending[text] = _Pending(future)
            future.add_done_callback(lambda _: self._forget(text, pending))
            self.encodes += 1
        pending.callers += 1
        try:
            ids = await asyncio.shield(pending.future)
        finally:
            pending.callers -= 1
            if not pending.callers and not pending.future.done():  # every caller left
                pending.future.cancel()
        return list(ids)

    def _forget(self, text: str, pending: _Pending) -> None:
        if self._pending.get(text) is pending:
            del self._pending[text]

    async def encode_pieces(self, texts: list[str]) -> list[list[int]]:
        """`encode_pieces` of `texts`, in a worker thread; a cancelled caller withdraws them if no worker has started
        on them."""
        pieces = await asyncio.get_running_loop().run_in_executor(self._executor, encode_pieces, self._tokenizer, texts)
        self.encodes += 1
        return pieces

    def close(self) -> None:
        """Withdraw the texts not started yet; the threads end after their current text (nothing waits for them)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
