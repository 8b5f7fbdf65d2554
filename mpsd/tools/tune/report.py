"""The lines `mpsd tune` prints: one per trial as it finishes, then the best settings and their gain."""

from __future__ import annotations

from mpsd.tools.tune.trials import Objective, Trial

HEADER = (
    f"{'#':>3}  {'settings':<48} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'batch':>5} {'memory':>9}  note"
)


def _memory(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / (1 << 20):.0f} MiB"


def trial_line(index: int, trial: Trial, objective: Objective) -> str:
    name = trial.settings.describe()
    if trial.refused:
        return f"{index:>3}  {name:<48} refused: {trial.refused}"
    if trial.failed:
        return f"{index:>3}  {name:<48} failed: {trial.failed}"
    note = []
    if trial.errors:
        note.append(f"{trial.errors} requests failed")
    if objective.p99_ms is not None and trial.p99_ms > objective.p99_ms:
        note.append("p99 over the bound")
    return (
        f"{index:>3}  {name:<48} {trial.throughput:>8.1f} {trial.p50_ms:>7.2f} {trial.p99_ms:>7.2f} "
        f"{trial.mean_batch():>5.1f} {_memory(trial.memory_bytes):>9}  {', '.join(note)}"
    ).rstrip()


def summary(best: Trial, baseline: Trial, objective: Objective) -> list[str]:
    lines = [f"best: {best.settings.describe()}"]
    if not objective.feasible(best):
        lines.append(f"no trial met p99 <= {objective.p99_ms:g} ms; this one had the most throughput")
    if baseline.measured and baseline.throughput > 0:
        gain = best.throughput / baseline.throughput
        lines.append(
            f"  {best.throughput:.1f} req/s, p99 {best.p99_ms:.2f} ms: {gain:.2f}x trial 0 "
            f"({baseline.throughput:.1f} req/s, p99 {baseline.p99_ms:.2f} ms, as configured)"
        )
    return lines
