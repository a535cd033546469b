"""The commands a person runs first: `leap demo` (the README's main job), `leap
dcp-experiment` and `leap expand-compress`, as real `leap` processes that start their own
stack on free loopback ports. Sizes are the smallest that go through every stage (one step,
tiny groups, the bootstrapped tiny model given with --model so nothing is built); the real
runs and their figures are in the README."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from leap.commands.demo import DEMO_TRAIN_TASKS_MEASURED
from tests.conftest import BOOTSTRAP_CACHE, ROOT, subprocess_env, task_suite

# Whole stacks in subprocesses: minutes on 2 cores, more on a busy machine. The subprocess
# limit stays under the test's, so a hang fails with the command's output, not a bare timeout.
pytestmark = pytest.mark.timeout(1800)

SMALL = ["--steps", "1", "--tasks-per-step", "2", "--group-size", "2", "--max-turns", "2", "--eval-samples", "1",
         "--quiet"]


def leap(*args: str, timeout: float = 1500, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leap", *args], cwd=ROOT, env=subprocess_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["demo", "--steps", "0"], "--steps must be at least 1"),
    (["demo", "--group-size", "1"], "--group-size must be at least 2"),
    (["demo", "--train-tasks-measured", "-1"], "--train-tasks-measured must be at least 0"),
    (["demo", "--model", "/no/such/model"], "--model: '/no/such/model' is not a directory"),
    (["demo", "--report-to", "mlflow,neptune"], "unknown tracker 'neptune': must be one of mlflow, wandb, trackio"),
    (["dcp-experiment", "--modes", "leap,fast"], "--modes: choose from leap, multiturn, single"),
    (["expand-compress", "--ablations", "crd,magic"], "--ablations: choose from crd, consensus"),
    (["expand-compress", "--rounds", "0"], "--rounds must be at least 1"),
    (["expand-compress", "--reliability-threshold", "nan"], "--reliability-threshold must be in [0, 1], not nan"),
    (["demo", "--task-families", "elementwise@4"], "--task-families: task family entry 'elementwise@4': the tier"),
    (["dcp-experiment", "--task-families", "softmaxes"], "--task-families: unknown task family 'softmaxes'"),
    (["expand-compress", "--task-families", "elementwise@1:5"], "gives no training task or no held-out one"),
])
def test_a_mistyped_option_is_one_friendly_line(args, words):
    done = leap(*args, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_the_demo_trains_and_reports_before_and_after(tiny_model_dir, tmp_path, monkeypatch):
    done = leap("demo", "--model", str(tiny_model_dir), "--out", str(tmp_path), "--report-to", "mlflow", *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    for key in ("train_tasks", "held_out"):
        assert {"pass_at_1/turn_1", "pass_at_1/turn_2", "pass_at_k/turn_2"} <= set(report[key]["after"])
    assert report["steps"] == 1 and report["sandbox_evaluations"] >= 4
    assert report["speed_rank"] is False  # the cpu toolchain's default: the same command, the same pass rates
    run_dir = Path(report["output_dir"])
    assert (run_dir / "metrics.png").is_file() and (run_dir / "rollouts" / "step-00000001.jsonl").is_file()
    text = (tmp_path / "report.txt").read_text()
    assert "training tasks, fresh samples" in text and "held-out tasks" in text and str(run_dir) in text
    assert text in done.stdout

    # The same run in MLflow's local store (the trainer's runs directory), read back with MLflow's client.
    from mlflow.tracking import MlflowClient

    (tracked,) = [line for line in report["trackers"] if line.startswith("mlflow:")]
    assert "MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri file:" in tracked and "reported to mlflow:" in text
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the report says, to read MLflow 3's file store
    client = MlflowClient(tracking_uri=(run_dir.parent / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "leap"]
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`leap.run_id` = '{report['run_id']}'")
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    first_turn = {e["step"]: e["values"]["train_tasks/pass_at_1/turn_1"] for e in events
                  if e["kind"] == "eval" and "train_tasks/pass_at_1/turn_1" in e["values"]}
    history = client.get_metric_history(run.info.run_id, "eval/train_tasks/pass_at_1/turn_1")
    assert {m.step: m.value for m in history} == first_turn and set(first_turn) == {0, 1}
    # (the family tasks may leave the tiny model no group with a reward spread to learn from
    # in one step, so its loss can be absent; what the sandbox spent is always logged)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/sandbox/evaluations")] == [1]
    # the training-task evaluation measured the demo's fixed sample of them, and every
    # evaluation left its per-task figures for the paired changes the report prints
    assert report["train_tasks"]["after"]["samples"] == report["task_counts"]["train_tasks"] == DEMO_TRAIN_TASKS_MEASURED
    assert report["held_out"]["after"]["samples"] == report["task_counts"]["held_out"] == 39
    assert len(list((run_dir / "evals").glob("step-*.json"))) == 2 and set(report["changes"]) == {"held_out", "train_tasks"}
    assert run.data.params["group_size"] == "2" and run.info.status == "FINISHED"
    assert "metrics.png" in {a.path for a in client.list_artifacts(run.info.run_id)}

    # Every service's log, the trainer's with its model loads and checkpoints, is JSON lines only.
    for log in (tmp_path / "stack" / "logs").glob("*.log"):
        for number, line in enumerate(log.read_text().splitlines(), 1):
            assert line.startswith("{") and json.loads(line), f"{log.name}:{number} is not JSON: {line[:200]}"


@pytest.mark.slow
def test_the_dcp_experiment_compares_modes_in_a_table_and_a_plot(tiny_model_dir, tmp_path):
    # One mode keeps this to one stack; every mode runs the same code (train_mode) with its config.
    # Two seeds: each gets its own runs, table and plot, and the top report spreads them. On the
    # built-in suite and without --model: the command bootstraps its model for those tasks, which
    # the cache the tests built holds (same tasks, same config), so this copies it.
    done = leap("dcp-experiment", "--task-families", "none", "--out", str(tmp_path), "--modes", "single",
                "--seeds", "2", "--seed", "5", *SMALL, env={"LEAP_CACHE_DIR": str(BOOTSTRAP_CACHE.parent)})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for seed in (5, 6):
        summary = json.loads((tmp_path / f"seed-{seed}" / "report.json").read_text())
        assert set(summary) == {"single"}
        assert summary["single"]["expanded_share"] == 0.0 and summary["single"]["evaluations"] > 0
        assert (tmp_path / f"seed-{seed}" / "dcp.png").is_file()
        assert f"seed {seed}" in (tmp_path / f"seed-{seed}" / "report.md").read_text()
    assert (tmp_path / "model" / "config.json").is_file()
    over = json.loads((tmp_path / "report.json").read_text())
    assert over["seeds"] == [5, 6] and over["runs"]["single"]["evaluations"]["n"] == 2
    assert "| single |" in (tmp_path / "report.md").read_text() and "over 2 seeds" in done.stdout
    assert (tmp_path / "dcp.png").is_file() and f"plot: {tmp_path / 'dcp.png'}" in done.stdout  # the mean curves

    # The same command again finds both seeds' runs finished with these settings: it reads their
    # events back (no stack starts) and writes the same figures; a third seed would be the one run.
    reports = {seed: (tmp_path / f"seed-{seed}" / "report.json").read_text() for seed in (5, 6)}
    again = leap("dcp-experiment", "--task-families", "none", "--out", str(tmp_path), "--modes", "single",
                 "--seeds", "2", "--seed", "5", *SMALL, env={"LEAP_CACHE_DIR": str(BOOTSTRAP_CACHE.parent)})
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished before with these settings") == 2
    assert {seed: (tmp_path / f"seed-{seed}" / "report.json").read_text() for seed in (5, 6)} == reports


def test_a_finished_mode_is_reused_only_with_the_settings_it_ran_with(tmp_path):
    from leap.commands.dcp_experiment import finished_events, finished_stamp
    from leap.trainer.v1 import trainer_pb2

    model = tmp_path / "model"
    model.mkdir()
    (model / "bootstrap.json").write_text(json.dumps({"key": "abc"}))
    config = trainer_pb2.RunConfig(steps=20, seed=1, tasks_per_step=8)
    stamp = finished_stamp(config, "elementwise@1:980", model)
    record = tmp_path / "events.json"
    assert finished_events(record, stamp) is None  # nothing ran yet
    record.write_text(json.dumps({"stamp": stamp, "events": [{"step": 20, "kind": "eval"}]}))
    assert finished_events(record, stamp) == [{"step": 20, "kind": "eval"}]
    for changed in (finished_stamp(trainer_pb2.RunConfig(steps=20, seed=2, tasks_per_step=8), "elementwise@1:980", model),
                    finished_stamp(config, "elementwise@1:500", model)):
        assert finished_events(record, changed) is None
    (model / "bootstrap.json").write_text(json.dumps({"key": "rebuilt"}))
    assert finished_events(record, finished_stamp(config, "elementwise@1:980", model)) is None
    record.write_text("[]")  # an events.json from before the stamp: run again
    assert finished_events(record, stamp) is None
    (model / "bootstrap.json").write_text("{not json")  # a damaged manifest: the files identify the model
    assert finished_stamp(config, "elementwise@1:980", model)["model"][0][0] == "bootstrap.json"


@pytest.mark.slow
def test_expand_compress_trains_teachers_distils_a_student_and_measures_all(tiny_model_dir, tmp_path):
    # On the built-in suite, which the tests' tiny model was warm-started on (on the demo's
    # generated tasks its one-step teacher passes none), 12 of its training tasks; the student
    # is the ablation without reliability gating, which a teacher this weak still teaches.
    done = leap("expand-compress", "--model", str(tiny_model_dir), "--task-families", "none", "--out", str(tmp_path),
                "--rounds", "1",
                "--steps-per-round", "1", "--distill-steps", "1", "--ablations", "no-gating", "--tasks-per-step", "2",
                "--group-size", "2", "--max-turns", "2", "--eval-samples", "2", "--seeds", "2", "--train-tasks", "12",
                "--quiet")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for seed in (0, 1):
        results = json.loads((tmp_path / f"seed-{seed}" / "report.json").read_text())
        assert results["teachers"] == ["teacher-1"] and results["students"] == {"no-gating": "student-no-gating"}
        # the first 12 training tasks by id, and every held-out one
        train, held_out = (results["sets"][split]["per_task"]["initial"] for split in ("train", "heldout"))
        suite = task_suite()
        assert list(train) == sorted(t.id for t in suite if t.split == "train")[:12]
        assert sorted(held_out) == sorted(t.id for t in suite if t.split == "heldout")
        for split in ("train", "heldout"):
            assert set(results["sets"][split]["pass_at_1"]) == {"initial", "teacher-1", "student-no-gating"}
        assert (tmp_path / f"seed-{seed}" / "expand_compress.png").is_file()
    over = json.loads((tmp_path / "report.json").read_text())
    assert over["seeds"] == [0, 1] and over["pass_at_1"]["student-no-gating"]["heldout"]["n"] == 2
    # the bars over seeds, with their error bars
    assert (tmp_path / "expand_compress.png").is_file() and f"plot: {tmp_path / 'expand_compress.png'}" in done.stdout
    assert [line.split(":")[0] for line in over["claims"]] == [
        "- the student-no-gating student beats its strongest teacher on the training tasks (fresh samples)",
        "- the student-no-gating student beats its strongest teacher on the held-out tasks"]

    # Again with one more seed: the two finished seeds are read back, only seed 2 would run;
    # with --seeds 2 nothing runs and the top report is the same.
    report = (tmp_path / "report.json").read_text()
    again = leap("expand-compress", "--model", str(tiny_model_dir), "--task-families", "none", "--out", str(tmp_path),
                 "--rounds", "1", "--steps-per-round", "1", "--distill-steps", "1", "--ablations", "no-gating",
                 "--tasks-per-step", "2", "--group-size", "2", "--max-turns", "2", "--eval-samples", "2", "--seeds", "2",
                 "--train-tasks", "12", "--quiet")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("finished before with these settings") == 2 and "starting the services" not in again.stdout
    assert (tmp_path / "report.json").read_text() == report


@pytest.mark.parametrize("command, measured, train_tasks", [
    (["demo"], DEMO_TRAIN_TASKS_MEASURED, True),
    (["dcp-experiment"], 48, True),
    (["demo", "--train-tasks-measured", "0"], 0, False),  # the training tasks left out of every evaluation
    (["dcp-experiment", "--train-tasks-measured", "5", "--eval-every", "4"], 5, True),
])
def test_the_commands_give_the_trainer_the_evaluation_they_were_asked_for(command, measured, train_tasks):
    from leap.cli import build_parser
    from leap.commands.demo import evaluation_fields
    from leap.trainer.v1 import trainer_pb2

    args = build_parser().parse_args(command)
    config = trainer_pb2.RunConfig(**evaluation_fields(args))  # the fields are RunConfig's own
    assert (config.eval_train_tasks, config.eval_train_task_count) == (train_tasks, measured)
    assert config.eval_every == args.eval_every and config.eval_samples == args.eval_samples


@pytest.mark.parametrize("flags, toolchain, timed", [
    ([], "TOOLCHAIN_CPU", False),  # auto: speed does not rank on a shared cpu, so nothing is timed
    ([], "TOOLCHAIN_CUDA", True),
    (["--speed-rank", "on"], "TOOLCHAIN_CPU", True),
    (["--speed-rank", "off"], "TOOLCHAIN_CUDA", False),
])
def test_expand_compress_times_its_teachers_verdicts_only_where_speed_ranks(flags, toolchain, timed, tiny_model_dir):
    from svc_trainer.config import violations

    from leap.cli import build_parser
    from leap.commands.demo import NO_SPEED_MARGIN
    from leap.commands.expand_compress import check_args, rgrpo_config
    from leap.common.v1 import common_pb2

    args = build_parser().parse_args(["expand-compress", "--task-families", "none", *flags])
    check_args(args)
    config = rgrpo_config(args, tiny_model_dir, common_pb2.Toolchain.Value(toolchain))
    assert config.HasField("sandbox_timing") and config.sandbox_timing is timed
    assert (config.rank.speedup_margin == NO_SPEED_MARGIN) is not timed  # untimed: solved rollouts tie on speed
    assert config.rgrpo.rounds == args.rounds and list(config.train_tasks) == args.train_ids
    assert violations(config).items == []  # the trainer takes it as it is


def test_expand_compress_gives_each_student_its_ablation_and_the_threshold_asked_for(tiny_model_dir):
    from svc_distill.config import violations

    from leap.cli import build_parser
    from leap.commands.expand_compress import check_args, distill_config
    from leap.common.v1 import common_pb2

    cpu = common_pb2.Toolchain.TOOLCHAIN_CPU
    args = build_parser().parse_args(["expand-compress", "--task-families", "none"])
    check_args(args)
    crd = distill_config(args, tiny_model_dir, cpu, "/runs/union.json", "crd")
    assert not crd.HasField("reliability_threshold")  # the distiller's default
    assert crd.student_model == "student-crd" and crd.steps == args.distill_steps
    assert distill_config(args, tiny_model_dir, cpu, "/runs/union.json", "no-gating").disable_reliability_gating
    args = build_parser().parse_args(["expand-compress", "--task-families", "none", "--reliability-threshold", "0.25"])
    check_args(args)
    config = distill_config(args, tiny_model_dir, cpu, "/runs/union.json", "consensus")
    assert config.reliability_threshold == 0.25 and config.objective != crd.objective
    assert violations(config).items == []


def test_a_run_the_service_refuses_is_a_run_failed_naming_the_field(tmp_path):
    """What the experiment commands turn into one line (the CLI's UserError), rather than a
    traceback of the gRPC error: a real trainer refusing a config."""
    from leap.clients import connect
    from leap.experiments.runs import RunFailed, run_to_end
    from leap.trainer.v1 import trainer_pb2
    from tests.conftest import free_port, leap_serve

    dead = f"127.0.0.1:{free_port()}"
    flags = ["--runs-dir", str(tmp_path), "--policy-address", dead, "--sandbox-address", dead,
             "--reward-address", dead, "--preflight-timeout-seconds", "1"]
    with leap_serve("trainer", *flags) as (address, _):
        trainer = connect("trainer", address, aio=False)
        try:
            with pytest.raises(RunFailed) as caught:
                run_to_end(trainer, trainer_pb2, trainer_pb2.RunConfig(model_path=str(tmp_path), steps=0), "LEAP",
                           progress=False)
        finally:
            trainer.channel.close()
    assert str(caught.value).startswith("LEAP: INVALID_ARGUMENT from the service: ")
    assert "config.steps: is required and must be at least 1" in str(caught.value)  # the violation in full
    assert "config.steps" in caught.value.fields  # what a command's hint is keyed on
    from leap.runtime.errors import call_failure

    assert call_failure(ValueError("not a call")) is None  # anything else is left to its own handler
