"""Reference of batched_gemm: NumPy (the oracle and the CPU baseline) and PyTorch (the GPU baseline)."""


def reference(a, b, batch, m, n, k):
    return a @ b


def torch_reference(a, b, batch, m, n, k):
    import torch

    return torch.bmm(a, b)
