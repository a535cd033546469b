"""The teacher union: the artifact an RGRPO run leaves behind and a TU-OPD run distils.

It is shared data, not a service's: the trainer's RGRPO writes it, the distiller reads it,
neither imports the other. On disk it is one directory:

    <dir>/union.json
    <dir>/teacher-1/           a Hugging Face model directory per teacher (config.json,
    <dir>/teacher-2/           *.safetensors, tokenizer files), as a checkpoint's model/ is
    ...

union.json (format 1):

    {
      "format": 1,
      "run_id": "20250101-120000-ab12cd",        the RGRPO run that produced it
      "toolchain": "cpu",                         "cpu", "cuda" or "kernelbench"
      "task_ids": ["relu", "softmax", ...],       columns of the quality matrix, unique
      "teachers": [                               rows, in round order, names unique
        {"name": "teacher-1", "round": 1, "model_path": "teacher-1"}, ...
      ],
      "quality": [[0.75, 0.0, ...], ...],         q[k][x]: teacher k's pass rate on task x,
                                                  one row per teacher, one column per task, in [0, 1]
      "samples_per_task": 8,                      k: samples behind each pass rate (>= 1)
      "seed": 0,                                  seed of that evaluation (>= 0)
      "tau": 0.5,                                 coverage threshold: x is covered when some q >= tau
      "coverage_by_round": [0.4, 0.55, ...],      covered share of task_ids after each round, in [0, 1]
      "tokenizer_fingerprint": "9f2c..."          leap.tokenization.tokenizer_fingerprint of the
                                                  teachers' tokenizer (all teachers share one)
    }

`model_path` is relative to <dir> (an absolute path is allowed, for teachers kept
elsewhere). Unknown keys are ignored, so later writers may add some; a different `format`
is refused. `TeacherUnion.read` checks all of the above and that every teacher directory is
a loadable model directory, and raises ValueError saying what is wrong; `write` replaces
union.json atomically (temporary file and rename), so a reader never sees half of one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from leap.common.v1 import common_pb2
from leap.learning.checkpoint import write_json_atomic
from leap.learning.model import check_model_dir
from leap.trainer.v1 import trainer_pb2

FORMAT = 1
UNION_FILE = "union.json"


@dataclasses.dataclass(frozen=True)
class Teacher:
    """One teacher: its name, the RGRPO round that produced it (1-based), its model directory."""

    name: str
    round: int
    model_path: str


def toolchain_enum(name: str) -> int:
    """The `leap.common.v1.Toolchain` value of a toolchain name ("cpu" -> TOOLCHAIN_CPU)."""
    return common_pb2.Toolchain.Value(f"TOOLCHAIN_{name.upper()}")


def toolchain_name(value: int) -> str:
    """The union's name of a `leap.common.v1.Toolchain` value (TOOLCHAIN_CPU -> "cpu")."""
    return common_pb2.Toolchain.Name(value).removeprefix("TOOLCHAIN_").lower()


TOOLCHAINS = tuple(toolchain_name(v) for v in common_pb2.Toolchain.values() if v)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _duplicates(items: Sequence[str]) -> list[str]:
    return sorted(item for item, count in Counter(items).items() if count > 1)


@dataclasses.dataclass(frozen=True)
class TeacherUnion:
    """A teacher union (see the module docstring). Constructing one checks every field
    except the teacher directories (`read` checks those too); lists become tuples."""

    run_id: str
    toolchain: str
    task_ids: tuple[str, ...]
    teachers: tuple[Teacher, ...]
    quality: tuple[tuple[float, ...], ...]
    samples_per_task: int
    seed: int
    tau: float
    coverage_by_round: tuple[float, ...]
    tokenizer_fingerprint: str
    root: str = dataclasses.field(default="", compare=False)  # directory model paths resolve against

    def __post_init__(self) -> None:
        freeze = {
            "task_ids": tuple(self.task_ids),
            "teachers": tuple(t if isinstance(t, Teacher) else Teacher(**t) for t in self.teachers),
            "quality": tuple(tuple(row) for row in self.quality),
            "coverage_by_round": tuple(self.coverage_by_round),
        }
        for name, value in freeze.items():
            object.__setattr__(self, name, value)
        problems = self.problems()
        if problems:
            raise ValueError("invalid teacher union: " + "; ".join(problems))

    # --- checks -------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every problem of the fields, each naming its field; empty when there is none."""
        return [*self._header_problems(), *self._teacher_problems(), *self._quality_problems()]

    def _header_problems(self) -> list[str]:
        out = []
        if not isinstance(self.run_id, str):
            out.append("run_id must be a string")
        if self.toolchain not in TOOLCHAINS:
            out.append(f"toolchain {self.toolchain!r} is not one of {', '.join(TOOLCHAINS)}")
        if not _is_int(self.samples_per_task) or self.samples_per_task < 1:
            out.append(f"samples_per_task must be an integer of at least 1, got {self.samples_per_task!r}")
        if not _is_int(self.seed) or self.seed < 0:
            out.append(f"seed must be a non-negative integer, got {self.seed!r}")
        if not _is_number(self.tau) or not 0 <= self.tau <= 1:
            out.append(f"tau must be in [0, 1], got {self.tau!r}")
        bad = [i for i, c in enumerate(self.coverage_by_round) if not _is_number(c) or not 0 <= c <= 1]
        if bad:
            out.append(f"coverage_by_round[{bad[0]}] must be in [0, 1], got {self.coverage_by_round[bad[0]]!r}")
        if not isinstance(self.tokenizer_fingerprint, str) or not self.tokenizer_fingerprint:
            out.append("tokenizer_fingerprint is required (leap.tokenization.tokenizer_fingerprint of the teachers)")
        return out

    def _teacher_problems(self) -> list[str]:
        out = []
        if not self.teachers:
            out.append("teachers is empty: a union needs at least one teacher")
        for i, teacher in enumerate(self.teachers):
            if not isinstance(teacher.name, str) or not teacher.name:
                out.append(f"teachers[{i}].name is required")
            if not _is_int(teacher.round) or teacher.round < 1:
                out.append(f"teachers[{i}].round must be an integer of at least 1, got {teacher.round!r}")
            if not isinstance(teacher.model_path, str) or not teacher.model_path:
                out.append(f"teachers[{i}].model_path is required")
        if twice := _duplicates([t.name for t in self.teachers]):
            out.append(f"teachers: names must be unique, {', '.join(map(repr, twice))} appear more than once")
        if not self.task_ids:
            out.append("task_ids is empty: a union needs at least one task")
        if any(not isinstance(t, str) or not t for t in self.task_ids):
            out.append("task_ids must be non-empty strings")
        elif twice := _duplicates(self.task_ids):
            out.append(f"task_ids: tasks must be unique, {', '.join(map(repr, twice))} appear more than once")
        return out

    def _quality_problems(self) -> list[str]:
        teachers, tasks = len(self.teachers), len(self.task_ids)
        if len(self.quality) != teachers:
            return [f"quality has {len(self.quality)} rows for {teachers} teachers (one row per teacher)"]
        for k, row in enumerate(self.quality):
            if len(row) != tasks:
                return [f"quality[{k}] (teacher {self.teachers[k].name!r}) has {len(row)} values for {tasks} tasks "
                        f"(one per task_ids entry)"]
            for x, q in enumerate(row):
                if not _is_number(q) or not 0 <= q <= 1:
                    return [f"quality[{k}][{x}] (teacher {self.teachers[k].name!r}, task {self.task_ids[x]!r}) "
                            f"must be a pass rate in [0, 1], got {q!r}"]
        return []

    def teacher_dir_problems(self) -> list[str]:
        """Why each teacher's model directory is not loadable (empty when all are)."""
        out = []
        for i, teacher in enumerate(self.teachers):
            problem = check_model_dir(self.model_dir(teacher))
            if problem:
                out.append(f"teachers[{i}] ({teacher.name!r}): model directory {problem}")
        return out

    # --- reading and writing ------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: Any, root: str | os.PathLike = "") -> TeacherUnion:
        """From the parsed union.json; ValueError naming what is missing or wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"{UNION_FILE} must hold a JSON object, got {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ValueError(f"{UNION_FILE}: format {data.get('format')!r} is not supported (this version reads {FORMAT})")
        names = [f.name for f in dataclasses.fields(cls) if f.name != "root"]
        missing = [name for name in names if name not in data]
        if missing:
            raise ValueError(f"{UNION_FILE}: missing {', '.join(missing)}")
        teachers = data["teachers"]
        if not isinstance(teachers, list) or not all(isinstance(t, dict) for t in teachers):
            raise ValueError(f"{UNION_FILE}: teachers must be a list of objects")
        for i, teacher in enumerate(teachers):
            if absent := [key for key in ("name", "round", "model_path") if key not in teacher]:
                raise ValueError(f"{UNION_FILE}: teachers[{i}] has no {', '.join(absent)}")
        for key in ("task_ids", "quality", "coverage_by_round"):
            if not isinstance(data[key], list):
                raise ValueError(f"{UNION_FILE}: {key} must be a list")
        if not all(isinstance(row, list) for row in data["quality"]):
            raise ValueError(f"{UNION_FILE}: quality must be a list of rows (lists), one per teacher")
        fields = {name: data[name] for name in names}
        fields["teachers"] = [Teacher(t["name"], t["round"], t["model_path"]) for t in teachers]
        return cls(**fields, root=str(root))

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "root"}
        data["teachers"] = [dataclasses.asdict(t) for t in self.teachers]
        data["quality"] = [list(row) for row in self.quality]
        return {"format": FORMAT, **data, "task_ids": list(self.task_ids),
                "coverage_by_round": list(self.coverage_by_round)}

    @classmethod
    def read(cls, path: str | os.PathLike) -> TeacherUnion:
        """The union in directory `path` (or in the union.json file `path`), fully checked;
        ValueError saying what is wrong."""
        path = Path(path)
        directory = path.parent if path.name == UNION_FILE and path.is_file() else path
        file = directory / UNION_FILE
        if not file.is_file():
            raise ValueError(f"{str(directory)!r} holds no {UNION_FILE} (not a teacher union directory)")
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{file}: not readable JSON ({err})") from None
        union = cls.from_json(data, directory.resolve())
        if problems := union.teacher_dir_problems():
            raise ValueError("invalid teacher union: " + "; ".join(problems))
        return union

    def write(self, path: str | os.PathLike) -> Path:
        """Write union.json into directory `path` (created if needed), atomically; returns
        the file. Teacher model directories are the writer's to put there first."""
        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / UNION_FILE
        write_json_atomic(file, self.to_json())
        return file

    # --- accessors ----------------------------------------------------------------------------

    @property
    def teacher_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.teachers)

    def model_dir(self, teacher: Teacher | str) -> Path:
        """A teacher's model directory: its model_path, relative to the union's directory."""
        if isinstance(teacher, str):
            teacher = self.teachers[self.teacher_names.index(teacher)]
        path = Path(teacher.model_path)
        return path if path.is_absolute() else Path(self.root or ".") / path

    def quality_of(self, task_id: str) -> tuple[float, ...]:
        """q[k][task_id] of every teacher, in teacher order; KeyError for a task not in the union."""
        try:
            column = self.task_ids.index(task_id)
        except ValueError:
            raise KeyError(f"task {task_id!r} is not in the union's quality matrix") from None
        return tuple(row[column] for row in self.quality)

    def covered(self, tau: float | None = None) -> list[str]:
        """Tasks some teacher passes with q >= tau (default: the union's tau)."""
        tau = self.tau if tau is None else tau
        return [task for x, task in enumerate(self.task_ids) if max(row[x] for row in self.quality) >= tau]

    def coverage(self, tau: float | None = None) -> float:
        """Share of the union's tasks covered at threshold tau (default: the union's tau)."""
        return len(self.covered(tau)) / len(self.task_ids)

    def toolchain_value(self) -> int:
        return toolchain_enum(self.toolchain)

    def to_proto(self) -> trainer_pb2.TeacherUnion:
        """As `leap.trainer.v1.TeacherUnion`, model paths resolved (the contract has no field
        for the toolchain or the tokenizer fingerprint)."""
        return trainer_pb2.TeacherUnion(
            path=self.root,
            teachers=[trainer_pb2.Teacher(name=t.name, round=t.round, model_path=str(self.model_dir(t)))
                      for t in self.teachers],
            task_ids=self.task_ids,
            quality=[trainer_pb2.QualityRow(teacher=t.name, pass_rates=row) for t, row in zip(self.teachers, self.quality)],
            samples_per_task=self.samples_per_task, seed=self.seed, tau=self.tau,
            coverage_by_round=self.coverage_by_round, run_id=self.run_id,
        )
