"""`running_loop`: the running loop of the calling thread, as `asyncio.get_running_loop` finds it, across loops that
start and stop, threads that run loops of their own, uvloop, and a forked child."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import uvloop

from backends.loop_local import running_loop


async def _found() -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
    return running_loop(), asyncio.get_running_loop()


@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_each_new_loop_is_found_and_none_outside_one(run: object) -> None:
    seen = []
    for _ in range(3):
        found, actual = run(_found())  # type: ignore[operator]
        assert found is actual
        seen.append(found)
        with pytest.raises(RuntimeError):
            running_loop()  # the loop found last has stopped: nothing runs here now
    assert len({id(loop) for loop in seen}) == 3


def test_threads_find_their_own_loops() -> None:
    """Two threads, each running a loop while the other's runs: each finds its own, every time."""
    both_running = threading.Barrier(2)
    results: dict[str, list[bool]] = {}

    async def check(name: str) -> None:
        ours = asyncio.get_running_loop()
        assert running_loop() is ours
        await asyncio.to_thread(both_running.wait, 10)  # the other thread's loop runs now too
        results[name] = [running_loop() is ours for _ in range(100)]

    threads = [threading.Thread(target=asyncio.run, args=(check(name),)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == {"a": [True] * 100, "b": [True] * 100}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")  # the child only exits
def test_a_forked_child_runs_no_loop_of_its_parent() -> None:
    """A child forked from inside a running loop is outside any loop (as asyncio says): no stale loop comes back."""

    async def fork_and_wait() -> int:
        assert running_loop() is asyncio.get_running_loop()  # cached in the parent before the fork
        pid = os.fork()
        if pid == 0:  # the child: report and leave at once, touching nothing of the parent's loop
            try:
                running_loop()
            except RuntimeError:
                os._exit(0)
            os._exit(1)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)

    assert asyncio.run(fork_and_wait()) == 0
