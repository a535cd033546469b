"""Reference of gemv: NumPy (the oracle and the CPU baseline) and PyTorch (the GPU baseline)."""

import numpy as np


def reference(a, x, m, k):
    return a @ x


def torch_reference(a, x, m, k):
    import torch

    return a @ x
