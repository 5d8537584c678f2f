"""What a run produced: per-episode results, per-group (GRPO) statistics, totals, and the summary tables."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console
from rich.table import Table

from rollout_agents.episode import EpisodeTrace
from rollout_agents.tasks import Task


@dataclass(slots=True)
class EpisodeResult:
    """One episode. `reward` is None and `error` set when it failed (raised, or its session calls failed)."""

    task: Task
    group_id: str
    sample_index: int
    session_id: str
    reward: float | None = None
    error: str | None = None
    finished: bool = False  # the gateway acknowledged the finish: the trajectory is in the stream
    trace: EpisodeTrace = field(default_factory=EpisodeTrace)
    elapsed_s: float = 0.0


@dataclass(frozen=True, slots=True)
class GroupStats:
    """One GRPO group (the samples of one task). `std` over finished samples; 0.0 means no learning signal."""

    group_id: str
    task_id: str
    size: int
    finished: int
    failed: int
    mean_reward: float | None
    std_reward: float | None

    @classmethod
    def of(cls, results: Sequence[EpisodeResult]) -> GroupStats:
        rewards = [r.reward for r in results if r.finished and r.reward is not None]
        return cls(
            group_id=results[0].group_id,
            task_id=results[0].task.id,
            size=len(results),
            finished=sum(r.finished for r in results),
            failed=sum(r.error is not None for r in results),
            mean_reward=statistics.fmean(rewards) if rewards else None,
            std_reward=statistics.pstdev(rewards) if rewards else None,
        )


@dataclass(frozen=True, slots=True)
class RunSummary:
    """Totals of a run. Token counts are sums of `usage` over every turn of every episode."""

    episodes: int
    finished: int
    failed: int
    mean_reward: float | None
    groups: tuple[GroupStats, ...]
    prompt_tokens: int
    completion_tokens: int
    tool_calls: int
    tool_errors: int  # calls answered with an `error: ...` string (malformed arguments, unknown tool)
    throttled: int  # session calls retried after 429 (backpressure) or 503
    elapsed_s: float
    results: tuple[EpisodeResult, ...]

    @property
    def episodes_per_s(self) -> float:
        return self.finished / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def failures(self) -> tuple[EpisodeResult, ...]:
        return tuple(r for r in self.results if r.error is not None)

    @classmethod
    def of(cls, results: Sequence[EpisodeResult], *, throttled: int, elapsed_s: float) -> RunSummary:
        by_group: dict[str, list[EpisodeResult]] = {}
        for result in results:
            by_group.setdefault(result.group_id, []).append(result)
        rewards = [r.reward for r in results if r.finished and r.reward is not None]
        return cls(
            episodes=len(results),
            finished=sum(r.finished for r in results),
            failed=sum(r.error is not None for r in results),
            mean_reward=statistics.fmean(rewards) if rewards else None,
            groups=tuple(GroupStats.of(group) for group in by_group.values()),
            prompt_tokens=sum(r.trace.prompt_tokens for r in results),
            completion_tokens=sum(r.trace.completion_tokens for r in results),
            tool_calls=sum(r.trace.tool_calls for r in results),
            tool_errors=sum(r.trace.tool_errors for r in results),
            throttled=throttled,
            elapsed_s=elapsed_s,
            results=tuple(results),
        )


def _number(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_summary(summary: RunSummary, console: Console, *, max_groups: int = 16, max_failures: int = 8) -> None:
    """The totals, the first `max_groups` groups and the first `max_failures` failures as rich tables."""
    totals = Table(title="run summary", show_header=False)
    totals.add_column("metric")
    totals.add_column("value", justify="right")
    with_signal = sum(1 for g in summary.groups if g.std_reward)
    for name, value in (
        ("episodes", str(summary.episodes)),
        ("finished", str(summary.finished)),
        ("failed", str(summary.failed)),
        ("mean reward", _number(summary.mean_reward)),
        ("groups with reward variance", f"{with_signal}/{len(summary.groups)}"),
        ("prompt tokens", str(summary.prompt_tokens)),
        ("completion tokens", str(summary.completion_tokens)),
        ("tool calls (errors)", f"{summary.tool_calls} ({summary.tool_errors})"),
        ("throttled retries (429/503)", str(summary.throttled)),
        ("elapsed", f"{summary.elapsed_s:.2f} s"),
        ("episodes/s", f"{summary.episodes_per_s:.1f}"),
    ):
        totals.add_row(name, value)
    console.print(totals)
    groups = Table(title=f"groups (first {min(max_groups, len(summary.groups))} of {len(summary.groups)})")
    for column in ("group", "task", "n", "finished", "failed", "mean", "std"):
        groups.add_column(column, justify="left" if column in ("group", "task") else "right")
    for g in summary.groups[:max_groups]:
        groups.add_row(
            g.group_id,
            g.task_id,
            str(g.size),
            str(g.finished),
            str(g.failed),
            _number(g.mean_reward),
            _number(g.std_reward),
        )
    console.print(groups)
    failures = summary.failures
    if failures:
        table = Table(title=f"failures (first {min(max_failures, len(failures))} of {len(failures)})")
        table.add_column("session")
        table.add_column("error", overflow="fold")
        for r in failures[:max_failures]:
            table.add_row(r.session_id, r.error or "")
        console.print(table)
