"""A small task suite in the shape of `leap.tasks.load_suite()` (FULL view), for tests that
must not wait for the built-in suite: elementwise C++ kernels, each with a solution and the
three usual broken variants (a syntax error, a wrong result, an out-of-bounds write)."""

from __future__ import annotations

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2

CPU = common_pb2.Toolchain.TOOLCHAIN_CPU
Kind = sandbox_pb2.ExampleKind
Stage = common_pb2.Stage
Role = sandbox_pb2.ArgumentRole

# id, title, statement, expression of x[i] (the correct one, then a wrong one)
UNARY = [
    ("relu", "ReLU", "y[i] = max(x[i], 0) for i < n.", "x[i] > 0.0f ? x[i] : 0.0f", "x[i]"),
    ("square", "Square", "y[i] = x[i] * x[i] for i < n.", "x[i] * x[i]", "x[i] + x[i]"),
    ("negate", "Negate", "y[i] = -x[i] for i < n.", "-x[i]", "x[i]"),
    ("absolute", "Absolute value", "y[i] = |x[i]| for i < n.", "x[i] < 0.0f ? -x[i] : x[i]", "-x[i]"),
    ("double_it", "Double", "y[i] = 2 * x[i] for i < n.", "2.0f * x[i]", "x[i] * x[i]"),
    ("add_one", "Add one", "y[i] = x[i] + 1 for i < n.", "x[i] + 1.0f", "x[i] - 1.0f"),
]

HEADER = "#include <cstdint>\n\n"


def unary_source(name: str, expression: str, bound: str = "n", semicolon: str = ";") -> str:
    return (
        f"{HEADER}extern \"C\" void {name}(const float* x, float* y, int64_t n) {{\n"
        f"#pragma omp parallel for\n"
        f"    for (int64_t i = 0; i < {bound}; ++i) {{\n"
        f"        y[i] = {expression}{semicolon}\n"
        f"    }}\n"
        f"}}\n"
    )


def tiny_suite() -> list[sandbox_pb2.Task]:
    tasks = []
    for index, (task_id, title, statement, good, bad) in enumerate(UNARY):
        declaration = f'extern "C" void {task_id}(const float* x, float* y, int64_t n);'
        examples = [
            sandbox_pb2.Example(toolchain=CPU, kind=Kind.EXAMPLE_KIND_SOLUTION, source=unary_source(task_id, good),
                                expected_stage=Stage.STAGE_PASSED),
            sandbox_pb2.Example(toolchain=CPU, kind=Kind.EXAMPLE_KIND_SYNTAX_ERROR,
                                source=unary_source(task_id, good, semicolon=""), expected_stage=Stage.STAGE_COMPILE),
            sandbox_pb2.Example(toolchain=CPU, kind=Kind.EXAMPLE_KIND_WRONG_OUTPUT, source=unary_source(task_id, bad),
                                expected_stage=Stage.STAGE_CORRECT),
            sandbox_pb2.Example(toolchain=CPU, kind=Kind.EXAMPLE_KIND_CRASH,
                                source=unary_source(task_id, good, bound="n * 4096"), expected_stage=Stage.STAGE_RUN),
        ]
        tasks.append(sandbox_pb2.Task(
            id=task_id, title=title, statement=statement, category="elementwise",
            entry_point=sandbox_pb2.EntryPoint(name=task_id, c_declaration=declaration, arguments=[
                sandbox_pb2.Argument(name="x", role=Role.ARGUMENT_ROLE_INPUT, dtype=common_pb2.DType.D_TYPE_FLOAT32, shape=["n"]),
                sandbox_pb2.Argument(name="y", role=Role.ARGUMENT_ROLE_OUTPUT, dtype=common_pb2.DType.D_TYPE_FLOAT32, shape=["n"]),
                sandbox_pb2.Argument(name="n", role=Role.ARGUMENT_ROLE_SCALAR, dtype=common_pb2.DType.D_TYPE_INT64),
            ]),
            toolchains=[CPU], split="heldout" if index == len(UNARY) - 1 else "train", examples=examples,
            origin="tests",
        ))
    return tasks
