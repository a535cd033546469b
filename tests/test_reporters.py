"""Experiment trackers beside the metric log (leap.learning.reporters): a run of the real run
registry reports into MLflow's local store, read back with MLflow's own client; a stopped and
resumed run continues the same MLflow run; W&B offline and trackio local where installed; the
checks StartRun makes on `report_to`. The job is tests.run_jobs.CountingJob (a real job's
contract without a model) followed by the run's real plot. A whole trainer run reporting to
MLflow is in tests/test_trainer_e2e.py."""

from __future__ import annotations

import importlib.util
import json
import struct
import threading
from pathlib import Path

import pytest

from leap.learning import reporters
from leap.learning.metrics import plot_metrics
from leap.learning.registry import STOPPED, SUCCEEDED, RunRecord, RunRegistry
from leap.runtime import Violations
from tests.conftest import wait_for
from tests.run_jobs import CountingJob

CONFIG = {"steps": 4, "optimizer": {"learning_rate": 0.001, "schedule": "constant"}, "train_tasks": ["relu", "dot"]}


def plotted_job(record: RunRecord):
    """CountingJob's steps (loss 1/step), then the run's metrics.png, as a real job ends."""
    counting = CountingJob(step_seconds=0.01, **record.config.get("job", {}))

    def job(ctx):
        counting(ctx)
        plot_metrics(ctx.events(), ctx.output_dir / "metrics.png", title=ctx.run_id)

    return job


def run_to_end(tmp_path: Path, report_to: list[str], steps: int = 4, **job) -> tuple[RunRegistry, RunRecord]:
    registry = RunRegistry(tmp_path / "runs", plotted_job, tensorboard=False, service="trainer").open()
    record, _ = registry.start(f"r-{report_to}", {**CONFIG, "steps": steps, "job": job}, "fp", steps,
                               display_name="tiny", report_to=report_to)
    done = wait_for(lambda: (r := registry.get(record.run_id)).state in (SUCCEEDED, STOPPED) and r, 60, "the end")
    return registry, done


def mlflow_run(tmp_path: Path, leap_run_id: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "runs" / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "leap"]
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`leap.run_id` = '{leap_run_id}'")
    assert len(runs) == 1, f"{len(runs)} MLflow runs for one LEAP run"
    return client, runs[0]


@pytest.fixture
def local_mlflow(monkeypatch):
    pytest.importorskip("mlflow", reason="the [mlflow] extra is part of [test]")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the reporter sets in its own process


def test_a_run_reports_its_metrics_config_and_plot_to_mlflows_local_store(tmp_path, local_mlflow):
    registry, done = run_to_end(tmp_path, ["mlflow"])
    registry.close(timeout=10)
    assert done.state == SUCCEEDED
    client, run = mlflow_run(tmp_path, done.run_id)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(1 / s)) for s in range(1, 5)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/step_squared")] == [1, 4, 9, 16]
    assert run.data.params["optimizer.learning_rate"] == "0.001"
    assert json.loads(run.data.params["train_tasks"]) == ["relu", "dot"]
    assert run.info.run_name == "tiny" and run.data.tags["leap.service"] == "trainer"
    assert run.info.status == "FINISHED"
    assert {a.path for a in client.list_artifacts(run.info.run_id)} == {"config.json", "metrics.png"}
    state = json.loads((Path(done.output_dir) / reporters.STATE_FILE).read_text())
    assert state["mlflow"]["run_id"] == run.info.run_id


def test_a_stopped_and_resumed_run_continues_the_same_mlflow_run(tmp_path, local_mlflow):
    registry = RunRegistry(tmp_path / "runs", plotted_job, tensorboard=False).open()
    record, _ = registry.start("long", {**CONFIG, "steps": 400}, "fp", 400, report_to=["mlflow"])
    wait_for(lambda: registry.get(record.run_id).step >= 2, 30, "two steps")
    registry.stop(record.run_id)
    stopped = wait_for(lambda: (r := registry.get(record.run_id)).state == STOPPED and r, 30, "the stop")
    client, run = mlflow_run(tmp_path, record.run_id)
    assert run.info.status == "KILLED"
    registry.resume(record.run_id)
    wait_for(lambda: registry.get(record.run_id).step >= stopped.step + 2, 30, "steps after the resume")
    registry.stop(record.run_id)
    again = wait_for(lambda: (r := registry.get(record.run_id)).state == STOPPED and r, 30, "the second stop")
    registry.close(timeout=10)
    client, same = mlflow_run(tmp_path, record.run_id)  # still one MLflow run
    assert same.info.run_id == run.info.run_id
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert max(steps) == again.step and set(range(1, again.step + 1)) <= set(steps)


def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (`run-ID.wandb`), decoded with W&B's own protobuf
    schema: after a 7-byte file header, LevelDB log records (crc32, length, type) in 32 KiB
    blocks, a record split over blocks as FIRST, MIDDLE..., LAST."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, records = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:
            break
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_writes_a_run_that_wandb_sync_uploads(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the [wandb] extra is not installed")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    registry, done = run_to_end(tmp_path, ["wandb"])
    registry.close(timeout=10)
    assert done.state == SUCCEEDED
    (offline,) = (Path(done.output_dir) / "wandb").glob("offline-run-*")
    records = wandb_records(next(offline.glob("*.wandb")))
    history = [{item_key(item): json.loads(item.value_json) for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    losses = [(h["_step"], h["train/loss"]) for h in history if "train/loss" in h]
    assert losses == [(s, pytest.approx(1 / s)) for s in range(1, 5)]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item_key(item): json.loads(item.value_json) for item in run.config.update}
    assert config["optimizer"]["learning_rate"] == 0.001 and run.display_name == "tiny"
    assert list((offline / "files" / "media" / "images" / "plots").glob("metrics_*.png"))
    assert json.loads((Path(done.output_dir) / reporters.STATE_FILE).read_text())["wandb"]["mode"] == "offline"


def test_trackio_logs_to_its_local_store(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is imported
    pytest.importorskip("trackio", reason="the [trackio] extra is not installed")
    import trackio.utils

    if Path(trackio.utils.TRACKIO_DIR) != tmp_path / "trackio":
        pytest.skip("trackio was imported earlier in this process with another TRACKIO_DIR")
    monkeypatch.setenv("TRACKIO_PROJECT", "leap-test")
    registry, done = run_to_end(tmp_path, ["trackio"])
    registry.close(timeout=10)
    assert done.state == SUCCEEDED
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs("leap-test", done.run_id)
    losses = [(log["step"], log["train/loss"]) for log in logs if "train/loss" in log]
    assert losses == [(s, pytest.approx(1 / s)) for s in range(1, 5)]


def test_report_to_is_checked_by_name_duplicate_and_installation(monkeypatch):
    monkeypatch.setitem(reporters.MODULES, "trackio", "leap_no_such_module")  # as where the extra is absent
    v = Violations()
    reporters.report_to_violations(["tensorboard", "mlflow", "mlflow", "trackio"], "config.report_to", v)
    fields = dict(v.items)
    assert "must be one of mlflow, wandb, trackio" in fields["config.report_to[0]"]
    assert "twice" in fields["config.report_to[2]"]
    assert "pip install 'leap-suite[trackio]'" in fields["config.report_to[3]"]
    assert ("config.report_to[1]" in fields) == (importlib.util.find_spec("mlflow") is None)


def test_a_tracker_that_fails_mid_run_is_dropped_and_the_run_goes_on(tmp_path):
    class Flaky:
        name = "flaky"
        calls = 0

        def scalars(self, *args):
            Flaky.calls += 1
            raise ConnectionError("tracking server went away")

        def artifact(self, path):
            raise AssertionError("a dropped tracker gets nothing more")

        def finish(self, state):
            raise AssertionError("a dropped tracker gets nothing more")

    hold = threading.Event()
    registry = RunRegistry(tmp_path / "runs", lambda record: CountingJob(step_seconds=0.01, hold=hold),
                           tensorboard=False).open()
    record, _ = registry.start("r", CONFIG, "fp", 3)
    log = registry.metrics_log(record.run_id)
    log.attach([Flaky()])
    hold.set()
    done = wait_for(lambda: (r := registry.get(record.run_id)).state == SUCCEEDED and r, 30, "the end")
    registry.close(timeout=10)
    assert done.step == 3 and Flaky.calls == 1 and log.reporters == []


def test_flatten_turns_a_config_into_dotted_params():
    flat = reporters.flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2], "f": True, "g": {}})
    assert flat == {"a.b": "1", "a.c.d": "x", "e": "[1, 2]", "f": "true", "g": "{}"}
