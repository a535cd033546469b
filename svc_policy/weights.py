"""Staging of one UpdateWeights stream: every chunk is checked against the model's tensors
(name, dtype, shape, offset, CRC-32) and copied into a staging buffer; only a complete,
committed stream turns into tensors for the backend. Anything wrong raises INVALID_ARGUMENT
naming the message and field (`messages[3].chunk.crc32`), and the served weights are never
touched before the commit. At the commit every floating tensor is checked finite
(`all_finite`: one read of its bytes): a NaN or an infinity names the tensor and the message
that started it, and nothing is applied, so a learner that diverged cannot make the policy
answer NaN logprobs to every client.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from leap.clients.weights import PROTO_TO_TORCH, crc32
from leap.common.v1 import common_pb2
from leap.policy.v1 import policy_pb2
from leap.runtime import Violations, invalid_argument
from svc_policy.engine import TensorSpec


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _proto_dtype_name(value: int) -> str:
    return common_pb2.DType.Name(value) if value in common_pb2.DType.values() else str(value)


class WeightStaging:
    """The tensors received so far on one stream."""

    def __init__(self, specs: Mapping[str, TensorSpec]):
        self.specs = specs
        self.buffers: dict[str, np.ndarray] = {}
        self.received: dict[str, int] = {}
        self.first_field: dict[str, str] = {}  # the chunk that started each tensor, for messages
        self.bytes_received = 0

    def add(self, chunk: policy_pb2.TensorChunk, field: str) -> None:
        """Check and stage one chunk; `field` is its path in the stream (`messages[3].chunk`)."""
        spec = self.specs.get(chunk.name)
        if spec is None:
            hint = ", ".join(list(self.specs)[:3])
            raise invalid_argument(f"{field}.name", f"the model has no tensor {chunk.name!r} (it has {len(self.specs)}, "
                                                    f"for example {hint})")
        v = Violations()
        dtype = PROTO_TO_TORCH.get(chunk.dtype)
        v.check(dtype == spec.dtype, f"{field}.dtype", f"{chunk.name!r} is {_dtype_name(spec.dtype)} in the model, "
                f"the chunk says {_proto_dtype_name(chunk.dtype)}")
        v.check(tuple(chunk.shape) == spec.shape, f"{field}.shape",
                f"{chunk.name!r} has shape {list(spec.shape)} in the model, the chunk says {list(chunk.shape)}")
        v.raise_if_any()
        done = self.received.get(chunk.name, 0)
        size = spec.nbytes
        data = chunk.data
        v.check(chunk.offset == done, f"{field}.offset",
                f"chunks of {chunk.name!r} must arrive in order without gaps or repeats: expected offset {done}, "
                f"got {chunk.offset}")
        v.check(chunk.offset + len(data) <= size, f"{field}.data",
                f"{chunk.name!r} has {size} bytes; this chunk ends at byte {chunk.offset + len(data)}")
        v.raise_if_any()
        actual = crc32(data)
        if actual != chunk.crc32:
            raise invalid_argument(f"{field}.crc32", f"checksum mismatch for {chunk.name!r} at offset {chunk.offset}: "
                                                     f"the chunk says {chunk.crc32:#010x}, its data has {actual:#010x}")
        buffer = self.buffers.get(chunk.name)
        if buffer is None:
            buffer = self.buffers[chunk.name] = np.empty(size, dtype=np.uint8)
            self.first_field[chunk.name] = field
        buffer[chunk.offset : chunk.offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.received[chunk.name] = done + len(data)
        self.bytes_received += len(data)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The staged tensors, once every one named is complete."""
        v = Violations()
        v.check(bool(self.buffers), "chunk", "the update names no tensor")
        for name, got in self.received.items():
            need = self.specs[name].nbytes
            v.check(got == need, "commit", f"tensor {name!r} is incomplete: {got} of {need} bytes arrived")
        v.raise_if_any()
        tensors = {name: torch.from_numpy(buffer).view(self.specs[name].dtype).reshape(self.specs[name].shape)
                   for name, buffer in self.buffers.items()}
        check_finite(tensors, {name: f"{field}.data" for name, field in self.first_field.items()})
        return tensors


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every element of a floating tensor is finite.

    A finite sum proves it: a NaN or an infinity among the elements makes any sum of them NaN
    or infinite (IEEE addition propagates both; torch's reductions are not built fast-math).
    The sum reads the bytes once at memory speed (about 27 GB/s on one core here, against
    0.4-0.8 GB/s for `isfinite(...).all()`, which writes a mask first), so only a tensor whose
    sum is not finite (one with a NaN or an infinity, or finite values whose sum overflows)
    pays for the exact element check."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def check_finite(tensors: Mapping[str, torch.Tensor], fields: Mapping[str, str]) -> None:
    """INVALID_ARGUMENT naming `fields[name]` for every floating tensor holding a NaN or an
    infinity (every transport's commit checks this before anything is applied)."""
    v = Violations()
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not all_finite(tensor):
            bad = int((~torch.isfinite(tensor)).sum())
            v.add(fields[name], f"tensor {name!r} holds {bad} NaN or infinite values of {tensor.numel()}; "
                                f"nothing was applied")
    v.raise_if_any()


def check_table(entries, specs: Mapping[str, TensorSpec], v: Violations,
                field: str = "tensors") -> list[TensorSpec]:
    """Check a CommitWeights table (`TensorEntry`s) against the model's tensors: each name
    once, known, with the model's dtype and shape. Adds every problem to `v` (fields like
    `tensors[2].shape`); returns each entry's spec (None where unknown)."""
    found: list[TensorSpec] = []
    seen: set[str] = set()
    v.check(len(entries) > 0, field, "the commit names no tensor")
    for index, item in enumerate(entries):
        where = f"{field}[{index}]"
        spec = specs.get(item.name)
        found.append(spec)  # type: ignore[arg-type]
        if spec is None:
            v.add(f"{where}.name", f"the model has no tensor {item.name!r}")
            continue
        v.check(item.name not in seen, f"{where}.name", f"{item.name!r} is listed twice")
        seen.add(item.name)
        v.check(PROTO_TO_TORCH.get(item.dtype) == spec.dtype, f"{where}.dtype",
                f"{item.name!r} is {_dtype_name(spec.dtype)} in the model, the table says {_proto_dtype_name(item.dtype)}")
        v.check(tuple(item.shape) == spec.shape, f"{where}.shape",
                f"{item.name!r} has shape {list(spec.shape)} in the model, the table says {list(item.shape)}")
    return found


def load_checkpoint(path: str, specs: Mapping[str, TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors of every *.safetensors file in a local directory, checked by name and
    shape against the model and cast to its dtypes (a checkpoint may be saved in another)."""
    from safetensors import safe_open

    directory = Path(path)
    if not directory.is_dir():
        raise invalid_argument("path", f"{path!r} is not a local directory")
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise invalid_argument("path", f"{path!r} holds no .safetensors file")
    tensors: dict[str, torch.Tensor] = {}
    v = Violations()
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                spec = specs.get(name)
                if spec is None:
                    v.add("path", f"{file.name}: the model has no tensor {name!r}")
                    continue
                tensor = handle.get_tensor(name)
                if tuple(tensor.shape) != spec.shape:
                    v.add("path", f"{file.name}: {name!r} has shape {list(tensor.shape)}, the model {list(spec.shape)}")
                    continue
                tensors[name] = tensor.to(spec.dtype)
    v.raise_if_any()
    return tensors
