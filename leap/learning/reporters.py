"""Experiment trackers beside a run's metric log: MLflow, Weights & Biases and trackio.

A run's `MetricsLog` writes events.jsonl and TensorBoard; with `report_to` (the run config's
field, `leap demo --report-to`) it also hands every "train" and "eval" event to each tracker
named there: the same scalars as TensorBoard (`<kind>/<name>` at the event's step), the run's
config once at the start (flattened: `optimizer.learning_rate`), and when the run ends its
plots (`*.png` of the run's directory) and its end state. One `Reporter` per tracker:

    reporter.scalars(kind, step, values, time)    # finite values only
    reporter.artifact(path)                       # a file (a plot) of the run
    reporter.finish(state)                        # "SUCCEEDED", "FAILED" or "STOPPED"

Each tracker is an optional extra (`pip install 'leap-suite[mlflow]'`), imported only when a
run asks for it; StartRun refuses a tracker that is not installed (`report_to_violations`).
Local by default, so no account is needed:

- mlflow: `MLFLOW_TRACKING_URI` when set (a server, a database); else a file store `mlruns/`
  in the service's runs directory, shared by its runs so they compare in one UI
  (`MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri runs/trainer/mlruns`). MLflow 3
  keeps the file store in maintenance mode behind `MLFLOW_ALLOW_FILE_STORE`, which this
  default sets in the service (a reader of the store sets it too). Experiment
  `MLFLOW_EXPERIMENT_NAME`, default "leap"; run name the display name or run id.
- wandb: `WANDB_MODE` when set; else online with `WANDB_API_KEY` and offline without (files
  under the run's directory, uploaded later with `wandb sync`). Project `WANDB_PROJECT`,
  default "leap"; the W&B run id is the LEAP run id.
- trackio: its local SQLite store (`TRACKIO_DIR`, default its cache directory; `trackio show`),
  or a Space or server with `TRACKIO_SPACE_ID` / `TRACKIO_SERVER_URL`. Project
  `TRACKIO_PROJECT`, default "leap"; run name the LEAP run id.

A resumed run continues the same tracker run (their ids are kept in `trackers.json` in the
run's directory). Steps redone after a resume are reported again: MLflow keeps both points of
such a step, W&B ignores steps below the last one it has. A tracker that fails mid-run is
logged as a warning and the run goes on; one that cannot start fails the run (resumable).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Protocol

from leap.runtime.logging import get_logger

TRACKERS = ("mlflow", "wandb", "trackio")
MODULES = {"mlflow": "mlflow", "wandb": "wandb", "trackio": "trackio"}  # what each extra installs
STATE_FILE = "trackers.json"
DEFAULT_PROJECT = "leap"

log = get_logger("leap.reporters")


@dataclasses.dataclass(frozen=True)
class TrackedRun:
    """What a tracker is told about the run it reports."""

    run_id: str
    display_name: str
    config: dict[str, Any]  # the run's config message as JSON
    output_dir: Path  # the run's directory
    runs_dir: Path  # the service's runs directory
    service: str = ""  # "trainer", "distill": a tag


class Reporter(Protocol):
    name: str

    def scalars(self, kind: str, step: int, values: dict[str, float], time: float) -> None: ...

    def artifact(self, path: Path) -> None: ...

    def finish(self, state: str) -> None: ...


def report_to_violations(names, prefix: str, violations) -> None:
    """Add a violation (`leap.runtime.Violations`) for each tracker in `names` that is unknown,
    listed twice, or not installed in this process."""
    seen = set()
    for i, name in enumerate(names):
        field = f"{prefix}[{i}]"
        if name not in TRACKERS:
            violations.add(field, f"unknown tracker {name!r}: must be one of {', '.join(TRACKERS)}")
        elif name in seen:
            violations.add(field, f"lists {name!r} twice")
        elif importlib.util.find_spec(MODULES[name]) is None:
            violations.add(field, f"{name} is not installed where this service runs: pip install 'leap-suite[{name}]'")
        seen.add(name)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"optimizer": {"learning_rate": 1e-3}}` -> `{"optimizer.learning_rate": "0.001"}`;
    lists become JSON."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value)
    return flat


def finite(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def open_reporters(names, run: TrackedRun) -> list[Reporter]:
    """Start (or, on a resume, continue) a tracker run for each name; their ids go to
    `trackers.json` in the run's directory. On a failure the ones started are closed."""
    path = run.output_dir / STATE_FILE
    try:
        state = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        state = {}
    reporters: list[Reporter] = []
    try:
        for name in names:
            opener = {"mlflow": MlflowReporter, "wandb": WandbReporter, "trackio": TrackioReporter}[name]
            own = dict(state.get(name, {}))
            reporters.append(opener(run, own))
            state[name] = own
    except Exception:
        for reporter in reporters:
            close_quietly(reporter, "FAILED")
        raise
    if reporters:
        temp = path.with_suffix(".json.tmp")
        temp.write_text(json.dumps(state, indent=1))
        temp.replace(path)
    return reporters


def parse_names(text: str) -> list[str]:
    """`"mlflow, wandb"` -> `["mlflow", "wandb"]` (a command line's comma-separated list)."""
    return [name.strip().lower() for name in text.split(",") if name.strip()]


def where_reported(output_dir: str | os.PathLike) -> list[str]:
    """For a person: where each tracker of a finished run wrote, and how to look (read from the
    run's `trackers.json`)."""
    path = Path(output_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    lines = []
    if "mlflow" in state:
        uri = state["mlflow"].get("tracking_uri", "")
        look = f"MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri {uri}" if uri.startswith("file:") else uri
        lines.append(f"mlflow: run {state['mlflow'].get('run_id', '?')} ({look})")
    if "wandb" in state:
        wandb = state["wandb"]
        look = f"wandb sync {wandb.get('dir', '')}/wandb/offline-run-*" if wandb.get("mode") == "offline" else "online"
        lines.append(f"wandb: run {wandb.get('id', '?')} ({look})")
    if "trackio" in state:
        lines.append(f"trackio: run {state['trackio'].get('name', '?')} (trackio show --project "
                     f"{os.environ.get('TRACKIO_PROJECT') or DEFAULT_PROJECT})")
    return lines


def close_quietly(reporter: Reporter, state: str) -> None:
    try:
        reporter.finish(state)
    except Exception as err:  # noqa: BLE001 - a tracker never fails the run once it is over
        log.warning("tracker did not close", tracker=reporter.name, error=f"{type(err).__name__}: {err}")


class MlflowReporter:
    """MLflow through `MlflowClient` (no global active run, so concurrent runs do not mix)."""

    name = "mlflow"
    KEY = re.compile(r"[^\w\-. :/]")  # characters MLflow refuses in metric and param names
    BATCH = 1000  # metrics per log_batch (MLflow's limit); params are 100
    PARAM_CHARS = 6000

    def __init__(self, run: TrackedRun, state: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or state.get("tracking_uri")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run.runs_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        if state.get("run_id"):
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            tags = {"leap.run_id": run.run_id, "leap.service": run.service, "leap.output_dir": str(run.output_dir)}
            created = self.client.create_run(experiment_id, run_name=run.display_name or run.run_id, tags=tags)
            self.run_id = created.info.run_id
            params = [Param(self.KEY.sub("_", k)[:250], v[: self.PARAM_CHARS]) for k, v in flatten(run.config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            self.client.log_dict(self.run_id, run.config, "config.json")
        state.update(run_id=self.run_id, tracking_uri=uri)
        self.uri = uri

    def scalars(self, kind: str, step: int, values: dict[str, float], time: float) -> None:
        from mlflow.entities import Metric

        stamp = int(time * 1000)
        metrics = [Metric(self.KEY.sub("_", f"{kind}/{k}"), v, stamp, int(step)) for k, v in values.items()]
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.BATCH])

    def artifact(self, path: Path) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def finish(self, state: str) -> None:
        status = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "STOPPED": "KILLED"}.get(state, "FINISHED")
        self.client.set_terminated(self.run_id, status=status)


class WandbReporter:
    """Weights & Biases; offline unless there is an API key or `WANDB_MODE` says otherwise."""

    name = "wandb"

    def __init__(self, run: TrackedRun, state: dict[str, Any]):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        directory = os.environ.get("WANDB_DIR") or str(run.output_dir)
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT, id=_wandb_id(run.run_id),
            name=run.display_name or run.run_id, config=run.config, dir=directory, mode=mode, resume="allow",
            reinit="create_new", tags=[run.service] if run.service else None,
            settings=wandb.Settings(console="off", quiet=True, x_disable_stats=True))
        state.update(id=self.run.id, mode=mode, dir=directory)

    def scalars(self, kind: str, step: int, values: dict[str, float], time: float) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=int(step))

    def artifact(self, path: Path) -> None:
        if path.suffix == ".png":
            self.run.log({f"plots/{path.stem}": self.wandb.Image(str(path))})
        else:
            self.run.save(str(path), base_path=str(path.parent), policy="now")

    def finish(self, state: str) -> None:
        self.run.finish(exit_code=1 if state == "FAILED" else 0)


def _wandb_id(run_id: str) -> str:
    return re.sub(r"[^\w\-]", "-", run_id)[:64]


class TrackioReporter:
    """trackio, local-first (a SQLite file per project)."""

    name = "trackio"

    def __init__(self, run: TrackedRun, state: dict[str, Any]):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT, name=run.run_id,
                                config=run.config, resume="allow", embed=False, auto_log_gpu=False, auto_log_cpu=False)
        self.last_step = -1
        state.update(name=run.run_id)

    def scalars(self, kind: str, step: int, values: dict[str, float], time: float) -> None:
        self.last_step = max(self.last_step, int(step))
        self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=int(step))

    def artifact(self, path: Path) -> None:
        if path.suffix == ".png":
            self.run.log({f"plots/{path.stem}": self.trackio.Image(str(path))}, step=max(self.last_step, 0))

    def finish(self, state: str) -> None:
        self.run.finish()


def report(reporters: list[Reporter], method: str, *args: Any) -> list[Reporter]:
    """Call `method` on every reporter; one that raises is logged and left out for the rest of
    the attempt (a resume brings it back), so a tracker never fails the run. Returns those
    still in."""
    kept = []
    for reporter in reporters:
        try:
            getattr(reporter, method)(*args)
            kept.append(reporter)
        except Exception as err:  # noqa: BLE001 - see the docstring
            log.warning("tracker failed; the run goes on without it", tracker=reporter.name, call=method,
                        error=f"{type(err).__name__}: {err}")
    return kept

