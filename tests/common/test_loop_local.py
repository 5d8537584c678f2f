"""`loop_local`: one object per running loop and key, made at the first call and found again after; each new loop
(a server, a test) and each thread's loop gets its own."""

from __future__ import annotations

import asyncio
import threading

import pytest
import uvloop

from common.loop_local import loop_local


class Made:
    def __init__(self, arg: str) -> None:
        self.arg = arg


async def _twice(arg: str) -> tuple[Made, Made]:
    return loop_local(Made, arg), loop_local(Made, arg, asyncio.get_running_loop())


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_a_loop_keeps_one_object_per_key_and_a_new_loop_makes_its_own(run: object) -> None:
    seen = []
    for _ in range(3):
        first, again = run(_twice("a"))  # type: ignore[operator]
        assert first is again and first.arg == "a"
        seen.append(first)
    assert len({id(made) for made in seen}) == 3


def test_keys_are_told_apart() -> None:
    async def both() -> tuple[Made, Made]:
        return loop_local(Made, "a"), loop_local(Made, "b")

    a, b = asyncio.run(both())
    assert a is not b and (a.arg, b.arg) == ("a", "b")


def test_threads_get_their_own_loops_objects() -> None:
    """Two threads, each running a loop while the other's runs: each finds its own object, every time."""
    both_running = threading.Barrier(2)
    results: dict[str, list[Made]] = {}

    async def check(name: str) -> None:
        mine = loop_local(Made, "shared-key")
        await asyncio.to_thread(both_running.wait, 10)  # the other thread's loop runs now too
        results[name] = [loop_local(Made, "shared-key") for _ in range(10)] + [mine]

    threads = [threading.Thread(target=asyncio.run, args=(check(name),)) for name in ("one", "two")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(len({id(made) for made in found}) == 1 for found in results.values())
    assert results["one"][0] is not results["two"][0]


def test_outside_a_loop_it_refuses() -> None:
    with pytest.raises(RuntimeError):
        loop_local(Made, "a")
