"""Fused GEMM epilogues: out = scale * act(A @ B [+ bias] [+ R]) [+ R], A m x k, B k x n (or
given transposed, n x k), with an optional bias over the columns, an activation, a scale and an
optional residual R (m x n) added before the activation or after the scale.

Structure: (layout, bias, act, scale, residual), every combination of `LAYOUTS`, `BIAS`,
`ACTS`, `SCALES` and `RESIDUALS`.
Split: a task is held out when it puts together a pair of pieces in `HELDOUT` (an activation
training never sees with that residual placement, that scale, or after a transposed B),
though training sees each of them with others.

The kernel computes one output element per index i (row i / n, column i % n) as a dot product
over k, then its epilogue; the library GEMMs are forbidden (`core.BLAS`).
"""

from __future__ import annotations

import random

from leap.tasks.families import core

NAME = "gemm"
ENTRY = "gemm"

LAYOUTS = ("layout_nn", "layout_nt")  # B as k x n, or B given transposed (n x k): out = A @ B^T
BIAS = ("no_bias", "bias")
# name: (C, NumPy, PyTorch, in words); {0} is the value.
ACTS: dict[str, tuple[str, str, str, str]] = {
    "act_none": ("{0}", "{0}", "{0}", "{0}"),
    "act_relu": ("fmaxf({0}, 0.0f)", "np.maximum({0}, 0.0)", "torch.relu({0})", "relu({0})"),
    "act_gelu": ("0.5f * {0} * (1.0f + tanhf(0.7978845608f * ({0} + 0.044715f * {0} * {0} * {0})))",
                 "0.5 * {0} * (1.0 + np.tanh(0.7978845608028654 * ({0} + 0.044715 * {0} ** 3)))",
                 "torch.nn.functional.gelu({0}, approximate='tanh')", "gelu_tanh({0})"),
    "act_silu": ("{0} / (1.0f + expf(-{0}))", "{0} / (1.0 + np.exp(-{0}))", "torch.nn.functional.silu({0})",
                 "silu({0})"),
    "act_tanh": ("tanhf({0})", "np.tanh({0})", "torch.tanh({0})", "tanh({0})"),
    "act_sigmoid": ("1.0f / (1.0f + expf(-{0}))", "1.0 / (1.0 + np.exp(-{0}))", "torch.sigmoid({0})",
                    "sigmoid({0})"),
}
SCALES = {"scale_1": 1.0, "scale_0.5": 0.5, "scale_2": 2.0, "scale_0.125": 0.125}
RESIDUALS = ("no_residual", "residual_before", "residual_after")  # R added before the activation, or at the end
HELDOUT = frozenset(core.pair(a, b) for a, b in (
    ("act_gelu", "residual_after"), ("act_tanh", "layout_nt"), ("act_sigmoid", "scale_0.5"),
    ("act_relu", "residual_before"),
))  # about a quarter of the tasks
_RADICES = (len(LAYOUTS), len(BIAS), len(ACTS), len(SCALES), len(RESIDUALS))
SIZE = core.product(_RADICES)


def structure(number: int) -> tuple[str, str, str, str, str]:
    """(layout, bias, act, scale, residual) of structure `number`."""
    layout, bias, act, scale, residual = core.digits(number, _RADICES)
    return LAYOUTS[layout], BIAS[bias], list(ACTS)[act], list(SCALES)[scale], RESIDUALS[residual]


def c_body(layout: str, bias: str, act: str, scale: str, residual: str, wrong: bool = False) -> tuple[str, ...]:
    """The C lines of output element i. `wrong`: the dot product stops one term short."""
    b_index = "kk * n + col" if layout == "layout_nn" else "col * k + kk"
    lines = ["const int64_t row = i / n, col = i % n;", "float acc = 0.0f;",
             f"for (int64_t kk = 0; kk < {'k - 1' if wrong else 'k'}; kk++) {{",
             f"    acc += a[row * k + kk] * b[{b_index}];", "}"]
    if bias == "bias":
        lines.append("acc += bias[col];")
    if residual == "residual_before":
        lines.append("acc += r[i];")
    lines.append(f"float t = {ACTS[act][0].format('acc')};")
    if SCALES[scale] != 1.0:
        lines.append(f"t = {core.c_float(SCALES[scale])} * t;")
    if residual == "residual_after":
        lines.append("t = t + r[i];")
    lines.append("out[i] = t;")
    return tuple(lines)


def reference_lines(layout: str, bias: str, act: str, scale: str, residual: str, lib: str) -> list[str]:
    """The reference's lines (NumPy, or PyTorch with lib="torch")."""
    table = 1 if lib == "np" else 2
    lines = ["y = a @ b" if layout == "layout_nn" else "y = a @ b.T"]
    if bias == "bias":
        lines.append("y = y + bias")
    if residual == "residual_before":
        lines.append("y = y + r")
    lines.append(f"y = {ACTS[act][table].format('y')}")
    if SCALES[scale] != 1.0:
        lines.append(f"y = {SCALES[scale]!r} * y")
    if residual == "residual_after":
        lines.append("y = y + r")
    return lines + ["return y"]


def words(layout: str, bias: str, act: str, scale: str, residual: str) -> str:
    inner = "A @ B" if layout == "layout_nn" else "A @ B^T"
    if bias == "bias":
        inner += " + bias"
    if residual == "residual_before":
        inner += " + R"
    text = ACTS[act][3].format(inner)
    if SCALES[scale] != 1.0:
        text = f"{SCALES[scale]:g} * {text if act != 'act_none' else '(' + text + ')'}"
    if residual == "residual_after":
        text += " + R"
    return text


def build(number: int, rng: random.Random) -> core.Blueprint:
    layout, bias, act, scale, residual = pieces = structure(number)
    b_shape = ("k", "n") if layout == "layout_nn" else ("n", "k")
    arguments = [core.Arg("a", "input", ("m", "k")), core.Arg("b", "input", b_shape)]
    if bias == "bias":
        arguments.append(core.Arg("bias", "input", ("n",)))
    if residual != "no_residual":
        arguments.append(core.Arg("r", "input", ("m", "n")))
    arguments += [core.Arg("out", "output", ("m", "n")), core.Arg("m", "scalar"), core.Arg("n", "scalar"),
                  core.Arg("k", "scalar")]
    formula = words(*pieces)
    given = "a (m x k floats), " + ("b (k x n floats)" if layout == "layout_nn" else "b (n x k floats: B transposed)")
    given += ", bias (n floats)" if bias == "bias" else ""
    given += ", r (m x n floats)" if residual != "no_residual" else ""
    steps = (bias == "bias") + (act != "act_none") + (SCALES[scale] != 1.0) + (residual != "no_residual")
    unique = list(pieces)
    return core.Blueprint(
        pieces=dict(zip(("layout", "bias", "act", "scale", "residual"), pieces)),
        combos=tuple(core.pair(x, y) for n_, x in enumerate(unique) for y in unique[n_ + 1:]),
        title=f"GEMM: {formula}",
        statement=(f"Given {given}, all row-major, compute out (m x n floats) = {formula}, without a BLAS library "
                   f"call."),
        category="matmul",
        arguments=tuple(arguments),
        sizes={"small": {"m": rng.choice((32, 64, 128)), "n": rng.choice((32, 64, 128)), "k": rng.choice((32, 64, 128))},
               "large": {"m": 2048, "n": 2048, "k": 2048}},
        count="m * n",
        body=c_body(*pieces),
        wrong_body=c_body(*pieces, wrong=True),
        numpy=tuple(reference_lines(*pieces, lib="np")),
        torch=tuple(reference_lines(*pieces, lib="torch")),
        tier=1 if steps <= 1 else 2 if steps == 2 else 3,
        atol=1e-3,
        rtol=1e-3,
        forbidden_calls=tuple(core.BLAS),
    )
