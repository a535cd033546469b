"""Stencils: a window of KS taps (KS x KS in 2-D) slid over x with a stride, on x as it is
(valid), zero-padded or edge-padded by KS // 2, combined by a filter f (a correlation, as deep
learning's convolutions are), a mean (padding counted, as PyTorch's average pooling does) or a
maximum, optionally followed by a ReLU.

Structure: (dim, op, ksize, stride, pad, post), every combination of the tuples below.
Split: a task is held out when it puts together a pair in `HELDOUT` (a window size training
never sees with that stride, a maximum never over edge padding), though training sees each
piece with others.

The kernel computes one output element per index i (position i in 1-D; row i / wo, column
i % wo in 2-D) by visiting its window.
"""

from __future__ import annotations

import random

from leap.tasks.families import core

NAME = "stencil"
ENTRY = "stencil"

DIMS = ("dim_1d", "dim_2d")
OPS = ("op_conv", "op_mean", "op_max")
KSIZES = {"k3": 3, "k5": 5, "k7": 7}
STRIDES = {"s1": 1, "s2": 2}
PADS = ("pad_valid", "pad_zero", "pad_edge")
POSTS = ("post_none", "post_relu")
HELDOUT = frozenset(core.pair(a, b) for a, b in (("k5", "s2"), ("op_max", "pad_edge")))  # about a quarter
_RADICES = (len(DIMS), len(OPS), len(KSIZES), len(STRIDES), len(PADS), len(POSTS))
SIZE = core.product(_RADICES)


def structure(number: int) -> tuple[str, str, str, str, str, str]:
    """(dim, op, ksize, stride, pad, post) of structure `number`."""
    d, o, k, s, p, q = core.digits(number, _RADICES)
    return DIMS[d], OPS[o], list(KSIZES)[k], list(STRIDES)[s], PADS[p], POSTS[q]


def _extent(size: str, ks: int, stride: int, pad: int, c: bool) -> str:
    """The output length along one axis of input length `size`, in C or in a shape expression."""
    return f"(({size} + {2 * pad} - {ks}) / {stride} + 1)" if c else f"({size} + {2 * pad} - {ks}) // {stride} + 1"


def _read(index: str, bound: str, pad_kind: str) -> tuple[str, str]:
    """(the condition of a zero-padded read or "", the index to read) along one axis."""
    if pad_kind == "pad_zero":
        return f"{index} >= 0 && {index} < {bound}", index
    if pad_kind == "pad_edge":
        return "", f"({index} < 0 ? 0 : {index} >= {bound} ? {bound} - 1 : {index})"
    return "", index


def c_body(dim: str, op: str, ksize: str, stride: str, pad_kind: str, post: str, wrong: bool = False) -> tuple[str, ...]:
    """The C lines of output element i. `wrong`: the window misses its last tap (in 2-D, its
    last column)."""
    ks, s = KSIZES[ksize], STRIDES[stride]
    pad = ks // 2 if pad_kind != "pad_valid" else 0
    last = f"{ks - 1}" if wrong else f"{ks}"
    start = "-INFINITY" if op == "op_max" else "0.0f"
    if dim == "dim_1d":
        head = ["const int64_t o = i;", f"float acc = {start};", f"for (int64_t d = 0; d < {last}; d++) {{",
                f"    int64_t p = o * {s} - {pad} + d;"]
        cond, at = _read("p", "n", pad_kind)
        value, tap = f"x[{at}]", "f[d]"
    else:
        wo = _extent("w", ks, s, pad, c=True)
        head = [f"const int64_t wo = {wo};", "const int64_t oy = i / wo, ox = i % wo;", f"float acc = {start};",
                f"for (int64_t dy = 0; dy < {ks}; dy++) {{", f"    for (int64_t dx = 0; dx < {last}; dx++) {{",
                f"        int64_t py = oy * {s} - {pad} + dy, px = ox * {s} - {pad} + dx;"]
        cond_y, at_y = _read("py", "h", pad_kind)
        cond_x, at_x = _read("px", "w", pad_kind)
        cond = f"{cond_y} && {cond_x}" if cond_y else ""
        value, tap = f"x[{at_y} * w + {at_x}]", f"f[dy * {ks} + dx]"
    indent = "    " if dim == "dim_1d" else "        "
    read = f"({cond}) ? {value} : 0.0f" if cond else value
    combine = {"op_conv": f"acc += {tap} * v;", "op_mean": "acc += v;", "op_max": "acc = fmaxf(acc, v);"}[op]
    lines = head + [f"{indent}float v = {read};", indent + combine]
    lines += ["}"] if dim == "dim_1d" else ["    }", "}"]
    taps = ks if dim == "dim_1d" else ks * ks
    result = f"acc / {core.c_float(float(taps))}" if op == "op_mean" else "acc"
    if post == "post_relu":
        result = f"fmaxf({result}, 0.0f)"
    return tuple(lines + [f"out[i] = {result};"])


def reference_lines(dim: str, op: str, ksize: str, stride: str, pad_kind: str, post: str, lib: str) -> list[str]:
    """The reference's lines (NumPy, or PyTorch with lib="torch")."""
    ks, s = KSIZES[ksize], STRIDES[stride]
    pad = ks // 2 if pad_kind != "pad_valid" else 0
    two = dim == "dim_2d"
    if lib == "np":
        mode = "edge" if pad_kind == "pad_edge" else "constant"
        lines = [f"xp = np.pad(x, {pad}, mode={mode!r})" if pad else "xp = x"]
        if two:
            lines.append(f"win = np.lib.stride_tricks.sliding_window_view(xp, ({ks}, {ks}))[::{s}, ::{s}]")
            value = {"op_conv": "np.einsum('ijkl,kl->ij', win, f)", "op_mean": "win.mean(axis=(-2, -1))",
                     "op_max": "win.max(axis=(-2, -1))"}[op]
        else:
            lines.append(f"win = np.lib.stride_tricks.sliding_window_view(xp, {ks})[::{s}]")
            value = {"op_conv": "win @ f", "op_mean": "win.mean(axis=-1)", "op_max": "win.max(axis=-1)"}[op]
        lines.append(f"y = {value}")
        if post == "post_relu":
            lines.append("y = np.maximum(y, 0.0)")
        return lines + ["return y"]
    fn = "torch.nn.functional"
    batch = "x[None, None]"
    mode = "replicate" if pad_kind == "pad_edge" else "constant"
    widths = f"({pad}, {pad}, {pad}, {pad})" if two else f"({pad}, {pad})"
    lines = [f"xp = {fn}.pad({batch}, {widths}, mode={mode!r})" if pad else f"xp = {batch}"]
    nd = "2d" if two else "1d"
    value = {"op_conv": f"{fn}.conv{nd}(xp, f[None, None], stride={s})",
             "op_mean": f"{fn}.avg_pool{nd}(xp, {ks}, stride={s})",
             "op_max": f"{fn}.max_pool{nd}(xp, {ks}, stride={s})"}[op]
    lines.append(f"y = {value}[0, 0]")
    if post == "post_relu":
        lines.append("y = torch.relu(y)")
    return lines + ["return y"]


def words(dim: str, op: str, ksize: str, stride: str, pad_kind: str, post: str) -> str:
    ks, s = KSIZES[ksize], STRIDES[stride]
    window = f"{ks}-tap" if dim == "dim_1d" else f"{ks}x{ks}"
    what = {"op_conv": "weighted sum by f (a correlation)", "op_mean": "mean", "op_max": "maximum"}[op]
    padding = {"pad_valid": "no padding", "pad_zero": f"zero padding of {ks // 2}",
               "pad_edge": f"edge (replicate) padding of {ks // 2}"}[pad_kind]
    text = f"the {what} of each {window} window, stride {s}, {padding}"
    return text + (", then ReLU" if post == "post_relu" else "")


def build(number: int, rng: random.Random) -> core.Blueprint:
    pieces = structure(number)
    dim, op, ksize, stride, pad_kind, post = pieces
    ks, s = KSIZES[ksize], STRIDES[stride]
    pad = ks // 2 if pad_kind != "pad_valid" else 0
    if dim == "dim_1d":
        inputs = [core.Arg("x", "input", ("n",))]
        filt = core.Arg("f", "input", (str(ks),))
        out = core.Arg("out", "output", (_extent("n", ks, s, pad, c=False),))
        scalars = [core.Arg("n", "scalar")]
        sizes = {"small": {"n": rng.choice((4096, 8192, 16384))}, "large": {"n": 1 << 22}}
        count, given = _extent("n", ks, s, pad, c=True), "x (n floats)"
    else:
        inputs = [core.Arg("x", "input", ("h", "w"))]
        filt = core.Arg("f", "input", (str(ks), str(ks)))
        out = core.Arg("out", "output", (_extent("h", ks, s, pad, c=False), _extent("w", ks, s, pad, c=False)))
        scalars = [core.Arg("h", "scalar"), core.Arg("w", "scalar")]
        sizes = {"small": {"h": rng.choice((64, 96, 128)), "w": rng.choice((64, 96, 128))},
                 "large": {"h": 2048, "w": 2048}}
        count = f"({_extent('h', ks, s, pad, c=True)} * {_extent('w', ks, s, pad, c=True)})"
        given = "x (h x w floats, row-major)"
    if op == "op_conv":
        inputs.append(filt)
        given += f", f ({ks if dim == 'dim_1d' else f'{ks} x {ks}'} floats)"
    formula = words(*pieces)
    steps = (dim == "dim_2d") + (s != 1) + (pad_kind != "pad_valid") + (post != "post_none")
    return core.Blueprint(
        pieces=dict(zip(("dim", "op", "ksize", "stride", "pad", "post"), pieces)),
        combos=tuple(core.pair(a, b) for k, a in enumerate(pieces) for b in pieces[k + 1:]),
        title=f"Stencil ({dim.removeprefix('dim_')}): {formula}",
        statement=f"Given {given}, compute out: over x, {formula} (output element j reads the window starting at "
                  f"j * {s} - {pad} along each axis).",
        category="convolution" if op == "op_conv" else "pooling",
        arguments=tuple([*inputs, out, *scalars]),
        sizes=sizes,
        count=count,
        body=c_body(*pieces),
        wrong_body=c_body(*pieces, wrong=True),
        numpy=tuple(reference_lines(*pieces, lib="np")),
        torch=tuple(reference_lines(*pieces, lib="torch")),
        tier=1 if steps <= 1 else 2 if steps == 2 else 3,
        atol=1e-4,
        rtol=1e-4,
    )
