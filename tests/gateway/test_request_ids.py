"""Request ids: unique in a process, and a forked worker (how `gateway.workers` starts them) repeats none."""

from __future__ import annotations

import multiprocessing
import re
from multiprocessing.connection import Connection

from gateway.request_ids import new_name, new_request_id


def _ids_of_child(conn: Connection) -> None:
    conn.send([new_request_id("gen") for _ in range(3)])
    conn.close()


def test_ids_are_kind_and_32_hex_digits_and_never_repeat() -> None:
    ids = [new_request_id("gen") for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"gen-[0-9a-f]{32}", i) for i in ids)


def test_a_forked_worker_draws_ids_of_its_own() -> None:
    ours = [new_request_id("gen") for _ in range(3)]
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_ids_of_child, args=(child,))
    process.start()
    theirs = parent.recv()
    process.join(10)
    assert process.exitcode == 0
    assert not set(theirs) & set(ours)
    assert {i[4:20] for i in theirs} != {i[4:20] for i in ours}  # another random prefix, not just another count


def test_names_are_32_hex_digits_and_repeat_no_id() -> None:
    """Names (a turn's writer, an engine request id's suffix) come from the same prefix and count as request ids."""
    names = [new_name() for _ in range(10_000)]
    ids = [new_request_id("gen")[4:] for _ in range(100)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", n) for n in names)
    assert len(set(names) | set(ids)) == len(names) + len(ids)
