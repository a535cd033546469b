"""A LoRA adapter served merged on the fly, by both backends: the service keeps the base
weight W0 of every adapted linear layer and serves

    W = W0 + (alpha / rank) * B A          A: [rank, in_features], B: [out_features, rank]

in the layer itself (the hf backend writes it into its module; the vllm backend reloads it
into vLLM), so generation runs at the base model's speed (no adapter kernels) and a
push of the adapter alone (megabytes) changes what the model samples. The adapter's tensors
are named as PEFT saves them (`get_peft_model_state_dict`, `adapter_model.safetensors`):
"base_model.model.<module path>.lora_A.weight" and "...lora_B.weight". They start at zero,
so a freshly loaded model serves its base weights. A push may carry the adapter, base
weights (W0 of an adapted layer: the served W is recomputed), or both; it is applied in one
step like any other update. The adapter's shape is the learner's `LoraSettings`. Pure
functions and one small state class: no gRPC here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

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


def adapted_weights(specs: Mapping[str, TensorSpec], targets: tuple[str, ...]) -> list[str]:
    """The module paths of a checkpoint's linear layers named by `targets` (2-D tensors
    "<path>.weight" whose path ends in a target), for a backend that has no torch module of
    the model to look at (vLLM)."""
    found = [name.removesuffix(".weight") for name, spec in specs.items()
             if name.endswith(".weight") and len(spec.shape) == 2
             and name.removesuffix(".weight").rsplit(".", 1)[-1] in targets]
    if not found:
        raise ValueError(f"the model has no linear layer named {', '.join(targets)}: nothing to adapt")
    return sorted(found)


class ServedAdapter:
    """The adapter of one served model: its A and B per layer, and the base weights.

    `bases` maps each adapted layer's module path to its base weight W0 (copied here). With
    `write`, an update's merged weights go to `write(path, W)` (the hf backend writes them
    into its layers); without, `apply` returns them under their checkpoint names
    ("<path>.weight") with the rest of the update (the vllm backend reloads them)."""

    def __init__(self, bases: Mapping[str, torch.Tensor], shape: LoraSettings,
                 write: Callable[[str, torch.Tensor], None] | None = None):
        if shape.rank < 1:
            raise ValueError("a LoRA adapter needs rank >= 1")
        self.shape = shape
        self.write = write
        self.base = {path: weight.detach().clone() for path, weight in bases.items()}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.owner: dict[str, tuple[str, str]] = {}  # tensor name -> (module path, "A" | "B")
        for path, weight in self.base.items():
            a_name, b_name = adapter_names(path)
            self.a[path] = torch.zeros(shape.rank, weight.shape[1], dtype=weight.dtype, device=weight.device)
            self.b[path] = torch.zeros(weight.shape[0], shape.rank, dtype=weight.dtype, device=weight.device)
            self.owner[a_name], self.owner[b_name] = (path, "A"), (path, "B")

    @classmethod
    def of_model(cls, model: torch.nn.Module, shape: LoraSettings) -> "ServedAdapter":
        """The adapter of a torch model's layers, merged into them in place."""
        modules = adapted_modules(model, shape.targets)
        return cls({path: module.weight for path, module in modules.items()}, shape,
                   write=lambda path, weight: modules[path].weight.data.copy_(weight))

    def specs(self) -> dict[str, TensorSpec]:
        out = {}
        for path in self.base:
            a_name, b_name = adapter_names(path)
            out[a_name] = TensorSpec(self.a[path].dtype, tuple(self.a[path].shape))
            out[b_name] = TensorSpec(self.b[path].dtype, tuple(self.b[path].shape))
        return out

    def base_name(self, name: str) -> str | None:
        """The module path when `name` is the weight of an adapted layer."""
        path = name.removesuffix(".weight")
        return path if name.endswith(".weight") and path in self.base else None

    def apply(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take the adapter and base tensors of an update; returns the rest (to be applied as
        usual) after merging W0 + scaling * B A for every adapted layer the update touched
        (written, or returned with the rest: see the class)."""
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
            if self.write is not None:
                self.write(path, merged)
            else:
                rest[f"{path}.weight"] = merged
        return rest
