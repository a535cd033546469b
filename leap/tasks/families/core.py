"""What every task family shares: the structure space, the id, the split rule, and rendering
one structure into a task (its NumPy and PyTorch reference, its cpu and cuda solutions and
its broken variants), all pure functions of (family, seed, index).

A family module describes its tasks as a finite *structure space*: `size` structures,
numbered 0..size-1 (a mixed-radix number over the family's choices), and `build(number,
rng)` returns the `Blueprint` of one: its pieces, its signature, the C body that computes
one output index `i`, a wrong body, the reference's lines and its difficulty tier. The
sizes of a task (never part of its structure) come from `rng`, seeded by the task's id.

Index i of seed s is structure `permute(i, s, size)`: a bijection of [0, size) chosen by
the seed (a small Feistel network, cycle-walked), so the tasks of one seed are distinct and
every seed draws a different mix of them.

The split is a function of the structure alone: a task is held out when its `combos` (the
pairs of pieces it puts together, each a tuple) meet the family's `HELDOUT` set; training
then never sees a held-out pair together, though it sees each of its pieces in other tasks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Iterable, Sequence

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2

Stage = common_pb2.Stage
Toolchain = common_pb2.Toolchain
ExampleKind = sandbox_pb2.ExampleKind
Role = sandbox_pb2.ArgumentRole
FLOAT32 = common_pb2.DType.D_TYPE_FLOAT32
HEADER = "#include <math.h>\n#include <stdint.h>\n"  # the sandbox precompiles exactly these lines
ID_PREFIX = "fam"
TIERS = (1, 2, 3)
BLAS = ["cblas_sgemm", "sgemm_", "cblas_sgemv", "sgemv_", "cublasSgemm", "cublasSgemm_v2", "cublasGemmEx",
        "cublasSgemmStridedBatched", "cublasGemmStridedBatchedEx", "cublasLtMatmul", "cublasSgemv"]
MASK64 = (1 << 64) - 1


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of the entry point: a float32 tensor (input or output) or a size."""

    name: str
    role: str  # "input", "output" or "scalar"
    shape: tuple[str, ...] = ()  # shape expressions over the scalars (tensors only)
    description: str = ""


@dataclasses.dataclass(frozen=True)
class Blueprint:
    """One structure of a family, ready to render."""

    pieces: dict[str, str]  # the structure, named piece by piece (readable; the split's input)
    combos: tuple[tuple[str, ...], ...]  # pairs of pieces the task puts together
    title: str
    statement: str
    category: str
    arguments: tuple[Arg, ...]
    sizes: dict[str, dict[str, int]]  # preset name -> scalar values
    count: str  # C expression: how many indices i the kernel computes (one thread each on a GPU)
    body: tuple[str, ...]  # C lines computing index i (locals of type float, output writes)
    wrong_body: tuple[str, ...]  # the same with one plausible mistake that changes the outputs
    numpy: tuple[str, ...]  # lines of reference(): NumPy, dtype-generic, ending in `return`
    torch: tuple[str, ...]  # lines of torch_reference(), ending in `return`
    tier: int
    atol: float = 1e-4
    rtol: float = 1e-4
    forbidden_calls: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------
# Numbers: the seed's permutation and the sizes' generator.


def _mix(value: int) -> int:
    """splitmix64's finalizer: a fast, well-mixed 64-bit hash."""
    value = (value + 0x9E3779B97F4A7C15) & MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def _seed_key(family: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{family}\x1f{seed}".encode()).digest()[:8], "little")


def permute(index: int, key: int, size: int) -> int:
    """A bijection of [0, size) chosen by `key`: a 4-round Feistel network over the smallest
    even number of bits that covers `size`, walked until it lands inside."""
    if not 0 <= index < size:
        raise IndexError(f"index {index} outside [0, {size})")
    half = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    value = index
    while True:
        left, right = value >> half, value & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(key ^ (round_ << 56) ^ right) & mask)
        value = (left << half) | right
        if value < size:
            return value


def task_rng(family: str, seed: int, index: int) -> random.Random:
    """The generator of a task's sizes (and nothing of its structure)."""
    return random.Random(f"{family}:{seed}:{index}")


def digits(number: int, radices: Sequence[int]) -> list[int]:
    """`number` in the mixed radix `radices` (first digit least significant)."""
    out = []
    for radix in radices:
        number, digit = divmod(number, radix)
        out.append(digit)
    if number:
        raise IndexError("structure number out of range")
    return out


def product(values: Iterable[int]) -> int:
    total = 1
    for value in values:
        total *= value
    return total


# --------------------------------------------------------------------------------------
# Ids.


def task_id(family: str, seed: int, index: int) -> str:
    """`fam.<family>.s<seed>.i<index>`: dots (which neither a suite folder's name nor a
    KernelBench slug holds) keep it apart from every other task id."""
    return f"{ID_PREFIX}.{family}.s{seed}.i{index}"


def parse_id(text: str) -> tuple[str, int, int] | None:
    """(family, seed, index) of a family task id; None when `text` is not one (the canonical
    spelling only: no leading zeros, no signs)."""
    parts = text.split(".")
    if len(parts) != 4 or parts[0] != ID_PREFIX or not parts[2].startswith("s") or not parts[3].startswith("i"):
        return None
    seed, index = parts[2][1:], parts[3][1:]
    if not (seed.isdigit() and index.isdigit() and seed.isascii() and index.isascii()):
        return None
    if str(int(seed)) != seed or str(int(index)) != index:
        return None
    return parts[1], int(seed), int(index)


# --------------------------------------------------------------------------------------
# Rendering.


def _c_params(arguments: Sequence[Arg]) -> str:
    parts = []
    for arg in arguments:
        if arg.role == "scalar":
            parts.append(f"int64_t {arg.name}")
        elif arg.role == "input":
            parts.append(f"const float* {arg.name}")
        else:
            parts.append(f"float* {arg.name}")
    return ", ".join(parts)


def _indent(lines: Sequence[str], depth: int) -> str:
    pad = "    " * depth
    return "".join(f"{pad}{line}\n" if line else "\n" for line in lines)


def cpu_source(entry: str, arguments: Sequence[Arg], count: str, body: Sequence[str], *, crash: bool = False) -> str:
    """The cpu solution: one OpenMP loop over the indices (`crash`: one index too many, so
    the last writes past the output's end)."""
    bound = "<=" if crash else "<"
    return (f'{HEADER}\nextern "C" void {entry}({_c_params(arguments)}) {{\n'
            f"    #pragma omp parallel for\n"
            f"    for (int64_t i = 0; i {bound} {count}; i++) {{\n"
            f"{_indent(body, 2)}"
            f"    }}\n}}\n")


def slow_source(entry: str, arguments: Sequence[Arg], count: str, body: Sequence[str]) -> str:
    """Correct but slow: one thread, the indices visited with a stride of 16 (every cache
    line fetched again and again)."""
    return (f'{HEADER}\nextern "C" void {entry}({_c_params(arguments)}) {{\n'
            f"    for (int64_t s = 0; s < 16; s++) {{\n"
            f"        for (int64_t i = s; i < {count}; i += 16) {{\n"
            f"{_indent(body, 3)}"
            f"        }}\n    }}\n}}\n")


def cuda_source(entry: str, arguments: Sequence[Arg], count: str, body: Sequence[str]) -> str:
    """The cuda solution: one thread per index, 256 to a block; the host launcher is the
    entry point."""
    names = ", ".join(a.name for a in arguments)
    return (f"{HEADER}\n__global__ void {entry}_kernel({_c_params(arguments)}) {{\n"
            f"    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;\n"
            f"    if (i < {count}) {{\n"
            f"{_indent(body, 2)}"
            f"    }}\n}}\n\n"
            f'extern "C" void {entry}({_c_params(arguments)}) {{\n'
            f"    int64_t count = {count};\n"
            f"    int64_t blocks = (count + 255) / 256;\n"
            f"    {entry}_kernel<<<blocks, 256>>>({names});\n}}\n")


def syntax_error(body: Sequence[str]) -> tuple[str, ...]:
    """The body with its first local's declaration dropped (`t0 = ...` for `float t0 =
    ...`): an undeclared name, a compile error."""
    lines = list(body)
    for k, line in enumerate(lines):
        if line.startswith("float "):
            lines[k] = line.removeprefix("float ")
            return tuple(lines)
    raise ValueError("a body declares at least one float local")


def reference_source(task: str, family: str, arguments: Sequence[Arg], numpy: Sequence[str],
                     torch: Sequence[str]) -> str:
    params = ", ".join(a.name for a in arguments if a.role != "output")
    return (f'"""Reference of {task} (generated by the {family} task family): NumPy (the oracle and the CPU '
            f'baseline) and PyTorch (the GPU baseline)."""\n\n'
            f"import numpy as np\n\n\n"
            f"def reference({params}):\n{_indent(numpy, 1)}\n\n"
            f"def torch_reference({params}):\n    import torch\n\n{_indent(torch, 1)}")


def c_float(value: float) -> str:
    """A float literal of C (`0.5f`, `2.0f`, `1e-05f`)."""
    text = repr(float(value))
    return text + "f" if ("e" in text or "." in text) else text + ".0f"


ROLES = {"input": Role.ARGUMENT_ROLE_INPUT, "output": Role.ARGUMENT_ROLE_OUTPUT, "scalar": Role.ARGUMENT_ROLE_SCALAR}


def render(family: str, seed: int, index: int, entry: str, blueprint: Blueprint, split: str) -> sandbox_pb2.Task:
    """The Task proto of one blueprint (FULL view: with its six examples)."""
    ident = task_id(family, seed, index)
    b = blueprint
    arguments = [sandbox_pb2.Argument(name=a.name, role=ROLES[a.role], dtype=FLOAT32 if a.role != "scalar" else
                                      common_pb2.DType.D_TYPE_INT64, shape=list(a.shape), description=a.description)
                 for a in b.arguments]
    declaration = f'extern "C" void {entry}({_c_params(b.arguments)});'
    examples = [
        (Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_SOLUTION, cpu_source(entry, b.arguments, b.count, b.body),
         Stage.STAGE_PASSED),
        (Toolchain.TOOLCHAIN_CUDA, ExampleKind.EXAMPLE_KIND_SOLUTION, cuda_source(entry, b.arguments, b.count, b.body),
         Stage.STAGE_PASSED),
        (Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_SYNTAX_ERROR,
         cpu_source(entry, b.arguments, b.count, syntax_error(b.body)), Stage.STAGE_COMPILE),
        (Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_WRONG_OUTPUT,
         cpu_source(entry, b.arguments, b.count, b.wrong_body), Stage.STAGE_CORRECT),
        (Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_CRASH,
         cpu_source(entry, b.arguments, b.count, b.body, crash=True), Stage.STAGE_RUN),
        (Toolchain.TOOLCHAIN_CPU, ExampleKind.EXAMPLE_KIND_SLOW, slow_source(entry, b.arguments, b.count, b.body),
         Stage.STAGE_PASSED),
    ]
    return sandbox_pb2.Task(
        id=ident, title=b.title, statement=b.statement, category=b.category,
        entry_point=sandbox_pb2.EntryPoint(name=entry, arguments=arguments, c_declaration=declaration),
        toolchains=[Toolchain.TOOLCHAIN_CPU, Toolchain.TOOLCHAIN_CUDA],
        tolerance=sandbox_pb2.Tolerance(atol=b.atol, rtol=b.rtol),
        sizes=[sandbox_pb2.SizePreset(name=name, values=values) for name, values in b.sizes.items()],
        split=split,
        reference_source=reference_source(ident, family, b.arguments, b.numpy, b.torch),
        examples=[sandbox_pb2.Example(toolchain=t, kind=k, source=s, expected_stage=st) for t, k, s, st in examples],
        origin=f"family:{family}",
        forbidden_calls=list(b.forbidden_calls),
        family=family,
        tier=b.tier,
    )


def split_of(combos: Iterable[tuple[str, ...]], heldout: frozenset[tuple[str, ...]]) -> str:
    """"heldout" when the task puts together a held-out pair of pieces, else "train"."""
    return "heldout" if any(combo in heldout for combo in combos) else "train"


def pair(a: str, b: str) -> tuple[str, str]:
    """An unordered pair of pieces, in one spelling."""
    return (a, b) if a <= b else (b, a)
