"""The task suite: shared data read by the sandbox (to check candidates) and by the model
bootstrap (to warm-start on example solutions and broken variants).

One folder per task under `suite/<task_id>/`:

    task.toml               title, category, split, statement, toolchains, arguments (the entry
                            point's signature), tolerance, size presets, forbidden calls
    reference.py            reference(...)        NumPy reference, dtype-generic: the oracle
                                                  (called on float64 copies of the inputs) and
                                                  the CPU timing baseline (called on the inputs)
                            torch_reference(...)  the same op in PyTorch: the GPU timing baseline
                            inputs(rng, **sizes)  optional seeded input generator (default:
                                                  standard normal floats)
    solutions/cpu.cpp       a correct solution per toolchain
    solutions/cuda.cu
    broken/<kind>.cpp       syntax_error, wrong_output, crash, slow: one per ExampleKind

The entry point is `extern "C" void <id>(inputs..., outputs..., sizes...)`: tensors as
pointers to contiguous row-major buffers, sizes as int64_t, in the order of `arguments`.

Directories of KernelBench-style problems (a Python module per problem with `Model`,
`get_inputs` and `get_init_inputs`) load as tasks of the `kernelbench` toolchain; so do the
rows of a JSONL or Parquet file in KernelBench's dataset layout (`leap.tasks.datasets`). A
problem may declare its tolerance (`ATOL = 1e-3`, `RTOL = 1e-3` at module level).

Public API:
    load_suite(extra_dirs=()) -> list[Task]     every task, FULL view, sorted by id
    get_task(task_id, extra_dirs=()) -> Task    one task (KeyError when missing)
    task_spec(task_id, extra_dirs=()) -> TaskSpec   the runnable side: sizes, inputs, oracle
                                                (of generated tasks too: `leap.tasks.families`)
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib.util
import math
import operator
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from leap.tasks import datasets, families  # neither imports this module

SUITE_DIR = Path(__file__).resolve().parent / "suite"
SPLITS = ("train", "heldout")
Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain
DType = common_pb2.DType
ExampleKind = sandbox_pb2.ExampleKind
Role = sandbox_pb2.ArgumentRole

TOOLCHAIN_NAMES = {"cpu": Toolchain.TOOLCHAIN_CPU, "cuda": Toolchain.TOOLCHAIN_CUDA,
                   "kernelbench": Toolchain.TOOLCHAIN_KERNELBENCH}
ROLE_NAMES = {"input": Role.ARGUMENT_ROLE_INPUT, "output": Role.ARGUMENT_ROLE_OUTPUT,
              "scalar": Role.ARGUMENT_ROLE_SCALAR}
DTYPES = {  # name in task.toml: (proto enum, numpy dtype, C type)
    "float32": (DType.D_TYPE_FLOAT32, np.float32, "float"),
    "float64": (DType.D_TYPE_FLOAT64, np.float64, "double"),
    "int32": (DType.D_TYPE_INT32, np.int32, "int32_t"),
    "int64": (DType.D_TYPE_INT64, np.int64, "int64_t"),
}
NUMPY_DTYPE = {proto: np_dtype for proto, np_dtype, _ in DTYPES.values()}
C_TYPE = {proto: c_type for proto, _, c_type in DTYPES.values()}

# Example files of a task folder: path, toolchain, kind, the stage its evaluation stops at.
EXAMPLE_FILES = [
    ("solutions/cpu.cpp", Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_SOLUTION, Stage.STAGE_PASSED),
    ("solutions/cuda.cu", Toolchain.TOOLCHAIN_CUDA, ExampleKind.EXAMPLE_KIND_SOLUTION, Stage.STAGE_PASSED),
    ("broken/syntax_error.cpp", Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_SYNTAX_ERROR, Stage.STAGE_COMPILE),
    ("broken/wrong_output.cpp", Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_WRONG_OUTPUT, Stage.STAGE_CORRECT),
    ("broken/crash.cpp", Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_CRASH, Stage.STAGE_RUN),
    ("broken/slow.cpp", Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_SLOW, Stage.STAGE_PASSED),
]
KERNELBENCH_TOLERANCE = (1e-2, 1e-2)  # KernelBench's own atol and rtol
KERNELBENCH_SIZE = "default"


class TaskError(ValueError):
    """A task folder or KernelBench file that cannot be loaded, naming the file and why."""


# --------------------------------------------------------------------------------------
# Shape expressions: ["m", "n - kw + 1"] evaluated over the scalar sizes.

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def eval_shape(expression: str, sizes: Mapping[str, int]) -> int:
    """Value of a shape expression: integers, size names, + - * // and parentheses only."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in sizes:
                raise KeyError(f"unknown size {node.id!r} in shape {expression!r}")
            return int(sizes[node.id])
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"unsupported shape expression {expression!r}")

    return value(ast.parse(expression, mode="eval"))


def shape_of(argument: sandbox_pb2.Argument, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(eval_shape(expr, sizes) for expr in argument.shape)


def c_declaration(name: str, arguments: Sequence[sandbox_pb2.Argument]) -> str:
    parts = []
    for arg in arguments:
        if arg.role == Role.ARGUMENT_ROLE_SCALAR:
            parts.append(f"int64_t {arg.name}")
        elif arg.role == Role.ARGUMENT_ROLE_INPUT:
            parts.append(f"const {C_TYPE[arg.dtype]}* {arg.name}")
        else:
            parts.append(f"{C_TYPE[arg.dtype]}* {arg.name}")
    return f'extern "C" void {name}({", ".join(parts)});'


# --------------------------------------------------------------------------------------
# Built-in task folders.


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise TaskError(f"{path}: {err}") from None


def _argument(path: Path, raw: Mapping[str, Any]) -> sandbox_pb2.Argument:
    role = raw.get("role", "")
    if role not in ROLE_NAMES:
        raise TaskError(f"{path}: argument {raw.get('name')!r} has role {role!r}; expected one of {sorted(ROLE_NAMES)}")
    dtype = "int64" if role == "scalar" else raw.get("dtype", "float32")
    if dtype not in DTYPES:
        raise TaskError(f"{path}: argument {raw.get('name')!r} has dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    shape = [] if role == "scalar" else [str(s) for s in raw.get("shape", [])]
    if role != "scalar" and not shape:
        raise TaskError(f"{path}: tensor argument {raw.get('name')!r} needs a shape")
    return sandbox_pb2.Argument(name=str(raw["name"]), role=ROLE_NAMES[role], dtype=DTYPES[dtype][0], shape=shape,
                                description=str(raw.get("description", "")))


def _task_from_folder(folder: Path) -> sandbox_pb2.Task:
    path = folder / "task.toml"
    meta = _read_toml(path)
    task_id = folder.name
    arguments = [_argument(path, raw) for raw in meta.get("arguments", [])]
    if not arguments:
        raise TaskError(f"{path}: no arguments")
    scalars = {a.name for a in arguments if a.role == Role.ARGUMENT_ROLE_SCALAR}
    sizes = []
    for name, values in meta.get("sizes", {}).items():
        if set(values) != scalars:
            raise TaskError(f"{path}: size preset {name!r} sets {sorted(values)}, the scalars are {sorted(scalars)}")
        sizes.append(sandbox_pb2.SizePreset(name=name, values={k: int(v) for k, v in values.items()}))
        for arg in arguments:
            try:
                if any(dim <= 0 for dim in shape_of(arg, values)):
                    raise TaskError(f"{path}: argument {arg.name!r} is empty in size preset {name!r}")
            except (KeyError, ValueError, SyntaxError) as err:
                raise TaskError(f"{path}: argument {arg.name!r}: {err}") from None
    if not sizes:
        raise TaskError(f"{path}: no size presets")
    split = meta.get("split", "train")
    if split not in SPLITS:
        raise TaskError(f"{path}: split {split!r}; expected one of {SPLITS}")
    toolchains = meta.get("toolchains", ["cpu", "cuda"])
    unknown = [t for t in toolchains if t not in TOOLCHAIN_NAMES]
    if unknown:
        raise TaskError(f"{path}: unknown toolchains {unknown}")
    tolerance = meta.get("tolerance", {})
    entry = str(meta.get("entry", task_id))
    reference = folder / "reference.py"
    if not reference.is_file():
        raise TaskError(f"{folder}: reference.py is missing")
    task = sandbox_pb2.Task(
        id=task_id,
        title=str(meta.get("title", task_id)),
        statement=str(meta.get("statement", "")).strip(),
        category=str(meta.get("category", "")),
        entry_point=sandbox_pb2.EntryPoint(name=entry, arguments=arguments, c_declaration=c_declaration(entry, arguments)),
        toolchains=[TOOLCHAIN_NAMES[t] for t in toolchains],
        tolerance=sandbox_pb2.Tolerance(atol=float(tolerance.get("atol", 1e-5)), rtol=float(tolerance.get("rtol", 1e-5))),
        sizes=sizes,
        split=split,
        reference_source=reference.read_text(),
        origin="builtin",
        forbidden_calls=[str(c) for c in meta.get("forbidden_calls", [])],
    )
    for relative, toolchain, kind, stage in EXAMPLE_FILES:
        file = folder / relative
        if file.is_file():
            task.examples.append(sandbox_pb2.Example(toolchain=toolchain, kind=kind, source=file.read_text(),
                                                     expected_stage=stage))
    return task


@functools.lru_cache(maxsize=1)
def _builtin() -> tuple[sandbox_pb2.Task, ...]:
    folders = sorted(p for p in SUITE_DIR.iterdir() if (p / "task.toml").is_file())
    return tuple(_task_from_folder(folder) for folder in folders)


# --------------------------------------------------------------------------------------
# KernelBench-style directories.


def _slug(text: str) -> str:
    return re.sub(r"_+", "_", re.sub(r"[^a-z0-9]+", "_", text.lower())).strip("_")


def _is_kernelbench_module(tree: ast.Module) -> bool:
    names = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    return {"Model", "get_inputs", "get_init_inputs"} <= names


def _declared_tolerance(tree: ast.Module) -> tuple[float, float]:
    """A problem's own `ATOL = ...` and `RTOL = ...` (number literals at module level, as a
    dataset row's atol and rtol are written), else KernelBench's tolerance."""
    declared = dict(zip(("ATOL", "RTOL"), KERNELBENCH_TOLERANCE))
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and node.targets[0].id in declared and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, (int, float)) and not isinstance(node.value.value, bool) \
                and math.isfinite(node.value.value) and node.value.value >= 0:
            declared[node.targets[0].id] = float(node.value.value)
    return declared["ATOL"], declared["RTOL"]


@functools.lru_cache(maxsize=1024)
def _kernelbench_task(root: Path, file: Path, _mtime_ns: int, _size: int) -> sandbox_pb2.Task | None:
    """The task of one problem file (None when it is not one); cached until the file changes."""
    source = file.read_text()
    try:
        tree = ast.parse(source, filename=str(file))
    except SyntaxError as err:
        raise TaskError(f"{file}: {err}") from None
    if not _is_kernelbench_module(tree):
        return None
    relative = file.relative_to(root).with_suffix("")
    if families.core.parse_id(relative.as_posix()) is not None:
        raise TaskError(f"{file}: its id {relative.as_posix()!r} would read as a generated task's (fam.*); rename it")
    model = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Model")
    doc = (ast.get_docstring(model) or "").strip()
    statement = (doc + "\n" if doc else "") + "Write ModelNew, a faster drop-in replacement of Model with the same outputs."
    atol, rtol = _declared_tolerance(tree)
    return sandbox_pb2.Task(
        id=relative.as_posix(),  # the file's own path, as KernelBench names its problems: level1/19_ReLU
        title=relative.name,
        statement=statement,
        category=_slug(relative.parent.name) if relative.parent.name else "kernelbench",
        entry_point=sandbox_pb2.EntryPoint(name="ModelNew"),
        toolchains=[Toolchain.TOOLCHAIN_KERNELBENCH],
        tolerance=sandbox_pb2.Tolerance(atol=atol, rtol=rtol),
        sizes=[sandbox_pb2.SizePreset(name=KERNELBENCH_SIZE)],
        split="train",
        reference_source=source,
        origin=str(root),
    )


def _kernelbench_dir(root: str) -> tuple[tuple[sandbox_pb2.Task, str], ...]:
    """The problems of a directory, read again when files are added or changed. A checkout of
    the KernelBench repository (a `KernelBench/` folder of `level*/` folders beside its
    sources) means its problems folder: its prompt examples and scripts are not problems."""
    base = Path(root)
    if not base.is_dir():
        raise TaskError(f"{root}: not a directory")
    if (base / "KernelBench").is_dir() and any(p.is_dir() for p in (base / "KernelBench").glob("level*")):
        base = base / "KernelBench"
    found = []
    for file in sorted(base.rglob("*.py")):
        stat = file.stat()
        task = _kernelbench_task(base, file, stat.st_mtime_ns, stat.st_size)
        if task is not None:
            found.append((task, str(file)))
    return tuple(found)


# --------------------------------------------------------------------------------------
# Public API.


def _all(extra_dirs: Sequence[str | Path]) -> dict[str, tuple[sandbox_pb2.Task, str]]:
    tasks: dict[str, tuple[sandbox_pb2.Task, str]] = {t.id: (t, str(SUITE_DIR / t.id)) for t in _builtin()}
    for directory in extra_dirs:
        try:
            root = datasets.as_directory(directory)  # a JSONL or Parquet file: its rows as a directory
        except (datasets.DatasetError, OSError) as err:
            raise TaskError(str(err)) from None
        for task, file in _kernelbench_dir(root):
            if root != str(Path(directory).resolve()):  # a dataset's task names its file, not the copy
                task = _copy(task)
                task.origin = str(Path(directory).resolve())
            if task.id in tasks:
                raise TaskError(f"{file}: task id {task.id!r} is already taken by {tasks[task.id][1]}")
            tasks[task.id] = (task, file)
    return tasks


def _copy(task: sandbox_pb2.Task) -> sandbox_pb2.Task:
    copy = sandbox_pb2.Task()
    copy.CopyFrom(task)
    return copy


def load_suite(extra_dirs: Sequence[str | Path] = ()) -> list[sandbox_pb2.Task]:
    """Every built-in task plus the tasks of KernelBench-style `extra_dirs`, FULL view (with
    examples), sorted by id. The protos are fresh copies: callers may modify them."""
    return [_copy(task) for task, _ in sorted(_all(extra_dirs).values(), key=lambda item: item[0].id)]


def get_task(task_id: str, extra_dirs: Sequence[str | Path] = ()) -> sandbox_pb2.Task:
    """One task, FULL view. Raises KeyError when no task has this id."""
    tasks = _all(extra_dirs)
    if task_id not in tasks:
        raise KeyError(task_id)
    return _copy(tasks[task_id][0])


def basic_view(task: sandbox_pb2.Task) -> sandbox_pb2.Task:
    """The task without its examples (TASK_VIEW_BASIC)."""
    copy = _copy(task)
    del copy.examples[:]
    return copy


def examples(task: sandbox_pb2.Task, toolchain: int | None = None, kind: int | None = None) -> list[sandbox_pb2.Example]:
    """The task's examples, optionally only of one toolchain and/or kind."""
    return [e for e in task.examples if (toolchain is None or e.toolchain == toolchain) and (kind is None or e.kind == kind)]


# --------------------------------------------------------------------------------------
# The runnable side of a task.


def _load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TaskError(f"{path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stable_seed(*parts: object) -> list[int]:
    """Entropy for numpy's SeedSequence that is the same in every process (unlike hash())."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What it takes to run a built-in task: sizes, seeded inputs and the reference."""

    task: sandbox_pb2.Task
    directory: Path | None  # the suite folder; None for a generated task (its reference is its source)
    reference: Callable[..., Any]
    torch_reference: Callable[..., Any] | None
    make_inputs: Callable[..., Mapping[str, np.ndarray]] | None

    @property
    def reference_path(self) -> Path:
        if self.directory is None:
            raise TaskError(f"{self.task.id} is generated: its reference is task.reference_source, not a file")
        return self.directory / "reference.py"

    @property
    def reference_origin(self) -> str:
        """Where the reference comes from, for messages."""
        return str(self.reference_path) if self.directory is not None else f"the reference of {self.task.id}"

    def preset(self, name: str) -> dict[str, int]:
        for preset in self.task.sizes:
            if preset.name == name:
                return dict(preset.values)
        raise KeyError(name)

    def arguments(self, role: int) -> list[sandbox_pb2.Argument]:
        return [a for a in self.task.entry_point.arguments if a.role == role]

    def inputs(self, sizes: Mapping[str, int], seed: int, trial: int) -> dict[str, np.ndarray]:
        """Input tensors of one correctness trial: the same in every process for the same
        (task, sizes, seed, trial), fresh for every trial."""
        rng = np.random.default_rng(stable_seed(self.task.id, sorted(sizes.items()), seed, trial))
        made = dict(self.make_inputs(rng, **sizes)) if self.make_inputs else {}
        result = {}
        for arg in self.arguments(Role.ARGUMENT_ROLE_INPUT):
            shape = shape_of(arg, sizes)
            dtype = NUMPY_DTYPE[arg.dtype]
            if arg.name in made:
                array = np.ascontiguousarray(made[arg.name], dtype=dtype)
                if array.shape != shape:
                    raise TaskError(f"{self.reference_origin}: inputs() made {arg.name} of shape {array.shape}, "
                                    f"the task says {shape}")
            else:
                array = rng.standard_normal(shape).astype(dtype)
            result[arg.name] = array
        return result

    def call_reference(self, inputs: Mapping[str, np.ndarray], sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """The reference's outputs by name (as it computes them, in the inputs' precision)."""
        kwargs = {a.name: (inputs[a.name] if a.role == Role.ARGUMENT_ROLE_INPUT else int(sizes[a.name]))
                  for a in self.task.entry_point.arguments if a.role != Role.ARGUMENT_ROLE_OUTPUT}
        result = self.reference(**kwargs)
        outputs = self.arguments(Role.ARGUMENT_ROLE_OUTPUT)
        values = result if isinstance(result, tuple) else (result,)
        if len(values) != len(outputs):
            raise TaskError(f"{self.reference_origin}: reference returned {len(values)} outputs, the task has {len(outputs)}")
        return {arg.name: np.asarray(value) for arg, value in zip(outputs, values)}

    def expected(self, inputs: Mapping[str, np.ndarray], sizes: Mapping[str, int]) -> dict[str, np.ndarray]:
        """The oracle: the reference on float64 copies of floating inputs, with each output's
        shape checked against the signature."""
        precise = {k: (v.astype(np.float64) if np.issubdtype(v.dtype, np.floating) else v) for k, v in inputs.items()}
        outputs = self.call_reference(precise, sizes)
        for arg in self.arguments(Role.ARGUMENT_ROLE_OUTPUT):
            want = shape_of(arg, sizes)
            if outputs[arg.name].shape != want:
                raise TaskError(f"{self.reference_origin}: output {arg.name} has shape {outputs[arg.name].shape}, "
                                f"the task says {want}")
        return outputs


@functools.lru_cache(maxsize=256)
def _spec(task_id: str, directory: str) -> TaskSpec:
    task = next(t for t in _builtin() if t.id == task_id)
    folder = Path(directory)
    module = _load_module(folder / "reference.py", f"leap_task_{task_id}")
    if not callable(getattr(module, "reference", None)):
        raise TaskError(f"{folder / 'reference.py'}: defines no reference()")
    return TaskSpec(task=task, directory=folder, reference=module.reference,
                    torch_reference=getattr(module, "torch_reference", None),
                    make_inputs=getattr(module, "inputs", None))


@functools.lru_cache(maxsize=4096)
def _family_spec(task_id: str) -> TaskSpec:
    task = families.task_from_id(task_id)  # KeyError when the id names no generated task
    module = ModuleType(f"leap_task_{task_id.replace('.', '_')}")
    exec(compile(task.reference_source, f"<{task_id}/reference.py>", "exec"), module.__dict__)  # our own generated code
    return TaskSpec(task=task, directory=None, reference=module.reference,
                    torch_reference=getattr(module, "torch_reference", None), make_inputs=None)


def task_spec(task_id: str, extra_dirs: Sequence[str | Path] = ()) -> TaskSpec:
    """The runnable side of a built-in or generated task (`leap.tasks.families`; KeyError when
    missing; KernelBench tasks have no TaskSpec: their module is the reference, see
    `kernelbench_file`)."""
    if families.core.parse_id(task_id) is not None:
        return _family_spec(task_id)
    tasks = _all(extra_dirs)
    if task_id not in tasks or tasks[task_id][0].origin != "builtin":
        raise KeyError(task_id)
    return _spec(task_id, tasks[task_id][1])


def kernelbench_file(task_id: str, extra_dirs: Sequence[str | Path] = ()) -> Path:
    """The Python file of a KernelBench task (KeyError when missing)."""
    tasks = _all(extra_dirs)
    if task_id not in tasks or tasks[task_id][0].origin == "builtin":
        raise KeyError(task_id)
    return Path(tasks[task_id][1])


__all__ = [
    "SPLITS",
    "SUITE_DIR",
    "TaskError",
    "TaskSpec",
    "basic_view",
    "c_declaration",
    "eval_shape",
    "examples",
    "get_task",
    "kernelbench_file",
    "load_suite",
    "shape_of",
    "stable_seed",
    "task_spec",
]
