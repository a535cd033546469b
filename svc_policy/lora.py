"""A LoRA adapter served by the hf backend, merged on the fly: the service keeps the base
weight W0 of every adapted linear layer and serves

    W = W0 + (alpha / rank) * B A          A: [rank, in_features], B: [out_features, rank]

in the layer itself, so generation runs at the base model's speed (no adapter kernels) and a
push of the adapter alone (megabytes) changes what the model samples. The adapter's tensors
are named as PEFT saves them (`get_peft_model_state_dict`, `adapter_model.safetensors`):
"base_model.model.<module path>.lora_A.weight" and "...lora_B.weight". They start at zero,
so a freshly loaded model serves its base weights. A push may carry the adapter, base
weights (W0 of an adapted layer: the served W is recomputed), or both; it is applied in one
step like any other update. The adapter's shape is the learner's `LoraSettings`. Pure
functions and one small state class: no gRPC here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from leap.learning.lora import LoraSettings
from svc_policy.engine import TensorSpec

PREFIX = "base_model.model."


def adapted_modules(model: torch.nn.Module, targets: tuple[str, ...]) -> dict[str, torch.nn.Linear]:
    """The linear layers whose name's last part is one of `targets`, by module path."""
    found = {name: module for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets}
    if not found:
        raise ValueError(f"the model has no linear layer named {', '.join(targets)}: nothing to adapt")
    return found


def adapter_names(path: str) -> tuple[str, str]:
    return f"{PREFIX}{path}.lora_A.weight", f"{PREFIX}{path}.lora_B.weight"


class ServedAdapter:
    """The adapter of one served model: its A and B per layer, and the base weights."""

    def __init__(self, model: torch.nn.Module, shape: LoraSettings):
        if shape.rank < 1:
            raise ValueError("a LoRA adapter needs rank >= 1")
        self.shape = shape
        self.modules = adapted_modules(model, shape.targets)
        self.base = {path: m.weight.detach().clone() for path, m in self.modules.items()}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.owner: dict[str, tuple[str, str]] = {}  # tensor name -> (module path, "A" | "B")
        for path, module in self.modules.items():
            weight = module.weight
            a_name, b_name = adapter_names(path)
            self.a[path] = torch.zeros(shape.rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
            self.b[path] = torch.zeros(weight.shape[0], shape.rank, dtype=weight.dtype, device=weight.device)
            self.owner[a_name], self.owner[b_name] = (path, "A"), (path, "B")

    def specs(self) -> dict[str, TensorSpec]:
        out = {}
        for path in self.modules:
            a_name, b_name = adapter_names(path)
            out[a_name] = TensorSpec(self.a[path].dtype, tuple(self.a[path].shape))
            out[b_name] = TensorSpec(self.b[path].dtype, tuple(self.b[path].shape))
        return out

    def base_name(self, name: str) -> str | None:
        """The module path when `name` is the weight of an adapted layer."""
        path = name.removesuffix(".weight")
        return path if name.endswith(".weight") and path in self.modules else None

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the adapter and base tensors of an update; returns the rest (to be copied as
        usual) after writing W0 + scaling * B A into every adapted layer the update touched."""
        touched: set[str] = set()
        rest = {}
        for name, tensor in tensors.items():
            if name in self.owner:
                path, which = self.owner[name]
                (self.a if which == "A" else self.b)[path].copy_(tensor)
                touched.add(path)
            elif (path := self.base_name(name)) is not None:
                self.base[path].copy_(tensor)
                touched.add(path)
            else:
                rest[name] = tensor
        for path in touched:
            merged = self.base[path] + self.shape.scaling * (self.b[path] @ self.a[path])
            self.modules[path].weight.data.copy_(merged)
        return rest
