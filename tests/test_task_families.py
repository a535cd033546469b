"""The task-family generator (leap.tasks.families): deterministic, distinct, split so that no
held-out pair of pieces appears in a training task, and every generated solution right and
every broken variant wrong in the way it claims.

The solutions are checked here with the real compilers directly (g++ with OpenMP into a
shared library called through ctypes, nvcc for the cuda solutions, which this machine can
compile but not run), against the generated NumPy reference run on float64 copies of the
inputs, as the sandbox's oracle does; tests/test_sandbox_families.py has the sandbox judge
them as it serves them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from leap.tasks import eval_shape, families
from leap.tasks.families import core, elementwise, gemm, rows, stencil

Kind = sandbox_pb2.ExampleKind
Role = sandbox_pb2.ArgumentRole
CPU = common_pb2.Toolchain.TOOLCHAIN_CPU
CUDA = common_pb2.Toolchain.TOOLCHAIN_CUDA


FAMILIES = sorted(families.FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_inputs_give_the_same_task_byte_for_byte(family):
    first = families.generate(family, seed=3, index=41)
    again = families.generate(family, seed=3, index=41)
    assert first.SerializeToString(deterministic=True) == again.SerializeToString(deterministic=True)
    assert first.id == f"fam.{family}.s3.i41" and first.family == family and first.tier in core.TIERS


def test_four_families_hold_at_least_ten_thousand_distinct_tasks():
    assert len(families.FAMILIES) == 4
    assert sum(module.SIZE for module in families.FAMILIES.values()) >= 10_000


def test_ten_thousand_distinct_tasks_and_seeds_draw_different_mixes():
    tasks = families.generate_many("elementwise", seed=0, count=10_000)
    structures = {t.reference_source.split('"""', 2)[2] for t in tasks}  # the reference minus its docstring
    assert len(structures) == 10_000
    other = {t.reference_source.split('"""', 2)[2] for t in families.generate_many("elementwise", seed=1, count=200)}
    assert len(other - structures) > 100
    assert {t.tier for t in tasks} == set(core.TIERS)


@pytest.mark.parametrize("module, categories", [(rows, {"reduction", "normalization"}), (gemm, {"matmul"}),
                                                (stencil, {"convolution", "pooling"})],
                         ids=lambda m: getattr(m, "NAME", ""))
def test_every_structure_of_a_small_family_is_a_distinct_task_and_every_tier_occurs(module, categories):
    tasks = families.generate_many(module.NAME, seed=0, count=module.SIZE)
    assert len({t.reference_source.split('"""', 2)[2] for t in tasks}) == module.SIZE
    assert {t.tier for t in tasks} == set(core.TIERS)
    assert {t.category for t in tasks} == categories
    with pytest.raises(IndexError):
        families.generate(module.NAME, seed=0, index=module.SIZE)


def test_permutation_is_a_bijection():
    for size in (1, 2, 7, 100, 1000):
        key = core._seed_key("x", size)
        assert sorted(core.permute(i, key, size) for i in range(size)) == list(range(size))
    with pytest.raises(IndexError):
        core.permute(5, 0, 5)


PIECES = {"elementwise": lambda b: b.pieces["ops"].split(","), "rows": lambda b: b.pieces.values(),
          "gemm": lambda b: b.pieces.values(), "stencil": lambda b: b.pieces.values()}


@pytest.mark.parametrize("module", [elementwise, rows, gemm, stencil], ids=lambda m: m.NAME)
def test_no_heldout_pair_appears_in_a_training_task_and_every_piece_is_trained(module):
    count = min(3000, module.SIZE)
    trained_pieces, heldout = set(), 0
    for index in range(count):
        number = core.permute(index, core._seed_key(module.NAME, 0), module.SIZE)
        blueprint = module.build(number, core.task_rng(module.NAME, 0, index))
        split = core.split_of(blueprint.combos, module.HELDOUT)
        assert families.generate(module.NAME, 0, index).split == split  # the task says what the rule says
        if split == "train":
            assert not set(blueprint.combos) & module.HELDOUT
            trained_pieces.update(PIECES[module.NAME](blueprint))
        else:
            heldout += 1
            assert set(blueprint.combos) & module.HELDOUT
    assert 0 < heldout < count
    held_pieces = {piece for pair in module.HELDOUT for piece in pair}
    assert held_pieces <= trained_pieces  # each held-out piece is seen in training, only not with its partner


def test_ids_parse_back_and_unknown_ones_are_refused():
    task = families.task_from_id("fam.elementwise.s2.i9")
    assert task.id == "fam.elementwise.s2.i9"
    for bad in ("fam.elementwise.s02.i9", "fam.nope.s0.i0", "relu", "fam.elementwise.s0.i999999999"):
        with pytest.raises(KeyError):
            families.task_from_id(bad)
    with pytest.raises(ValueError, match="unknown task family"):
        families.generate("nope", 0, 0)


def _compile(source: str, tmp_path, name: str) -> subprocess.CompletedProcess:
    src = tmp_path / f"{name}.cpp"
    src.write_text(source)
    return subprocess.run(["g++", "-O2", "-fopenmp", "-shared", "-fPIC", "-o", str(tmp_path / f"{name}.so"), str(src)],
                          capture_output=True, text=True)


def _run(task: sandbox_pb2.Task, library, sizes: dict[str, int], rng) -> tuple[dict, dict]:
    """(outputs of the compiled entry point, outputs of the float64 reference) on fresh inputs."""
    def shape(arg):
        return tuple(eval_shape(expr, sizes) for expr in arg.shape)

    args = task.entry_point.arguments
    inputs = {a.name: rng.standard_normal(shape(a)).astype(np.float32) for a in args if a.role == Role.ARGUMENT_ROLE_INPUT}
    outputs = {a.name: np.full(shape(a), np.nan, np.float32) for a in args if a.role == Role.ARGUMENT_ROLE_OUTPUT}
    call = []
    for a in args:
        if a.role == Role.ARGUMENT_ROLE_SCALAR:
            call.append(ctypes.c_int64(sizes[a.name]))
        else:
            array = inputs.get(a.name, outputs.get(a.name))
            call.append(array.ctypes.data_as(ctypes.c_void_p))
    getattr(library, task.entry_point.name)(*call)
    namespace: dict = {}
    exec(task.reference_source, namespace)  # our own generated reference, not a candidate's code
    want = namespace["reference"](**{k: v.astype(np.float64) for k, v in inputs.items()},
                                  **{a.name: sizes[a.name] for a in args if a.role == Role.ARGUMENT_ROLE_SCALAR})
    want = want if isinstance(want, tuple) else (want,)
    return outputs, dict(zip(outputs, want))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("family, index", [("elementwise", i) for i in (0, 1, 2, 3, 5, 8, 13, 21)]
                         + [("rows", i) for i in (0, 1, 2, 4, 6, 9, 11, 15)]
                         + [("gemm", i) for i in (0, 1, 3, 5, 8, 12)]
                         + [("stencil", i) for i in (0, 1, 2, 5, 7, 9)])
def test_cpu_solution_passes_and_broken_variants_fail_at_their_stage(tmp_path, family, index):
    task = families.generate(family, seed=0, index=index)
    tolerance = task.tolerance
    sizes = dict(next(p for p in task.sizes if p.name == "small").values)
    by_kind = {e.kind: e for e in task.examples if e.toolchain == CPU}
    rng = np.random.default_rng(index)

    solution = _compile(by_kind[Kind.EXAMPLE_KIND_SOLUTION].source, tmp_path, "solution")
    assert solution.returncode == 0, solution.stderr
    got, want = _run(task, ctypes.CDLL(str(tmp_path / "solution.so")), sizes, rng)
    for name in got:
        np.testing.assert_allclose(got[name], want[name], atol=tolerance.atol, rtol=tolerance.rtol)

    slow = _compile(by_kind[Kind.EXAMPLE_KIND_SLOW].source, tmp_path, "slow")
    assert slow.returncode == 0, slow.stderr
    got, want = _run(task, ctypes.CDLL(str(tmp_path / "slow.so")), sizes, rng)
    for name in got:
        np.testing.assert_allclose(got[name], want[name], atol=tolerance.atol, rtol=tolerance.rtol)

    assert _compile(by_kind[Kind.EXAMPLE_KIND_SYNTAX_ERROR].source, tmp_path, "syntax").returncode != 0

    wrong = _compile(by_kind[Kind.EXAMPLE_KIND_WRONG_OUTPUT].source, tmp_path, "wrong")
    assert wrong.returncode == 0, wrong.stderr
    got, want = _run(task, ctypes.CDLL(str(tmp_path / "wrong.so")), sizes, rng)
    assert not all(np.allclose(got[n], want[n], atol=tolerance.atol, rtol=tolerance.rtol) for n in got)

    crash = by_kind[Kind.EXAMPLE_KIND_CRASH].source  # writes one element past the output: only the sandbox's guard pages see it
    assert "i <= " in crash and _compile(crash, tmp_path, "crash").returncode == 0
    assert by_kind[Kind.EXAMPLE_KIND_CRASH].expected_stage == common_pb2.Stage.STAGE_RUN


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_solutions_compile_with_nvcc(tmp_path, family):
    for index in (0, 7):
        task = families.generate(family, seed=0, index=index)
        source = next(e.source for e in task.examples if e.toolchain == CUDA)
        path = tmp_path / f"t{index}.cu"
        path.write_text(source)
        done = subprocess.run(["nvcc", "-c", "-o", str(tmp_path / f"t{index}.o"), str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", ["gemm", "stencil", "elementwise"])
def test_tier_indices_are_the_first_indices_of_that_tier_in_order(name):
    module = families.family(name)
    scanned = min(module.SIZE, 3000)
    tiers = [families.generate(name, 2, index).tier for index in range(scanned)]
    for tier in (1, 2, 3):
        want = [index for index, t in enumerate(tiers) if t == tier][:15]
        got = families.tier_indices(name, 2, tier, 15)
        if len(want) == 15:
            assert got == want
        else:  # fewer than 15 among the scanned indices: the found ones start the list
            assert got[:len(want)] == want and all(families.generate(name, 2, i).tier == tier for i in got)
