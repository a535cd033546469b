"""Reference of prefix_sum: NumPy (the oracle and the CPU baseline) and PyTorch (the GPU baseline)."""

import numpy as np


def inputs(rng, n):
    return {"x": rng.random(n, dtype=np.float32)}


def reference(x, n):
    return np.cumsum(x)


def torch_reference(x, n):
    import torch

    return torch.cumsum(x, dim=0)
