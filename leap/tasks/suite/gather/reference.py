"""Reference of gather: NumPy (the oracle and the CPU baseline) and PyTorch (the GPU baseline)."""

import numpy as np


def inputs(rng, v, d, m):
    return {"idx": rng.integers(0, v, m, dtype=np.int64)}


def reference(table, idx, v, d, m):
    return table[idx]


def torch_reference(table, idx, v, d, m):
    return table[idx]
