"""Deterministic arithmetic tasks with known answers, and how a reply is scored against one."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from rollout_agents.calculator import evaluate

_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True, slots=True)
class Task:
    """One problem: `question` is an integer expression over `+ - *`; `answer` its value."""

    id: str
    question: str
    answer: int


def generate_tasks(n: int, seed: int = 0, *, max_operand: int = 99, max_operands: int = 3) -> list[Task]:
    """`n` tasks, the same for the same arguments (a private `random.Random(seed)`; ids `task-0000`, ...)."""
    if n < 0 or max_operand < 1 or max_operands < 2:
        raise ValueError("need n >= 0, max_operand >= 1 and max_operands >= 2")
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        operands = [rng.randint(0, max_operand) for _ in range(rng.randint(2, max_operands))]
        question = str(operands[0])
        for operand in operands[1:]:
            question += f" {rng.choice('+-*')} {operand}"
        tasks.append(Task(id=f"task-{i:04d}", question=question, answer=evaluate(question)))
    return tasks


def last_integer(text: str | None) -> int | None:
    """The last integer written in `text` (a leading `-` included), if any."""
    matches = _INTEGER.findall(text or "")
    return int(matches[-1]) if matches else None


def reward(task: Task, text: str | None) -> float:
    """1.0 when the last integer of the reply is exactly the answer, else 0.0."""
    return 1.0 if last_integer(text) == task.answer else 0.0
