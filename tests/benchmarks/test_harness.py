"""The benchmarks' CPU reading (`benchmarks._harness.cpu_seconds`): another process's CPU time, finer than /proc's
10 ms ticks, so that a short timed run never reads as no CPU at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks._harness import _proc_cpu_seconds, cpu_seconds

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process CPU clocks and /proc are Linux's"),
]

SPIN_S = 0.3


def spin(cpu_s: float) -> None:
    started = time.process_time()
    while time.process_time() - started < cpu_s:
        pass


def test_a_few_milliseconds_of_cpu_are_seen() -> None:
    """2 ms of CPU: /proc's ticks would read 0 or 10 ms of it; the process's CPU clock reads 2 ms and a little."""
    before = cpu_seconds(os.getpid())
    spin(0.002)
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None
    assert 0.002 <= after - before < 0.008


def test_another_process_is_read_and_agrees_with_proc() -> None:
    code = (
        "import time\nstarted = time.process_time()\nwhile time.process_time() - started < SPIN_S: pass\n"
        "print('spun', flush=True)\ntime.sleep(30)"
    ).replace("SPIN_S", str(SPIN_S))
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == "spun\n"
            clock, ticks = cpu_seconds(child.pid), _proc_cpu_seconds(child.pid)
            assert clock is not None and ticks is not None
            assert clock >= SPIN_S  # the child's own CPU, not this process's
            assert abs(clock - ticks) <= 0.05  # the same time, /proc's rounded to its ticks
        finally:
            child.kill()


def test_no_process_reads_none() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    assert cpu_seconds(child.pid) is None
    assert cpu_seconds(None) is None
