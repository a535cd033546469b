"""`leap eval`: the figures the papers report, checked by hand on constructed outcomes (pass@1
and its standard error over tasks, pass@k, fast_p, the geometric-mean speedup), and the
command as a user runs it: a real `leap` process that starts a policy serving the tiny model
and a sandbox serving generated tasks or a directory in KernelBench's own layout, and writes
its table, eval.json and eval.png."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from leap.evaluation import (EvalReport, best_speedup_by_turn, fast_p_by_turn, geomean_speedup_of_correct,
                             paired_change, standard_error)
from leap.rollouts import Outcome
from tests.conftest import ROOT, subprocess_env

pytestmark = pytest.mark.timeout(1200)

WRONG = Outcome(False)


def fast(speedup: float) -> Outcome:
    return Outcome(True, speedup)


def test_fast_p_counts_samples_correct_by_a_turn_with_a_speedup_above_p():
    samples = [
        [WRONG, fast(2.5)],  # correct at turn 2, fast enough for every p
        [fast(1.2)],  # correct at turn 1, above 1 only (its last result carried to turn 2)
        [fast(0.5), fast(1.6)],  # slow at turn 1, above 1.5 at turn 2: the best so far counts
        [Outcome(True, 40.0, suspicious=True)],  # correct, but a flagged speedup is never fast
        [WRONG, WRONG],
    ]
    assert best_speedup_by_turn(samples[2], 3) == [0.5, 1.6, 1.6]
    assert fast_p_by_turn(samples, 0.0, 2) == [3 / 5, 4 / 5]  # fast_0: the share correct
    assert fast_p_by_turn(samples, 1.0, 2) == [1 / 5, 3 / 5]
    assert fast_p_by_turn(samples, 1.5, 2) == [0.0, 2 / 5]
    assert fast_p_by_turn(samples, 2.0, 2) == [0.0, 1 / 5]
    assert fast_p_by_turn([], 1.0, 2) == [0.0, 0.0]


def test_the_geometric_mean_takes_each_samples_best_credited_speedup():
    samples = [[WRONG, fast(2.0)], [fast(0.5), fast(8.0)], [Outcome(True, 99.0, unreliable=True)], [WRONG]]
    assert geomean_speedup_of_correct(samples) == pytest.approx(math.sqrt(2.0 * 8.0))
    assert geomean_speedup_of_correct([[WRONG]]) == 0.0


def test_the_summary_by_turn_with_the_standard_error_over_tasks():
    report = EvalReport(task_ids=["a", "b", "c"], turns=2, evaluations=9, outcomes={
        "a": [[fast(2.0)], [WRONG, fast(1.0)]],  # 1/2 at turn 1, 2/2 at turn 2
        "b": [[WRONG, WRONG], [WRONG, WRONG]],  # 0, 0
        "c": [[fast(0.9)], [fast(3.0)]],  # 1, 1
    })
    summary = report.summary()
    assert summary["pass_at_1"] == [3 / 6, 4 / 6]
    assert summary["pass_at_k"] == [2 / 3, 2 / 3]
    # per-task rates at turn 1: 0.5, 0, 1 -> mean 0.5, sample sd 0.5, se 0.5 / sqrt(3)
    assert summary["pass_at_1_se"][0] == pytest.approx(0.5 / math.sqrt(3))
    assert summary["pass_at_1_se"][1] == pytest.approx(standard_error([1.0, 0.0, 1.0]))
    assert summary["fast_p"]["1.5"] == [2 / 6, 2 / 6]  # a's first sample (2.0) and c's second (3.0)
    assert summary["geomean_speedup_of_correct"] == pytest.approx((2.0 * 1.0 * 0.9 * 3.0) ** 0.25)
    assert summary["per_task_pass_at_1"] == {"a": 1.0, "b": 0.0, "c": 1.0}
    assert summary["tasks"] == 3 and summary["samples"] == 6 and summary["sandbox_evaluations"] == 9


def test_the_metrics_carry_the_standard_error_and_the_rates_by_turn_per_task():
    report = EvalReport(task_ids=["a", "b"], turns=2, outcomes={
        "a": [[WRONG, fast(1.0)], [fast(1.0)]], "b": [[WRONG, WRONG], [WRONG, WRONG]]})
    assert report.pass_rates_by_turn() == {"a": [0.5, 1.0], "b": [0.0, 0.0]}
    metrics = report.metrics()
    assert metrics["pass_at_1_se/turn_1"] == pytest.approx(standard_error([0.5, 0.0]))
    assert metrics["pass_at_1_se/turn_2"] == pytest.approx(standard_error([1.0, 0.0]))


def test_a_paired_change_is_the_mean_per_task_difference_with_its_standard_error():
    before = {"a": [0.0, 0.5], "b": [0.5, 0.5], "c": [1.0, 1.0]}
    after = {"a": [0.5, 0.5], "b": [1.0, 1.0], "c": [1.0, 1.0]}
    change, error = paired_change(before, after, 1)  # differences 0.5, 0.5, 0
    assert change == pytest.approx(1 / 3) and error == pytest.approx(standard_error([0.5, 0.5, 0.0]))
    assert paired_change(before, after, 2) == (pytest.approx(0.5 / 3), pytest.approx(standard_error([0.0, 0.5, 0.0])))
    # A gain every task shares has no error at all, however hard the tasks are apart.
    assert paired_change({"a": [0.0], "b": [0.5]}, {"a": [0.25], "b": [0.75]}, 1) == (pytest.approx(0.25), 0.0)
    with pytest.raises(ValueError, match="different tasks"):
        paired_change(before, {"a": [1.0]}, 1)


def leap(*args: str, timeout: float = 1000) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "leap", *args], cwd=ROOT, env=subprocess_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("args, words", [
    (["--samples", "0"], "--samples must be at least 1"),
    (["--tier", "4"], "--tier: 0 (every tier) or 1 to 3"),
    (["--sandbox", "127.0.0.1:1", "--task-dirs", "x"], "with --sandbox, set them on that service"),
    (["--tasks", "relu", "--split", "heldout"], "--tasks names the tasks"),
    (["--policy", "127.0.0.1:1"], "--policy needs --tokenizer DIR"),
    (["--model", "/no/such/model"], "--model: '/no/such/model' is not a directory"),
])
def test_a_mistyped_option_is_one_friendly_line(args, words):
    done = leap("eval", *args, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


SMALL = ["--samples", "2", "--turns", "2", "--max-new-tokens", "48", "--quiet"]


@pytest.mark.slow
def test_eval_measures_the_model_on_a_generated_family_and_writes_table_json_and_plot(tiny_model_dir, tmp_path):
    done = leap("eval", "--model", str(tiny_model_dir), "--task-families", "rows:60", "--family", "rows",
                "--split", "heldout", "--limit", "3", "--out", str(tmp_path), *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "eval.json").read_text())
    assert summary["tasks"] == 3 and summary["samples"] == 6 and summary["turns"] == 2
    assert all(t.startswith("fam.rows.s0.") for t in summary["task_ids"]) and summary["splits"]["heldout"] == 3
    assert summary["sandbox_evaluations"] >= 6  # every first turn, plus a debugging turn for each unsolved one
    for series in (summary["pass_at_1"], summary["pass_at_k"], *summary["fast_p"].values()):
        assert len(series) == 2 and series[0] <= series[1] and all(0 <= v <= 1 for v in series)
    assert summary["fast_p"]["0"] == summary["pass_at_1"]
    assert (tmp_path / "eval.png").stat().st_size > 1000
    assert "turn  pass@1" in done.stdout and "fast_1.5" in done.stdout and "standard error over tasks" in done.stdout


@pytest.mark.slow
def test_eval_takes_a_directory_in_kernelbenchs_layout_and_names_an_unserved_family(tiny_model_dir, tmp_path):
    level = tmp_path / "KernelBench" / "KernelBench" / "level1"
    level.mkdir(parents=True)
    (level / "19_ReLU.py").write_text(
        "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def forward(self, x):\n"
        "        return torch.relu(x)\n\n\ndef get_inputs():\n    return [torch.randn(16, 64)]\n\n\n"
        "def get_init_inputs():\n    return []\n")
    done = leap("eval", "--model", str(tiny_model_dir), "--task-dirs", str(tmp_path / "KernelBench" / "KernelBench"),
                "--out", str(tmp_path / "out"), *SMALL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert summary["toolchain"] == "kernelbench" and summary["tasks"] == 1
    assert summary["task_ids"] == ["level1/19_ReLU"]
    refused = leap("eval", "--model", str(tiny_model_dir), "--family", "stencils", "--out", str(tmp_path / "o2"),
                   *SMALL)
    assert refused.returncode == 2 and "not a family this service serves" in refused.stderr, refused.stderr


def processes_with(text: str) -> list[int]:
    """Pids of this user's processes whose environment mentions `text` (a stack's work dir)."""
    import os
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_sigterm_stops_the_stack_a_command_started(tiny_model_dir, tmp_path):
    # `timeout`, a batch scheduler or `kill` ends a command with SIGTERM: the services it
    # started (children in sessions of their own) must go with it, as they do on Ctrl-C.
    import signal
    import time

    process = subprocess.Popen([sys.executable, "-m", "leap", "eval", "--model", str(tiny_model_dir), "--task-families",
                                "rows:60", "--family", "rows", "--split", "heldout", "--samples", "64",
                                "--out", str(tmp_path), "--quiet"],
                               cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stack = str(tmp_path / "stack")
    deadline = time.monotonic() + 600
    while len(processes_with(stack)) < 2 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)  # the policy and the sandbox are starting (their environment names the stack)
    assert process.poll() is None, process.communicate()[0].decode()[-3000:]
    assert len(processes_with(stack)) >= 2
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=300)[0].decode()
    assert process.returncode == 143, output[-3000:]
    deadline = time.monotonic() + 60
    while processes_with(stack) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_with(stack) == [], output[-3000:]
