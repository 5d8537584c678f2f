"""The figures of one `benchmarks.updates` cell and the table of them: a row per cell, the key ratio (tokens lost per
update, flush ÷ salt) and the verdict on issue 50's target."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console

from benchmarks._harness import machine_line, print_table

if TYPE_CHECKING:
    from benchmarks.updates import Options

TARGET_RATIO = 5.0
DISTURBED = 0.1  # a steady window whose halves differ by more than this share of a period's tokens
TROUGH_WIDTH_S = 0.5


@dataclass
class Cell:
    """One (dialect, cache policy, pause mode, transport) run."""

    dialect: str
    cache: str
    mode: str
    period_s: float = 0.0
    transport: str = "path"  # or "transfer": the tensors pushed in memory; "adapter": a LoRA policy's version
    steady_rate: float = math.nan
    dip_rate: float = math.nan
    trough_rate: float = math.nan
    lost: list[float] = field(default_factory=list)  # per update
    noise: float = math.nan
    admin_s: list[float] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)  # replicas' counters over the update windows
    gateway: dict[str, float] = field(default_factory=dict)  # GAUGES' growth over the run
    hit_before: float = math.nan
    hit_after: float = math.nan
    drained: int = 0
    turns: int = 0
    errors: list[str] = field(default_factory=list)
    error_count: int = 0

    @property
    def label(self) -> str:
        return f"{self.dialect} {self.mode} {self.cache}" + (f" {self.transport}" if self.transport != "path" else "")

    def per_update(self, name: str) -> float:
        return self.counts.get(name, 0.0) / max(1, len(self.lost))

    @property
    def mean_lost(self) -> float:
        return statistics.fmean(self.lost) if self.lost else math.nan

    @property
    def disturbed(self) -> bool:
        """The steady window was not steady (on a shared machine, another process took the CPUs for a while): its
        halves differ by more than `DISTURBED` of a period's tokens, so the steady rate, and every loss measured
        against it, is off."""
        period_tokens = self.steady_rate * (self.period_s or 1.0)
        return not abs(self.noise) <= DISTURBED * period_tokens


def number(value: float, spec: str = ",.0f") -> str:
    return "—" if value != value else format(value, spec)  # NaN: nothing measured


def percent(value: float) -> str:
    return "—" if value != value else f"{value * 100:.0f}%"


def cell_row(cell: Cell, salt: Cell | None) -> list[str]:
    updates = max(1, len(cell.lost))
    budget = "/".join(f"{cell.gateway.get(name, 0.0):.0f}" for name in ("held", "refused", "cut"))
    return [
        f"{cell.label} (!)" if cell.disturbed else cell.label,
        number(cell.steady_rate),
        number(cell.dip_rate),
        number(cell.trough_rate),
        number(cell.mean_lost),
        number(cell.noise),
        ratio_text(cell, salt) if salt is not None else "—",
        number(statistics.fmean(cell.admin_s) * 1000 if cell.admin_s else math.nan, ",.0f"),
        number(cell.per_update("retractions"), ",.1f"),
        number(cell.per_update("recomputed_tokens")),
        number(cell.per_update("aborted"), ",.1f"),
        number(cell.gateway.get("resumes", 0.0) / updates, ",.1f"),
        f"{percent(cell.hit_before)}→{percent(cell.hit_after)}",
        str(cell.drained),
        budget,
        f"{cell.turns:,}",
        str(cell.error_count),
    ]


COLUMNS = [
    "dialect mode cache",
    "steady",
    "after",
    "trough",
    "lost",
    "noise",
    "÷ salt",
    "admin ms",
    "preempt",
    "recomp",
    "abort",
    "resume",
    "hit",
    "drain",
    "h/r/c",
    "turns",
    "err",
]


def ratio_text(flush: Cell, salt: Cell) -> str:
    """flush's loss ÷ salt's; a bound where salt's loss is within the noise floor of its steady window."""
    floor = max(abs(salt.noise), 1.0) if salt.noise == salt.noise else 1.0
    if salt.mean_lost <= floor:
        return f"≥{flush.mean_lost / floor:,.1f}× (noise)"
    return f"{flush.mean_lost / salt.mean_lost:,.1f}×"


def salt_of(cell: Cell, cells: Sequence[Cell]) -> Cell | None:
    """The cell with the salt of the same dialect, mode and transport (the ratio's denominator)."""
    same = (cell.dialect, cell.mode, "salt", cell.transport)
    return next((c for c in cells if (c.dialect, c.mode, c.cache, c.transport) == same), None)


def verdicts(cells: Sequence[Cell]) -> list[str]:
    """One line per dialect with both `keep` cells: the key ratio against the target."""
    lines = []
    for flush in (c for c in cells if c.mode == "keep" and c.cache == "flush" and c.transport == "path"):
        salt = salt_of(flush, cells)
        if salt is None:
            continue
        floor = max(abs(salt.noise), 1.0) if salt.noise == salt.noise else 1.0
        met = flush.mean_lost >= TARGET_RATIO * max(salt.mean_lost, floor) and salt.drained == 0
        verdict = "met" if met else "NOT met"
        if flush.disturbed or salt.disturbed:
            verdict = "inconclusive: a steady window was disturbed (!), rerun"
        lines.append(
            f"{flush.dialect} keep: tokens lost per update, flush ÷ salt = {ratio_text(flush, salt)} "
            f"({number(flush.mean_lost)} vs {number(salt.mean_lost)}); replicas drained for a cache with the salt: "
            f"{salt.drained} → target (≥ {TARGET_RATIO:g}×, none drained) {verdict}"
        )
    return lines + transport_lines(cells)


def transport_lines(cells: Sequence[Cell]) -> list[str]:
    """Per (dialect, mode, cache) run both ways: pause to serving and tokens lost per update, in memory vs from disk."""
    lines = []
    for transfer in (c for c in cells if c.transport == "transfer"):
        same = (transfer.dialect, transfer.mode, transfer.cache, "path")
        path = next((c for c in cells if (c.dialect, c.mode, c.cache, c.transport) == same), None)
        if path is None or not transfer.admin_s or not path.admin_s:
            continue
        from_disk, in_memory = statistics.fmean(path.admin_s), statistics.fmean(transfer.admin_s)
        lines.append(
            f"{transfer.dialect} {transfer.mode} {transfer.cache}: pause to serving {from_disk:.2f} s from the path, "
            f"{in_memory:.2f} s in memory; tokens lost per update {number(path.mean_lost)} vs "
            f"{number(transfer.mean_lost)}"
        )
    for adapter in (c for c in cells if c.transport == "adapter" and c.admin_s):
        floor = abs(adapter.noise) if adapter.noise == adapter.noise else 0.0
        within = "none beyond the noise (expected none)" if adapter.mean_lost <= floor else "MORE than the noise"
        lines.append(
            f"{adapter.dialect} adapter: tokens lost per update {number(adapter.mean_lost)} (noise "
            f"{number(adapter.noise)}): {within}; pause to serving {statistics.fmean(adapter.admin_s):.3f} s"
        )
    return lines


def report(console: Console, options: Options, cells: Sequence[Cell]) -> None:
    fleet = (
        f"one {options.engine} server on the CPU ({options.engine_model}; updates load {options.engine_model}_v2 and "
        f"{options.engine_model} in turn)"
        if options.engine
        else f"{options.replicas} sim replicas per stack, decode step {options.token_delay_s * 1000:g} ms, prefill "
        f"{options.prefill_delay_s * 1e6:g} µs per uncached prompt token"
    )
    title = (
        f"Weight updates under a steady RL load: {options.streams} streams, {fleet}, {options.min_tokens}-"
        f"{options.max_tokens} tokens a turn, {options.updates} updates {options.period_s:g} s apart after "
        f"{options.steady_s:g} s steady; {machine_line()}"
    )
    note = (
        f"tokens/s decoded by the fleet (the replicas' counters): 'steady', 'after' (the first {options.dip_s:g} s "
        f"after each update), 'trough' (the lowest {TROUGH_WIDTH_S:g}-s mean after one). 'lost': tokens lost per "
        f"update, ∫ (steady − rate) dt over {options.period_s:g} s from each update; 'noise': the same between the "
        "steady window's halves ((!): they differ by over a tenth of a period's tokens, the window was disturbed); "
        "'÷ salt': lost ÷ lost of the salt cell of the same dialect, mode and transport. 'admin ms': pause to "
        "serving, the update as the trainer saw it (pause, load or transfer, resume; a transfer's from its begin to "
        "its commit's answer). Per update: 'preempt' requests preempted, 'recomp' the KV tokens "
        "they recomputed, 'abort' requests aborted, 'resume' the gateway's resumes. 'hit': prefix-cache hit ÷ "
        "queried prompt tokens, steady → over the update windows. 'drain': replicas taken out of rotation for a flush "
        "(flush_pending). 'h/r/c': staleness budget sessions held / refused, turns cut (off: no trainer publishes "
        "a batch size here)."
    )
    rows = [cell_row(cell, salt_of(cell, cells)) for cell in cells]
    print_table(console, title, COLUMNS, rows, note)
    for line in verdicts(cells):
        console.print(line)
    for cell in cells:
        for message in cell.errors[:3]:
            console.print(f"[red]{cell.label}: {message}[/]")
