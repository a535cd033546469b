"""Tasks from a JSONL or Parquet file in KernelBench's dataset layout (one row per problem:
code, name, level, problem_id; optional inputs, atol, rtol): the rows load as the same tasks
their files would as a directory, a bad row stops the load naming the row and the field, and
a real sandbox serves a file's problems, judging with the row's own tolerance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leap import tasks
from leap.sandbox.v1 import sandbox_pb2
from leap.tasks import datasets
from tests.sandbox_helpers import KERNELBENCH, Stage, describe, running_sandbox
from tests.test_sandbox_kernelbench import MODEL_NEW, PROBLEM

pytest.importorskip("torch")

MODEL, INPUTS = PROBLEM.split("batch, features = 32, 64")
INPUTS = "batch, features = 32, 64" + INPUTS
LOOSE = MODEL_NEW.replace("torch.clamp_min(x * self.scale, 0.0)", "torch.clamp_min(x * self.scale, 0.1)")


def dataset_rows() -> list[dict]:
    return [
        {"code": PROBLEM, "name": "7_Scale_relu", "level": 1, "problem_id": 7},
        # inputs kept apart from the model, and a tolerance of its own
        {"code": MODEL, "inputs": INPUTS, "name": "8_Loose_relu", "level": 2, "problem_id": 8, "atol": 0.2,
         "rtol": 0.0},
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(autouse=True)
def private_dataset_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LEAP_DATASET_DIR", str(tmp_path / "materialized"))


def test_jsonl_rows_are_the_tasks_their_files_would_be(tmp_path):
    file = write_jsonl(tmp_path / "problems.jsonl", dataset_rows())
    as_dir = tmp_path / "as-dir"
    for row in dataset_rows():
        relative, source = datasets.module_source(row, "row")
        (as_dir / f"{relative}.py").parent.mkdir(parents=True, exist_ok=True)
        (as_dir / f"{relative}.py").write_text(source)
    from_file = {t.id: t for t in tasks.load_suite([file]) if t.origin != "builtin"}
    from_dir = {t.id: t for t in tasks.load_suite([as_dir]) if t.origin != "builtin"}
    assert len(from_file) == 2 and sorted(from_file) == sorted(from_dir)
    for task_id, task in from_file.items():
        assert list(task.toolchains) == [KERNELBENCH]
        assert task.reference_source == from_dir[task_id].reference_source
    tolerances = {t.title: (t.tolerance.atol, t.tolerance.rtol) for t in from_file.values()}
    assert tolerances == {"7_Scale_relu": tasks.KERNELBENCH_TOLERANCE, "8_Loose_relu": (0.2, 0.0)}
    assert tasks.load_suite([file]) == tasks.load_suite([file])  # materialized once, read again the same


def test_parquet_rows_are_the_same_tasks_as_jsonl(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    rows = dataset_rows()
    columns = {key: [row.get(key) for row in rows] for key in ("code", "inputs", "name", "level", "problem_id",
                                                                "atol", "rtol")}
    pq.write_table(pa.table(columns), tmp_path / "problems.parquet")
    jsonl = write_jsonl(tmp_path / "problems.jsonl", rows)
    def without_origin(task):
        task.origin = ""
        return task

    parquet = {t.id: without_origin(t) for t in tasks.load_suite([tmp_path / "problems.parquet"])}
    assert len(parquet) == len(tasks.load_suite()) + 2
    assert parquet == {t.id: without_origin(t) for t in tasks.load_suite([jsonl])}


@pytest.mark.parametrize("row, field", [
    ({"name": "a"}, "code"),
    ({"code": PROBLEM, "name": "../escape"}, "name"),
    ({"code": PROBLEM}, "name"),
    ({"code": PROBLEM, "name": "a", "level": "one"}, "level"),
    ({"code": PROBLEM, "name": "a", "atol": -1}, "atol"),
    ({"code": PROBLEM, "name": "a", "inputs": 3}, "inputs"),
])
def test_a_bad_row_stops_the_load_naming_the_row_and_the_field(tmp_path, row, field):
    file = write_jsonl(tmp_path / "bad.jsonl", [dataset_rows()[0], row])
    with pytest.raises(tasks.TaskError, match=rf"bad\.jsonl: row 2: {field}"):
        tasks.load_suite([file])


def test_a_line_that_is_not_json_and_a_repeated_name_are_refused(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(dataset_rows()[0]) + "\n{not json\n")
    with pytest.raises(tasks.TaskError, match=r"broken\.jsonl:2: not a JSON object"):
        tasks.load_suite([broken])
    twice = write_jsonl(tmp_path / "twice.jsonl", [dataset_rows()[0], dataset_rows()[0]])
    with pytest.raises(tasks.TaskError, match="row 2: name 'level1/7_Scale_relu' is already row 1's"):
        tasks.load_suite([twice])


def test_a_sandbox_serves_a_dataset_file_and_judges_with_each_rows_tolerance(tmp_path):
    file = write_jsonl(tmp_path / "problems.jsonl", dataset_rows())
    with running_sandbox(tmp_path / "sb", workers=1, task_dirs=[str(file)]) as sandbox:
        reply = sandbox.stub.ListTasks(sandbox_pb2.ListTasksRequest(toolchain=KERNELBENCH), timeout=10)
        listed = {t.title: t.id for t in reply.tasks}
        assert set(listed) == {"7_Scale_relu", "8_Loose_relu"}
        exact = sandbox.evaluate(listed["7_Scale_relu"], MODEL_NEW, KERNELBENCH, timing=False)
        assert exact.stage == Stage.STAGE_PASSED, describe(exact)
        # Off by up to 0.1: wrong under KernelBench's 1e-2, right under the row's atol 0.2.
        strict = sandbox.evaluate(listed["7_Scale_relu"], LOOSE, KERNELBENCH, timing=False)
        assert strict.stage == Stage.STAGE_CORRECT, describe(strict)
        loose = sandbox.evaluate(listed["8_Loose_relu"], LOOSE, KERNELBENCH, timing=False)
        assert loose.stage == Stage.STAGE_PASSED, describe(loose)
