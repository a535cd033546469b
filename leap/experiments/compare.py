"""Comparing runs from their metric events: curves of held-out pass@1 against the cost spent
(sandbox evaluations, training seconds), the cost of reaching a target accuracy, and a
table and plot of it all. Pure functions over plain event dicts ({"kind", "step",
"values"}), so they are tested without services."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from leap.learning.metrics import save_figure

EVALUATIONS = "sandbox/evaluations_total"
SECONDS = "time/train_total_s"


@dataclasses.dataclass(frozen=True)
class Point:
    """One held-out evaluation of a run: its accuracy and what training had cost by then."""

    step: int
    evaluations: float
    seconds: float
    accuracy: float


def curve(events: Sequence[Mapping], metric: str) -> list[Point]:
    """The run's held-out evaluations of `metric`, in step order."""
    points = [Point(int(e["step"]), float(e["values"].get(EVALUATIONS, 0.0)), float(e["values"].get(SECONDS, 0.0)),
                    float(e["values"][metric]))
              for e in events if e["kind"] == "eval" and metric in e["values"]]
    return sorted(points, key=lambda p: p.step)


def cost_to_reach(points: Sequence[Point], target: float) -> Point | None:
    """The first evaluation after some training at or above `target`; None when the run never
    got there. (The evaluation before training costs nothing, so it cannot be compared.)"""
    return next((p for p in points if p.step > 0 and p.accuracy >= target - 1e-12), None)


def ratio(slow: float | None, fast: float | None) -> float:
    """How many times less `fast` spent than `slow` (nan when either is missing or zero)."""
    if not slow or not fast:
        return math.nan
    return slow / fast


@dataclasses.dataclass(frozen=True)
class Summary:
    """One run of a comparison, summarised."""

    name: str
    final: dict[str, float]  # metric -> last held-out value
    evaluations: float  # training's sandbox evaluations in all
    seconds: float  # training's wall seconds in all
    expanded_share: float  # mean over steps
    reached: Point | None  # first evaluation at the target accuracy


def summarize(name: str, events: Sequence[Mapping], metrics: Sequence[str], target_metric: str,
              target: float) -> Summary:
    trains = [e["values"] for e in events if e["kind"] == "train"]
    finals = {m: (curve(events, m)[-1].accuracy if curve(events, m) else math.nan) for m in metrics}
    last = trains[-1] if trains else {}
    return Summary(name, finals, float(last.get(EVALUATIONS, 0.0)), float(last.get(SECONDS, 0.0)),
                   sum(t.get("expanded_share", 0.0) for t in trains) / max(1, len(trains)),
                   cost_to_reach(curve(events, target_metric), target))


def label(metric: str) -> str:
    """'train_tasks/pass_at_1/turn_3' -> 'training tasks pass@1, turn 3'; unprefixed metrics are held-out."""
    where, _, name = metric.rpartition("pass_at_1/") if "pass_at_1/" in metric else ("", "", metric)
    turn = name.replace("turn_", "turn ")
    return f"{'training tasks' if where.startswith('train_tasks') else 'held-out'} pass@1, {turn}"


def markdown_table(summaries: Sequence[Summary], metrics: Sequence[str], target_label: str) -> str:
    header = ["run", *[label(m) for m in metrics], "sandbox evals", "train s",
              "expanded", f"evals to {target_label}", f"s to {target_label}"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        reached = (f"{s.reached.evaluations:,.0f}", f"{s.reached.seconds:,.0f}") if s.reached else ("not reached",) * 2
        cells = [s.name, *[f"{s.final[m]:.3f}" for m in metrics], f"{s.evaluations:,.0f}", f"{s.seconds:,.0f}",
                 f"{s.expanded_share:.0%}", *reached]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


COSTS = ((lambda p: p.evaluations, "sandbox evaluations (training)"),
         (lambda p: p.seconds, "wall-clock seconds (training)"))


def _cost_grid(metrics: Sequence[str], draw, path: str | Path, title: str, y_suffix: str = "") -> Path:
    """A grid with one row per metric and a column per cost (sandbox evaluations, training
    seconds); `draw(axis, metric, x)` plots the series of one panel, `x` a point's cost."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(metrics), 2, figsize=(11, 3.4 * len(metrics)), squeeze=False)
    for row, metric in enumerate(metrics):
        for column, (x, x_label) in enumerate(COSTS):
            axis = axes[row][column]
            draw(axis, metric, x)
            axis.set_xlabel(x_label)
            axis.set_ylabel(label(metric) + y_suffix)
            axis.grid(alpha=0.3)
            axis.legend(fontsize=8)
    return save_figure(figure, path, title)


def plot_curves(runs: Mapping[str, Sequence[Mapping]], metrics: Sequence[str], path: str | Path,
                title: str = "") -> Path:
    """A grid: one row per metric, columns against sandbox evaluations and training seconds."""
    def draw(axis, metric, x):
        for name, events in runs.items():
            points = curve(events, metric)
            axis.plot([x(p) for p in points], [p.accuracy for p in points], marker="o", markersize=3, label=name)

    return _cost_grid(metrics, draw, path, title)


# -- over seeds ------------------------------------------------------------------------------


def seed_dir(out: Path, seed: int, seeds: int) -> Path:
    """Where one seed's runs and report go: `out` itself when there is one seed, else out/seed-N."""
    return out if seeds == 1 else out / f"seed-{seed}"


@dataclasses.dataclass(frozen=True)
class Spread:
    """A figure over seeds: its mean, the standard error of that mean, and the seeds counted."""

    mean: float
    se: float
    n: int

    def __str__(self) -> str:
        return f"{self.mean:.3f} ± {self.se:.3f}" if self.n > 1 else f"{self.mean:.3f}"

    def to_json(self) -> dict:
        """The fields, with null for a figure no seed logged (NaN is not JSON other languages read)."""
        return {name: None if isinstance(value, float) and math.isnan(value) else value
                for name, value in dataclasses.asdict(self).items()}


def spread(values: Sequence[float]) -> Spread:
    """Mean and standard error of the values that are numbers (a metric a run never logged is nan)."""
    from leap.evaluation import standard_error

    kept = [float(v) for v in values if not math.isnan(float(v))]
    if not kept:
        return Spread(math.nan, math.nan, 0)
    return Spread(sum(kept) / len(kept), standard_error(kept), len(kept))


def across_seeds(per_seed: Sequence[Mapping[str, Summary]], metrics: Sequence[str]) -> dict[str, dict[str, Spread]]:
    """{run name: {figure: Spread over seeds}} for each metric's final value, the sandbox
    evaluations, the seconds and the expanded share; `per_seed` holds one {name: Summary} per seed."""
    names = [name for name in per_seed[0]] if per_seed else []
    out: dict[str, dict[str, Spread]] = {}
    for name in names:
        runs = [seed[name] for seed in per_seed if name in seed]
        figures = {m: spread([s.final[m] for s in runs]) for m in metrics}
        figures["evaluations"] = spread([s.evaluations for s in runs])
        figures["seconds"] = spread([s.seconds for s in runs])
        figures["expanded_share"] = spread([s.expanded_share for s in runs])
        out[name] = figures
    return out


@dataclasses.dataclass(frozen=True)
class MeanPoint:
    """One evaluation step of a run, over seeds: the mean cost by then and the accuracy's spread."""

    step: int
    evaluations: float
    seconds: float
    accuracy: Spread


def mean_curve(runs_by_seed: Sequence[Mapping[str, Sequence[Mapping]]], name: str, metric: str) -> list[MeanPoint]:
    """Run `name`'s curve of `metric` over the seeds that ran it: at each evaluation step every
    such seed logged, the mean sandbox evaluations and seconds spent by then and the accuracy as
    mean ± standard error (a step some seed did not evaluate is left out)."""
    curves = [{p.step: p for p in curve(runs[name], metric)} for runs in runs_by_seed if name in runs]
    if not curves:
        return []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return [MeanPoint(step, sum(c[step].evaluations for c in curves) / len(curves),
                      sum(c[step].seconds for c in curves) / len(curves),
                      spread([c[step].accuracy for c in curves])) for step in steps]


def before_training(runs_by_seed: Sequence[Mapping[str, Sequence[Mapping]]], metrics: Sequence[str]) -> dict[str, Spread]:
    """Each metric's step-0 evaluation (before any training; the same in every run of a seed, so
    the first run that logged it counts) as mean ± standard error over the seeds."""
    values: dict[str, list[float]] = {m: [] for m in metrics}
    for runs in runs_by_seed:
        for metric in metrics:
            first = next((points[0].accuracy for points in (curve(events, metric) for events in runs.values())
                          if points and points[0].step == 0), None)
            if first is not None:
                values[metric].append(first)
    return {metric: spread(found) for metric, found in values.items()}


def plot_seeds(runs_by_seed: Sequence[Mapping[str, Sequence[Mapping]]], metrics: Sequence[str], path: str | Path,
               title: str = "") -> Path:
    """`plot_curves` over seeds: each run's mean curve (`mean_curve`; the costs are means too),
    with the standard error of each point's accuracy as an error bar."""
    names = list(dict.fromkeys(name for runs in runs_by_seed for name in runs))

    def draw(axis, metric, x):
        for name in names:
            points = mean_curve(runs_by_seed, name, metric)
            seeds = max((p.accuracy.n for p in points), default=0)
            axis.errorbar([x(p) for p in points], [p.accuracy.mean for p in points],
                          yerr=[p.accuracy.se if p.accuracy.n > 1 else 0.0 for p in points], marker="o",
                          markersize=3, capsize=3, label=f"{name} ({seeds} seed{'s' if seeds != 1 else ''})")

    return _cost_grid(metrics, draw, path, title, " (mean ± s.e.)")


def seeds_table(spreads: Mapping[str, Mapping[str, Spread]], metrics: Sequence[str], seeds: int) -> str:
    """A markdown table of mean ± standard error over `seeds` seeds."""
    header = ["run", *[label(m) for m in metrics], "sandbox evals", "train s", "expanded"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, figures in spreads.items():
        cells = [name, *[str(figures[m]) for m in metrics],
                 f"{figures['evaluations'].mean:,.0f} ± {figures['evaluations'].se:,.0f}",
                 f"{figures['seconds'].mean:,.0f} ± {figures['seconds'].se:,.0f}",
                 f"{figures['expanded_share'].mean:.0%}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + f"\n\n(mean ± standard error over {seeds} seed{'s' if seeds != 1 else ''})"


@dataclasses.dataclass(frozen=True)
class Claim:
    """A paper's claim checked seed by seed: whether it held in each, and the line that says so."""

    text: str
    held: tuple[bool, ...]

    @property
    def verdict(self) -> str:
        if self.held and all(self.held):
            return "held"
        return "did not hold" if not any(self.held) else "mixed"

    def line(self, detail: str) -> str:
        return f"- {self.text}: {self.verdict} here ({sum(self.held)} of {len(self.held)} seeds; {detail})"


def dcp_claims(per_seed: Sequence[Mapping[str, Summary]], heldout_last: str) -> list[str]:
    """The DCP paper's claims, one line each, over the seeds that ran the modes they compare:
    LEAP reaches unpruned multi-turn's held-out pass@1 at the last turn with fewer sandbox
    evaluations and less wall-clock; multi-turn beats single-turn on held-out pass@1 at the
    last turn. A claim whose modes did not run is left out."""
    lines = []
    both = [s for s in per_seed if "leap" in s and "multiturn" in s]
    if both:
        claim = Claim("LEAP reaches unpruned multi-turn's held-out pass@1 with fewer sandbox evaluations and less "
                      "wall-clock", tuple(s["leap"].final[heldout_last] >= s["multiturn"].final[heldout_last] - 1e-12
                                          and s["leap"].evaluations < s["multiturn"].evaluations
                                          and s["leap"].seconds < s["multiturn"].seconds for s in both))
        leap = across_seeds(both, [heldout_last])
        lines.append(claim.line(
            f"{label(heldout_last)} {leap['leap'][heldout_last]} against {leap['multiturn'][heldout_last]}, "
            f"evaluations {ratio(leap['multiturn']['evaluations'].mean, leap['leap']['evaluations'].mean):.2f}x "
            f"fewer, wall-clock {ratio(leap['multiturn']['seconds'].mean, leap['leap']['seconds'].mean):.2f}x less"))
    pairs = [s for s in per_seed if "multiturn" in s and "single" in s]
    if pairs:
        claim = Claim(f"multi-turn beats single-turn on {label(heldout_last)}",
                      tuple(s["multiturn"].final[heldout_last] > s["single"].final[heldout_last] for s in pairs))
        figures = across_seeds(pairs, [heldout_last])
        lines.append(claim.line(f"{figures['multiturn'][heldout_last]} against {figures['single'][heldout_last]}"))
    return lines


def student_claim(rates_by_seed: Sequence[Mapping[str, float]], teachers_by_seed: Sequence[Sequence[str]],
                  student: str, set_label: str) -> str:
    """The expand-then-compress claim, seed by seed: the student's pass@1 above its strongest
    teacher's (a tie is not a win). `rates_by_seed` holds {model: pass@1} of one task set per seed."""
    best = [max(rates[t] for t in teachers) for rates, teachers in zip(rates_by_seed, teachers_by_seed)]
    mine = [rates[student] for rates in rates_by_seed]
    claim = Claim(f"the {student} student beats its strongest teacher on the {set_label}",
                  tuple(m > b for m, b in zip(mine, best)))
    return claim.line(f"{spread(mine)} against {spread(best)}")
