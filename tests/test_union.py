"""The teacher union artifact (leap.union): written and read back, every kind of bad file
refused with what is wrong named, and the coverage and quality accessors."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest

from leap.common.v1 import common_pb2
from leap.union import UNION_FILE, Teacher, TeacherUnion
from tests.tiny_lm import build_tiny_model

TASKS = ("relu", "softmax", "gemm")
QUALITY = ((0.75, 0.0, 0.25), (0.5, 0.625, 0.0))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_union(**changes) -> TeacherUnion:
    fields = dict(run_id="rgrpo-1", toolchain="cpu", task_ids=TASKS,
                  teachers=(Teacher("teacher-1", 1, "teacher-1"), Teacher("teacher-2", 2, "teacher-2")),
                  quality=QUALITY, samples_per_task=8, seed=3, tau=0.5, coverage_by_round=(0.333, 0.667),
                  tokenizer_fingerprint="f" * 64)
    return TeacherUnion(**{**fields, **changes})


@pytest.fixture
def union_dir(tmp_path, tiny_model):
    """A complete artifact: union.json and two teacher model directories."""
    for name in ("teacher-1", "teacher-2"):
        shutil.copytree(tiny_model, tmp_path / name)
    make_union().write(tmp_path)
    return tmp_path


def rewrite(directory, **changes) -> None:
    """Edit union.json in place, as a hand-edited or damaged file would be."""
    file = directory / UNION_FILE
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data))


def test_a_written_union_reads_back_equal_with_model_paths_resolved(union_dir):
    union = TeacherUnion.read(union_dir)
    assert union == make_union()
    assert union.model_dir("teacher-2") == union_dir.resolve() / "teacher-2"
    assert TeacherUnion.read(union_dir / UNION_FILE) == union  # the file itself names it too


def test_an_absolute_model_path_is_kept(union_dir, tiny_model):
    teachers = (Teacher("teacher-1", 1, "teacher-1"), Teacher("teacher-2", 2, str(tiny_model)))
    make_union(teachers=teachers).write(union_dir)
    assert TeacherUnion.read(union_dir).model_dir("teacher-2") == tiny_model


def test_write_replaces_the_file_whole_and_leaves_no_temporary_file(union_dir):
    make_union(tau=0.75).write(union_dir)
    assert TeacherUnion.read(union_dir).tau == 0.75
    assert sorted(p.name for p in union_dir.iterdir()) == ["teacher-1", "teacher-2", UNION_FILE]


def test_a_directory_without_union_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no union.json"):
        TeacherUnion.read(tmp_path)


def test_a_teacher_directory_that_is_not_a_model_is_refused_by_name(union_dir):
    shutil.rmtree(union_dir / "teacher-2")
    with pytest.raises(ValueError, match=r"teachers\[1\] \('teacher-2'\): model directory .* not a directory"):
        TeacherUnion.read(union_dir)
    (union_dir / "teacher-2").mkdir()
    with pytest.raises(ValueError, match="teacher-2.*no config.json"):
        TeacherUnion.read(union_dir)


@pytest.mark.parametrize("changes, words", [
    (dict(quality=[[0.75, 0.0, 0.25]]), "quality has 1 rows for 2 teachers"),
    (dict(quality=[[0.75, 0.0], [0.5, 0.625]]), "quality[0] (teacher 'teacher-1') has 2 values for 3 tasks"),
    (dict(quality=[[0.75, 0.0, 0.25], [0.5, 1.5, 0.0]]), "quality[1][1] (teacher 'teacher-2', task 'softmax') must be a pass rate in [0, 1], got 1.5"),
    (dict(quality=[[0.75, -0.1, 0.25], [0.5, 0.6, 0.0]]), "got -0.1"),
    (dict(quality=[[0.75, "high", 0.25], [0.5, 0.6, 0.0]]), "got 'high'"),
    (dict(task_ids=["relu", "softmax", "relu"]), "'relu' appear more than once"),
    (dict(teachers=[{"name": "teacher-1", "round": 1, "model_path": "teacher-1"},
                    {"name": "teacher-1", "round": 2, "model_path": "teacher-2"}]), "names must be unique, 'teacher-1'"),
    (dict(teachers=[{"name": "teacher-1", "round": 1, "model_path": "teacher-1"}, {"name": "teacher-2", "round": 2}]),
     "teachers[1] has no model_path"),
    (dict(format=2), "format 2 is not supported"),
    (dict(toolchain="fortran"), "toolchain 'fortran' is not one of cpu, cuda, kernelbench"),
    (dict(samples_per_task=0), "samples_per_task must be an integer of at least 1"),
    (dict(tau=1.2), "tau must be in [0, 1]"),
    (dict(coverage_by_round=[0.3, 2.0]), "coverage_by_round[1] must be in [0, 1]"),
    (dict(tokenizer_fingerprint=""), "tokenizer_fingerprint is required"),
])
def test_a_bad_union_json_is_refused_saying_what_is_wrong(union_dir, changes, words):
    rewrite(union_dir, **changes)
    with pytest.raises(ValueError) as caught:
        TeacherUnion.read(union_dir)
    assert words in str(caught.value)


def test_missing_keys_are_named(union_dir):
    data = json.loads((union_dir / UNION_FILE).read_text())
    del data["quality"], data["seed"]
    (union_dir / UNION_FILE).write_text(json.dumps(data))
    with pytest.raises(ValueError, match="missing quality, seed"):
        TeacherUnion.read(union_dir)


def test_a_nan_pass_rate_is_refused_when_built_in_python():
    with pytest.raises(ValueError, match=r"quality\[0\]\[2\]"):
        make_union(quality=((0.75, 0.0, math.nan), (0.5, 0.625, 0.0)))


def test_every_problem_is_reported_at_once():
    with pytest.raises(ValueError) as caught:
        make_union(tau=-1, seed=-2, quality=((0.5,),))
    assert all(words in str(caught.value) for words in ("tau", "seed", "quality has 1 rows"))


def test_quality_of_a_task_is_its_column_in_teacher_order():
    union = make_union()
    assert union.quality_of("softmax") == (0.0, 0.625)
    with pytest.raises(KeyError, match="'conv2d' is not in the union"):
        union.quality_of("conv2d")


def test_coverage_is_the_share_of_tasks_some_teacher_reaches():
    union = make_union()
    assert union.covered() == ["relu", "softmax"] and union.coverage() == pytest.approx(2 / 3)
    assert union.coverage(0.25) == 1.0 and union.coverage(0.7) == pytest.approx(1 / 3) and union.coverage(0.9) == 0.0


def test_to_proto_carries_every_field_with_model_paths_resolved(union_dir):
    union = TeacherUnion.read(union_dir)
    proto = union.to_proto()
    assert proto.path == str(union_dir.resolve()) and proto.run_id == "rgrpo-1"
    assert [(t.name, t.round, t.model_path) for t in proto.teachers] == [
        ("teacher-1", 1, str(union_dir.resolve() / "teacher-1")), ("teacher-2", 2, str(union_dir.resolve() / "teacher-2"))]
    assert list(proto.task_ids) == list(TASKS)
    assert [(row.teacher, tuple(row.pass_rates)) for row in proto.quality] == [
        ("teacher-1", QUALITY[0]), ("teacher-2", QUALITY[1])]
    assert (proto.samples_per_task, proto.seed, proto.tau) == (8, 3, 0.5)
    assert list(proto.coverage_by_round) == pytest.approx([0.333, 0.667])
    assert union.toolchain_value() == common_pb2.Toolchain.TOOLCHAIN_CPU


def test_the_union_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_union().tau = 0.1  # type: ignore[misc]
