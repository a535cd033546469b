"""Reference of conv2d: NumPy (the oracle and the CPU baseline) and PyTorch (the GPU baseline)."""

import numpy as np


def reference(x, f, c, h, w, o, kh, kw):
    windows = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(1, 2))
    return np.tensordot(f, windows, axes=([1, 2, 3], [0, 3, 4]))


def torch_reference(x, f, c, h, w, o, kh, kw):
    import torch

    return torch.nn.functional.conv2d(x[None], f)[0]
