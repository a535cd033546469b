"""Elementwise expression trees: out[i] = f(x[i], y[i], z[i]) for a small tree f of unary ops,
binary ops and constants over one to three inputs.

Structure: one of `TEMPLATES` (the tree's shape) with every unary slot filled from `UNARY`,
every binary slot from `BINARY` and every constant slot from `CONSTANTS`.
Split: a task is held out when it uses both ops of a pair in `HELDOUT` (op pairs training
never sees in one task, though it sees each op with others).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from leap.tasks.families import core

NAME = "elementwise"
ENTRY = "elementwise"

# name: (C, NumPy, PyTorch, what it is in words, NumPy function). {0} is the argument.
UNARY: dict[str, tuple[str, str, str, Any]] = {
    "neg": ("-{0}", "-{0}", "-{0}", lambda a: -a),
    "abs": ("fabsf({0})", "np.abs({0})", "torch.abs({0})", np.abs),
    "relu": ("fmaxf({0}, 0.0f)", "np.maximum({0}, 0.0)", "torch.relu({0})", lambda a: np.maximum(a, 0.0)),
    "sigmoid": ("1.0f / (1.0f + expf(-{0}))", "1.0 / (1.0 + np.exp(-{0}))", "torch.sigmoid({0})",
                lambda a: 1.0 / (1.0 + np.exp(-a))),
    "tanh": ("tanhf({0})", "np.tanh({0})", "torch.tanh({0})", np.tanh),
    "sin": ("sinf({0})", "np.sin({0})", "torch.sin({0})", np.sin),
    "cos": ("cosf({0})", "np.cos({0})", "torch.cos({0})", np.cos),
    "square": ("{0} * {0}", "{0} * {0}", "{0} * {0}", lambda a: a * a),
    "softplus": ("fmaxf({0}, 0.0f) + log1pf(expf(-fabsf({0})))", "np.maximum({0}, 0.0) + np.log1p(np.exp(-np.abs({0})))",
                 "torch.nn.functional.softplus({0})", lambda a: np.maximum(a, 0.0) + np.log1p(np.exp(-np.abs(a)))),
    "silu": ("{0} / (1.0f + expf(-{0}))", "{0} / (1.0 + np.exp(-{0}))", "torch.nn.functional.silu({0})",
             lambda a: a / (1.0 + np.exp(-a))),
    "gelu": ("0.5f * {0} * (1.0f + tanhf(0.7978845608f * ({0} + 0.044715f * {0} * {0} * {0})))",
             "0.5 * {0} * (1.0 + np.tanh(0.7978845608028654 * ({0} + 0.044715 * {0} ** 3)))",
             "torch.nn.functional.gelu({0}, approximate='tanh')",
             lambda a: 0.5 * a * (1.0 + np.tanh(0.7978845608028654 * (a + 0.044715 * a ** 3)))),
    "softsign": ("{0} / (1.0f + fabsf({0}))", "{0} / (1.0 + np.abs({0}))", "torch.nn.functional.softsign({0})",
                 lambda a: a / (1.0 + np.abs(a))),
    "leaky_relu": ("({0} > 0.0f ? {0} : 0.01f * {0})", "np.where({0} > 0, {0}, 0.01 * {0})",
                   "torch.nn.functional.leaky_relu({0}, 0.01)", lambda a: np.where(a > 0, a, 0.01 * a)),
    "elu": ("({0} > 0.0f ? {0} : expm1f({0}))", "np.where({0} > 0, {0}, np.expm1(np.minimum({0}, 0.0)))",
            "torch.nn.functional.elu({0})", lambda a: np.where(a > 0, a, np.expm1(np.minimum(a, 0.0)))),
    "log1p_abs": ("log1pf(fabsf({0}))", "np.log1p(np.abs({0}))", "torch.log1p(torch.abs({0}))",
                  lambda a: np.log1p(np.abs(a))),
    "exp_neg_abs": ("expf(-fabsf({0}))", "np.exp(-np.abs({0}))", "torch.exp(-torch.abs({0}))",
                    lambda a: np.exp(-np.abs(a))),
}
WORDS = {"neg": "-{0}", "square": "({0})^2", "log1p_abs": "log1p(|{0}|)", "exp_neg_abs": "exp(-|{0}|)",
         "abs": "|{0}|", "gelu": "gelu_tanh({0})", "leaky_relu": "leaky_relu({0}, 0.01)"}
BINARY: dict[str, tuple[str, str, str, Any]] = {
    "add": ("{0} + {1}", "{0} + {1}", "{0} + {1}", np.add),
    "sub": ("{0} - {1}", "{0} - {1}", "{0} - {1}", np.subtract),
    "mul": ("{0} * {1}", "{0} * {1}", "{0} * {1}", np.multiply),
    "max": ("fmaxf({0}, {1})", "np.maximum({0}, {1})", "torch.maximum({0}, {1})", np.maximum),
    "min": ("fminf({0}, {1})", "np.minimum({0}, {1})", "torch.minimum({0}, {1})", np.minimum),
    "hypot": ("hypotf({0}, {1})", "np.hypot({0}, {1})", "torch.hypot({0}, {1})", np.hypot),
}
BINARY_WORDS = {"add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "max": "max({0}, {1})",
                "min": "min({0}, {1})", "hypot": "hypot({0}, {1})"}
CONSTANTS = (0.5, 2.0, -1.0, 3.0, 0.25)
U, B, C = "U", "B", "C"
TEMPLATES: tuple[Any, ...] = (
    (U, "x"),
    (B, "x", "y"),
    (B, "x", C),
    (U, (U, "x")),
    (U, (B, "x", "y")),
    (B, (U, "x"), "y"),
    (B, (U, "x"), C),
    (B, (U, "x"), (U, "y")),
    (U, (B, (U, "x"), C)),
    (B, (B, "x", "y"), "z"),
    (U, (B, (U, "x"), (U, "y"))),
    (B, (U, (B, "x", "y")), "z"),
    (B, (U, (U, "x")), (U, "y")),
    (B, (U, "x"), (B, "y", C)),
    (U, (B, (B, (U, "x"), "y"), C)),
    (B, (U, (B, (U, "x"), "y")), (U, "z")),
)
HELDOUT = frozenset(core.pair(a, b) for a, b in (
    ("sigmoid", "sin"), ("mul", "tanh"), ("gelu", "max"), ("cos", "softplus"), ("abs", "silu"),
    ("elu", "hypot"), ("log1p_abs", "square"), ("exp_neg_abs", "leaky_relu"), ("min", "softsign"),
    ("neg", "relu"),
))
SAMPLE = np.random.default_rng(20261204).standard_normal((3, 64))  # tells a wrong variant from the right one


def _slots(template: Any) -> list[str]:
    if isinstance(template, str):
        return [C] if template == C else []
    kind, *children = template
    return [kind] + [s for child in children for s in _slots(child)]


_RADICES = {U: len(UNARY), B: len(BINARY), C: len(CONSTANTS)}
_COUNTS = [core.product(_RADICES[s] for s in _slots(t)) for t in TEMPLATES]
SIZE = sum(_COUNTS)


def _fill(template: Any, choices: list[int]) -> Any:
    """The tree with its slots filled, consuming `choices` in slot order."""
    if isinstance(template, str):
        return ("const", CONSTANTS[choices.pop(0)]) if template == C else ("input", template)
    kind, *children = template
    op = (list(UNARY) if kind == U else list(BINARY))[choices.pop(0)]
    return (op, *[_fill(child, choices) for child in children])


def structure(number: int) -> Any:
    """The expression tree of structure `number`: nested (op, children...), ("input", name)
    and ("const", value)."""
    for template, count in zip(TEMPLATES, _COUNTS):
        if number < count:
            slots = _slots(template)
            return _fill(template, core.digits(number, [_RADICES[s] for s in slots]))
        number -= count
    raise IndexError("structure number out of range")


def tier_of(number: int) -> int:
    """The tier of structure `number` (what `build` gives it), without building it."""
    count = len(_ops(structure(number)))
    return 1 if count <= 2 else 2 if count <= 4 else 3


def _ops(tree: Any) -> list[str]:
    if tree[0] in ("input", "const"):
        return []
    return [tree[0]] + [op for child in tree[1:] for op in _ops(child)]


def _inputs(tree: Any) -> list[str]:
    if tree[0] == "input":
        return [tree[1]]
    if tree[0] == "const":
        return []
    return sorted({name for child in tree[1:] for name in _inputs(child)})


def _table(op: str) -> tuple[str, str, str, Any]:
    return UNARY[op] if op in UNARY else BINARY[op]


def evaluate(tree: Any, values: dict[str, np.ndarray]) -> np.ndarray:
    """The tree's value on NumPy arrays (float64)."""
    if tree[0] == "input":
        return values[tree[1]]
    if tree[0] == "const":
        return np.full_like(values["x"], tree[1])
    return _table(tree[0])[3](*[evaluate(child, values) for child in tree[1:]])


def words(tree: Any) -> str:
    if tree[0] == "input":
        return f"{tree[1]}[i]"
    if tree[0] == "const":
        return repr(tree[1])
    args = [words(child) for child in tree[1:]]
    if tree[0] in BINARY:
        return BINARY_WORDS[tree[0]].format(*args)
    return WORDS.get(tree[0], tree[0] + "({0})").format(*args)


def _lines(tree: Any) -> tuple[list[str], list[str], list[str], str, str, str]:
    """Statement-per-node renderings (C, NumPy, PyTorch) and each one's final name."""
    c_lines: list[str] = []
    np_lines: list[str] = []
    torch_lines: list[str] = []

    def walk(node: Any) -> tuple[str, str, str]:
        if node[0] == "input":
            name = node[1]
            return f"{name}[i]", name, name
        if node[0] == "const":
            c = len(torch_lines)
            torch_lines.append(f"c{c} = torch.full_like(x, {node[1]!r})")
            return f"({core.c_float(node[1])})", repr(node[1]), f"c{c}"
        args = [walk(child) for child in node[1:]]
        c_fmt, np_fmt, torch_fmt, _ = _table(node[0])
        name = f"t{len(c_lines)}"
        c_lines.append(f"float {name} = {c_fmt.format(*[a[0] for a in args])};")
        np_lines.append(f"{name} = {np_fmt.format(*[a[1] for a in args])}")
        torch_lines.append(f"{name} = {torch_fmt.format(*[a[2] for a in args])}")
        return name, name, name

    c_name, np_name, torch_name = walk(tree)
    return c_lines, np_lines, torch_lines, c_name, np_name, torch_name


def _mutations(tree: Any) -> list[Any]:
    """Plausible slips at the root: another unary op, or a binary op's usual confusion."""
    op = tree[0]
    if op in UNARY:
        names = list(UNARY)
        start = names.index(op)
        return [(names[(start + k) % len(names)], *tree[1:]) for k in (1, 2, 3)]
    swaps = {"add": ["sub", "mul"], "sub": ["add", "mul"], "mul": ["add", "sub"], "max": ["min", "add"],
             "min": ["max", "add"], "hypot": ["add", "max"]}
    return [(other, *tree[1:]) for other in swaps[op]]


def build(number: int, rng: random.Random) -> core.Blueprint:
    tree = structure(number)
    ops = _ops(tree)
    names = _inputs(tree)
    sample = dict(zip(("x", "y", "z"), SAMPLE))
    right = evaluate(tree, sample)
    wrong_tree = next((m for m in _mutations(tree)
                       if not np.allclose(evaluate(m, sample), right, atol=1e-2, rtol=1e-2)), None)
    c_lines, np_lines, torch_lines, c_out, np_out, torch_out = _lines(tree)
    body = tuple(c_lines + [f"out[i] = {c_out};"])
    if wrong_tree is not None:
        wrong_c, *_rest = _lines(wrong_tree)
        wrong = tuple(wrong_c[:-1] + [wrong_c[-1]] + [f"out[i] = {_lines(wrong_tree)[3]};"])
    else:  # no slip at the root changes this tree's values: an offset does
        wrong = tuple(c_lines + [f"out[i] = {c_out} + 1.0f;"])
    n_small = rng.choice((8192, 16384, 32768, 65536))
    arguments = tuple([core.Arg(name, "input", ("n",)) for name in names] + [core.Arg("out", "output", ("n",)),
                                                                           core.Arg("n", "scalar")])
    given = ", ".join(names)
    statement = (f"Given {given} ({'n floats each' if len(names) > 1 else 'n floats'}), compute out (n floats): "
                 f"out[i] = {words(tree)}.")
    unique = sorted(set(ops))
    combos = tuple(core.pair(a, b) for k, a in enumerate(unique) for b in unique[k + 1:])
    return core.Blueprint(
        pieces={"tree": repr(tree), "ops": ",".join(ops)},
        combos=combos,
        title=f"Elementwise: {words(tree).replace('[i]', '')}",
        statement=statement,
        category="elementwise",
        arguments=arguments,
        sizes={"small": {"n": n_small}, "large": {"n": 1 << 24}},
        count="n",
        body=body,
        wrong_body=wrong,
        numpy=tuple(np_lines + [f"return {np_out}" if np_lines else f"return {np_out} + 0.0"]),
        torch=tuple(torch_lines + [f"return {torch_out}"]),
        tier=tier_of(number),
    )
