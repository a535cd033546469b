"""Reference of cumsum_rows: NumPy (the oracle and the CPU baseline) and PyTorch (the GPU baseline)."""

import numpy as np


def inputs(rng, m, n):
    return {"x": rng.random((m, n), dtype=np.float32)}


def reference(x, m, n):
    return np.cumsum(x, axis=1)


def torch_reference(x, m, n):
    import torch

    return torch.cumsum(x, dim=1)
