"""A run's metric events: one JSON object per line (`events.jsonl`), the same scalars as
TensorBoard events (`tensorboard/`), and a PNG of the main curves.

An event is a dict with the fields of `leap.common.v1.MetricEvent` plus a sequence number:

    {"seq": 12, "run_id": "...", "step": 3, "time": 1733150000.0, "kind": "train",
     "values": {"loss": 0.12, "pass_at_1/turn_1": 0.25}, "message": "", "state": 2}

Kinds: "train" (one step), "eval" (an evaluation pass), "state" (a change of run state),
"checkpoint" and "log". TensorBoard gets "train" and "eval" values as `<kind>/<name>`, and so
do the experiment trackers attached to the log (`attach`: MLflow, W&B, trackio; see
`leap.learning.reporters`), which also get the run's plots when they are detached.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from leap.learning import reporters

EVENTS_FILE = "events.jsonl"
SCALAR_KINDS = ("train", "eval")
# Curves of the PNG: a panel per group, each group's keys drawn when present.
DEFAULT_PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("held-out pass@1 by turn", [("eval", "pass_at_1/turn_1"), ("eval", "pass_at_1/turn_2"), ("eval", "pass_at_1/turn_3")]),
    ("training tasks pass@1 by turn (fresh samples)", [("eval", "train_tasks/pass_at_1/turn_1"),
                                                        ("eval", "train_tasks/pass_at_1/turn_2"),
                                                        ("eval", "train_tasks/pass_at_1/turn_3")]),
    ("rollouts pass@1 by turn", [("train", "pass_at_1/turn_1"), ("train", "pass_at_1/turn_2"), ("train", "pass_at_1/turn_3")]),
    ("loss", [("train", "loss")]),
    ("reward", [("train", "reward_mean"), ("train", "reward_std")]),
    ("expanded share", [("train", "expanded_share")]),
    ("clip fraction", [("train", "clip_frac_low"), ("train", "clip_frac_high")]),
    ("KL / entropy", [("train", "kl"), ("train", "entropy")]),
    ("step time (s)", [("train", "time/generate_s"), ("train", "time/evaluate_s"), ("train", "time/learn_s"), ("train", "time/sync_s")]),
]


class MetricsLog:
    """Append-only event log of one run, safe to call from several threads."""

    def __init__(self, directory: str | os.PathLike, *, tensorboard: bool = True):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / EVENTS_FILE
        self._lock = threading.Lock()
        self._tensorboard = tensorboard
        self._writer: Any = None
        self._purge_step: int | None = None
        self.next_seq = 1 + max((e["seq"] for e in self.read()), default=0)
        self.reporters: list = []  # experiment trackers (leap.learning.reporters), while a run is executing

    def append(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record `event` (given a sequence number) and return it."""
        with self._lock:
            event = {**event, "seq": self.next_seq}
            self.next_seq += 1
            with open(self.path, "a") as f:
                f.write(json.dumps(event, allow_nan=True) + "\n")
            if event.get("kind") in SCALAR_KINDS and self._tensorboard:
                self._scalars(event)
            if event.get("kind") in SCALAR_KINDS and self.reporters:
                self.reporters = reporters.report(self.reporters, "scalars", event["kind"], int(event["step"]),
                                                  reporters.finite(event.get("values", {})), event.get("time", 0.0))
        return event

    def attach(self, trackers: list) -> None:
        """Hand "train" and "eval" events to these trackers from now on."""
        with self._lock:
            self.reporters = list(trackers)

    def detach(self, state: str) -> None:
        """Give the attached trackers the run's plots (`*.png` of its directory) and its end
        state ("SUCCEEDED", "FAILED", "STOPPED"), and let them go."""
        with self._lock:
            attached, self.reporters = self.reporters, []
        for path in sorted(self.directory.glob("*.png")):
            attached = reporters.report(attached, "artifact", path)
        for reporter in attached:
            reporters.close_quietly(reporter, state)

    def read(self, from_step: int = 0) -> list[dict[str, Any]]:
        """Recorded events with step >= from_step, in order (a torn last line is skipped)."""
        if not self.path.is_file():
            return []
        events = []
        with open(self.path) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill mid-write
                if int(event.get("step", 0)) >= from_step:
                    events.append(event)
        return events

    def rewind(self, step: int) -> None:
        """Forget "train", "eval" and "checkpoint" events after `step` (a run resumed from the
        checkpoint of `step` redoes them), keeping state and log events for the record."""
        with self._lock:
            kept = [e for e in self.read() if e.get("kind") not in (*SCALAR_KINDS, "checkpoint") or int(e["step"]) <= step]
            tmp = self.path.with_suffix(".jsonl.tmp")
            with open(tmp, "w") as f:
                for event in kept:
                    f.write(json.dumps(event, allow_nan=True) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self.close_tensorboard()
            self._purge_step = step + 1  # TensorBoard drops its own events from this step on

    def _scalars(self, event: dict[str, Any]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(self.directory / "tensorboard"), purge_step=self._purge_step)
            self._purge_step = None
        for name, value in event.get("values", {}).items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(f"{event['kind']}/{name}", value, int(event["step"]), walltime=event.get("time"))
        self._writer.flush()

    def close_tensorboard(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self) -> None:
        with self._lock:
            self.close_tensorboard()


def series(events: Iterable[dict[str, Any]], kind: str, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(x, y) of one value over events of one kind; x is "step", "time" (seconds since the
    first event) or the name of another value (for example "sandbox_evaluations_total")."""
    events = list(events)
    start = min((e["time"] for e in events if "time" in e), default=0.0)
    xs, ys = [], []
    for event in events:
        if event.get("kind") != kind or key not in event.get("values", {}):
            continue
        if x == "step":
            xs.append(float(event["step"]))
        elif x == "time":
            xs.append(float(event["time"]) - start)
        elif x in event["values"]:
            xs.append(float(event["values"][x]))
        else:
            continue
        ys.append(float(event["values"][key]))
    return xs, ys


def plot_metrics(events: Sequence[dict[str, Any]], path: str | os.PathLike, *, title: str = "",
                 panels: list[tuple[str, list[tuple[str, str]]]] | None = None) -> Path | None:
    """A PNG with one panel per group of curves that has data; None when nothing has."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = panels if panels is not None else DEFAULT_PANELS
    drawn = []
    for name, curves in panels:
        lines = [(f"{key}", series(events, kind, key)) for kind, key in curves]
        lines = [(label, xy) for label, xy in lines if xy[0]]
        if lines:
            drawn.append((name, lines))
    if not drawn:
        return None
    columns = 2 if len(drawn) > 1 else 1
    rows = math.ceil(len(drawn) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    for axis, (name, lines) in zip(axes.flat, drawn):
        for label, (xs, ys) in lines:
            axis.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        axis.set_title(name)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    for axis in list(axes.flat)[len(drawn):]:
        axis.axis("off")
    return save_figure(figure, path, title)


def save_figure(figure, path: str | os.PathLike, title: str = "") -> Path:
    """Title, lay out, write as PNG (folders created) and close a matplotlib figure."""
    import matplotlib.pyplot as plt

    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
