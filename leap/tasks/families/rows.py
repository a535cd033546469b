"""Row-wise reductions and normalizations: for each row of x (m rows of n floats), one
reduction to a float (sum, mean, max, min, sum of squares, L2 norm, variance, log-sum-exp) or
one normalization of the row (softmax, log-softmax, layer norm, RMS norm, centring, L2
normalization), with an elementwise op applied to the row before (`PRE`) and one applied to
the result after (`POST`).

Structure: (op, pre, post), every combination of `OPS`, `PRE` and `POST`.
Split: a task is held out when it puts an op together with a pre or post op it is paired with
in `HELDOUT` (an epilogue training never sees after that reduction, a normalization it never
sees over that transformed input), though training sees each of them with others.

The kernel computes one row per index i (one OpenMP iteration, one GPU thread), in the order
a careful hand-written kernel would: a pass for the row's maximum or mean where the op needs
one, then the pass that uses it.
"""

from __future__ import annotations

import random

from leap.tasks.families import core

NAME = "rows"
ENTRY = "rows"
EPS = 1e-5

# name: (C, NumPy, PyTorch, in words) of the op applied to each element before the row op.
PRE: dict[str, tuple[str, str, str, str]] = {
    "pre_id": ("{0}", "{0}", "{0}", "x"),
    "pre_relu": ("fmaxf({0}, 0.0f)", "np.maximum({0}, 0.0)", "torch.relu({0})", "relu(x)"),
    "pre_tanh": ("tanhf({0})", "np.tanh({0})", "torch.tanh({0})", "tanh(x)"),
    "pre_square": ("({0} * {0})", "({0} * {0})", "({0} * {0})", "x^2"),
    "pre_affine": ("(0.5f * {0} + 1.0f)", "(0.5 * {0} + 1.0)", "(0.5 * {0} + 1.0)", "0.5 * x + 1"),
    "pre_sigmoid": ("(1.0f / (1.0f + expf(-{0})))", "(1.0 / (1.0 + np.exp(-{0})))", "torch.sigmoid({0})", "sigmoid(x)"),
}
# name: (C, NumPy, PyTorch, in words) of the op applied to each result after it.
POST: dict[str, tuple[str, str, str, str]] = {
    "post_id": ("{0}", "{0}", "{0}", "{0}"),
    "post_half": ("0.5f * ({0})", "0.5 * {0}", "0.5 * {0}", "0.5 * {0}"),
    "post_double": ("2.0f * ({0})", "2.0 * {0}", "2.0 * {0}", "2 * {0}"),
    "post_add_one": ("({0}) + 1.0f", "{0} + 1.0", "{0} + 1.0", "{0} + 1"),
    "post_square": ("({0}) * ({0})", "{0} * {0}", "{0} * {0}", "({0})^2"),
    "post_neg": ("-({0})", "-{0}", "-{0}", "-{0}"),
}
# (No bounded post op such as tanh: after a sum over a thousand positive terms it is 1.0 in
# every row, a task any constant solves.)
# name: (reduces the row to one float, complexity 0-2, in words)
OPS: dict[str, tuple[bool, int, str]] = {
    "sum": (True, 0, "the sum of the row"),
    "mean": (True, 0, "the mean of the row"),
    "max": (True, 0, "the maximum of the row"),
    "min": (True, 0, "the minimum of the row"),
    "sumsq": (True, 0, "the sum of the squares of the row"),
    "l2": (True, 1, "the L2 norm of the row"),
    "var": (True, 1, "the (population) variance of the row"),
    "logsumexp": (True, 1, "log(sum(exp(row)))"),
    "softmax": (False, 1, "the softmax of the row"),
    "center": (False, 1, "the row minus its mean"),
    "l2_normalize": (False, 1, "the row divided by its L2 norm (at least 1e-12)"),
    "log_softmax": (False, 2, "the log-softmax of the row"),
    "layer_norm": (False, 2, f"layer norm of the row: (row - mean) / sqrt(variance + {EPS:g}) * gamma + beta"),
    "rms_norm": (False, 2, f"RMS norm of the row: row / sqrt(mean(row^2) + {EPS:g}) * w"),
}
HELDOUT = frozenset(core.pair(a, b) for a, b in (
    ("softmax", "post_neg"), ("layer_norm", "post_square"), ("logsumexp", "post_half"), ("max", "post_add_one"),
    ("var", "post_double"), ("rms_norm", "pre_relu"), ("sum", "pre_tanh"), ("log_softmax", "pre_square"),
    ("mean", "pre_sigmoid"), ("l2_normalize", "pre_affine"),
))
SIZE = len(OPS) * len(PRE) * len(POST)
EPS_C = core.c_float(EPS)


def structure(number: int) -> tuple[str, str, str]:
    """(op, pre, post) of structure `number`."""
    op, pre, post = core.digits(number, [len(OPS), len(PRE), len(POST)])
    return list(OPS)[op], list(PRE)[pre], list(POST)[post]


def _loop(lines: list[str]) -> list[str]:
    """A pass over the row: `p` is the row's element j after the pre op."""
    return ["for (int64_t j = 0; j < n; j++) {", "    float p = PRE(row[j]);", *["    " + line for line in lines], "}"]


def c_body(op: str, wrong: bool = False) -> list[str]:
    """The C lines of one row (i), with PRE(v) and POST(v) still to substitute. `wrong`: the
    same with one plausible mistake that changes the outputs."""
    row = ["const float* row = x + i * n;"]
    store = "out[i] = POST({0});"  # reductions: one float per row
    each = "out[i * n + j] = POST({0});"  # normalizations: the row
    if op in ("sum", "mean", "sumsq", "l2"):
        term = "p * p" if op in ("sumsq", "l2") and not (wrong and op == "sumsq") else "p"
        result = {"sum": "acc", "mean": "acc / (float)n", "sumsq": "acc", "l2": "sqrtf(acc)"}[op]
        if wrong:
            result = {"sum": "acc - PRE(row[n - 1])", "mean": "acc", "sumsq": "acc", "l2": "acc"}[op]
        return row + ["float acc = 0.0f;", *_loop([f"acc += {term};"]), store.format(result)]
    if op in ("max", "min"):
        pick = {"max": "fmaxf", "min": "fminf"}[op]
        if wrong:
            pick = {"max": "fminf", "min": "fmaxf"}[op]
        start = "-INFINITY" if op == "max" else "INFINITY"
        if wrong:
            start = "INFINITY" if op == "max" else "-INFINITY"
        return row + [f"float acc = {start};", *_loop([f"acc = {pick}(acc, p);"]), store.format("acc")]
    mean = ["float mean = 0.0f;", *_loop(["mean += p;"]), "mean /= (float)n;"]
    peak = ["float mx = -INFINITY;", *_loop(["mx = fmaxf(mx, p);"])]
    if op == "var":
        return row + mean + ["float acc = 0.0f;", *_loop(["acc += (p - mean) * (p - mean);"]),
                             store.format("acc" if wrong else "acc / (float)n")]
    if op == "logsumexp":
        return row + peak + ["float acc = 0.0f;", *_loop(["acc += expf(p - mx);"]),
                             store.format("logf(acc)" if wrong else "mx + logf(acc)")]
    if op in ("softmax", "log_softmax"):
        lines = row + peak + ["float acc = 0.0f;", *_loop(["acc += expf(p - mx);"])]
        if op == "softmax":
            value = "expf(p) / acc" if wrong else "expf(p - mx) / acc"
        else:
            value = "p - mx" if wrong else "p - mx - logf(acc)"
        return lines + _loop([each.format(value)])
    if op == "center":
        return row + (peak if wrong else mean) + _loop([each.format("p - mx" if wrong else "p - mean")])
    if op == "l2_normalize":
        norm = "fmaxf(acc, 1e-12f)" if wrong else "fmaxf(sqrtf(acc), 1e-12f)"
        return row + ["float acc = 0.0f;", *_loop(["acc += p * p;"]), f"float norm = {norm};",
                      *_loop([each.format("p / norm")])]
    if op == "layer_norm":
        value = "(p - mean) * inv * gamma[j]" + ("" if wrong else " + beta[j]")
        return row + mean + ["float acc = 0.0f;", *_loop(["acc += (p - mean) * (p - mean);"]),
                             f"float inv = 1.0f / sqrtf(acc / (float)n + {EPS_C});", *_loop([each.format(value)])]
    if op == "rms_norm":
        value = "p * inv" + ("" if wrong else " * w[j]")
        return row + ["float acc = 0.0f;", *_loop(["acc += p * p;"]),
                      f"float inv = 1.0f / sqrtf(acc / (float)n + {EPS_C});", *_loop([each.format(value)])]
    raise KeyError(op)


def _substitute(lines: list[str], pre: str, post: str) -> tuple[str, ...]:
    """PRE(v) and POST(v) replaced by the ops' C (their arguments are single names or
    `row[...]` here, so a textual replacement is exact)."""
    out = []
    for line in lines:
        while "PRE(" in line:
            start = line.index("PRE(")
            end = line.index(")", line.index("row[", start)) + 1  # PRE(row[...])
            line = line[:start] + PRE[pre][0].format(line[start + 4:end - 1]) + line[end:]
        if "POST(" in line:
            start = line.index("POST(")
            end = line.rindex(")")
            line = line[:start] + POST[post][0].format(line[start + 5:end]) + line[end + 1:]
        out.append(line)
    return tuple(out)


def numpy_lines(op: str, pre: str, post: str, lib: str = "np") -> list[str]:
    """The reference's lines (NumPy, or PyTorch with lib="torch")."""
    table = 1 if lib == "np" else 2
    lines = [f"p = {PRE[pre][table].format('x')}"]
    if lib == "np":
        value = {
            "sum": "p.sum(axis=1)", "mean": "p.mean(axis=1)", "max": "p.max(axis=1)", "min": "p.min(axis=1)",
            "sumsq": "(p * p).sum(axis=1)", "l2": "np.sqrt((p * p).sum(axis=1))", "var": "p.var(axis=1)",
            "center": "p - p.mean(axis=1, keepdims=True)",
            "l2_normalize": "p / np.maximum(np.sqrt((p * p).sum(axis=1, keepdims=True)), 1e-12)",
            "rms_norm": f"p / np.sqrt((p * p).mean(axis=1, keepdims=True) + {EPS!r}) * w",
        }.get(op)
        if op == "logsumexp":
            lines += ["mx = p.max(axis=1, keepdims=True)"]
            value = "(mx + np.log(np.exp(p - mx).sum(axis=1, keepdims=True)))[:, 0]"
        elif op == "softmax":
            lines += ["e = np.exp(p - p.max(axis=1, keepdims=True))"]
            value = "e / e.sum(axis=1, keepdims=True)"
        elif op == "log_softmax":
            lines += ["s = p - p.max(axis=1, keepdims=True)"]
            value = "s - np.log(np.exp(s).sum(axis=1, keepdims=True))"
        elif op == "layer_norm":
            lines += ["mu = p.mean(axis=1, keepdims=True)", "var = p.var(axis=1, keepdims=True)"]
            value = f"(p - mu) / np.sqrt(var + {EPS!r}) * gamma + beta"
    else:
        value = {
            "sum": "p.sum(dim=1)", "mean": "p.mean(dim=1)", "max": "p.amax(dim=1)", "min": "p.amin(dim=1)",
            "sumsq": "(p * p).sum(dim=1)", "l2": "torch.linalg.vector_norm(p, dim=1)",
            "var": "p.var(dim=1, unbiased=False)", "logsumexp": "torch.logsumexp(p, dim=1)",
            "softmax": "torch.softmax(p, dim=1)", "log_softmax": "torch.log_softmax(p, dim=1)",
            "center": "p - p.mean(dim=1, keepdim=True)",
            "l2_normalize": "torch.nn.functional.normalize(p, dim=1, eps=1e-12)",
            "layer_norm": f"torch.nn.functional.layer_norm(p, (n,), gamma, beta, {EPS!r})",
            "rms_norm": f"p * torch.rsqrt((p * p).mean(dim=1, keepdim=True) + {EPS!r}) * w",
        }[op]
    lines += [f"r = {value}", f"return {POST[post][table].format('r')}"]
    return lines


def build(number: int, rng: random.Random) -> core.Blueprint:
    op, pre, post = structure(number)
    reduces, complexity, in_words = OPS[op]
    extra = {"layer_norm": [core.Arg("gamma", "input", ("n",)), core.Arg("beta", "input", ("n",))],
             "rms_norm": [core.Arg("w", "input", ("n",))]}.get(op, [])
    out = core.Arg("out", "output", ("m",) if reduces else ("m", "n"))
    arguments = tuple([core.Arg("x", "input", ("m", "n")), *extra, out, core.Arg("m", "scalar"), core.Arg("n", "scalar")])
    pre_words = PRE[pre][3]
    result = POST[post][3].format("that")
    shape = "m floats, one per row" if reduces else "m x n floats"
    given = "x (m x n floats, row-major)" + "".join(f", {a.name} (n floats)" for a in extra)
    rows_of = "x" if pre == "pre_id" else f"p = {pre_words} (elementwise)"
    statement = (f"Given {given}, compute out ({shape}): for each row of {rows_of}, {in_words}"
                 + ("" if post == "post_id" else f", then {result}") + ".")
    tier_score = complexity + (pre != "pre_id") + (post != "post_id")
    title = f"Rows: {op}" + ("" if pre == "pre_id" else f" of {pre_words}") + ("" if post == "post_id" else f", then {result}")
    return core.Blueprint(
        pieces={"op": op, "pre": pre, "post": post},
        combos=(core.pair(op, pre), core.pair(op, post)),
        title=title,
        statement=statement,
        category="reduction" if reduces else "normalization",
        arguments=arguments,
        sizes={"small": {"m": rng.choice((64, 128, 256)), "n": rng.choice((128, 256, 512, 1024))},
               "large": {"m": 4096, "n": 4096}},
        count="m",
        body=_substitute(c_body(op), pre, post),
        wrong_body=_substitute(c_body(op, wrong=True), pre, post),
        numpy=tuple(numpy_lines(op, pre, post)),
        torch=tuple(numpy_lines(op, pre, post, lib="torch")),
        tier=1 if tier_score <= 1 else 2 if tier_score == 2 else 3,
        atol=1e-3 if reduces else 1e-4,
        rtol=1e-3,
    )
