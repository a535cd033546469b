"""LoRA on the learner, with PEFT: the base weights frozen, a low-rank adapter per targeted
linear layer trained, and what a learner pushes or saves:

- `adapter_state`: the adapter's tensors under PEFT's saved names
  ("base_model.model.<module>.lora_A.weight"), what a policy serving the same adapter shape
  takes (`LoadModelRequest.lora`): megabytes instead of the whole model;
- `merged_state`: the base model's state dict with every adapted weight replaced by
  W0 + (alpha / rank) B A, under the Hugging Face names: what a policy without the adapter
  takes, and what a merged save (`from_pretrained`-loadable) holds. Computed beside the
  model (PEFT's `merge_and_unload` would change the model being trained).

PEFT is an optional dependency (`pip install 'leap-suite[lora]'`), imported only here.
"""

from __future__ import annotations

import dataclasses

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER = "default"


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """An adapter's shape (LoraConfig of the contracts, defaults filled)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0 or not self.targets:
            raise ValueError("LoRA needs rank >= 1, alpha > 0 and at least one target module")

    @classmethod
    def from_proto(cls, config) -> LoraSettings | None:
        """None when `config` (leap.common.v1.LoraConfig) asks for no adapter (rank 0)."""
        if not config.rank:
            return None
        alpha = config.alpha if config.HasField("alpha") else 2.0 * config.rank
        return cls(config.rank, float(alpha), tuple(config.target_modules) or DEFAULT_TARGETS)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_proto(self):
        from leap.common.v1 import common_pb2

        return common_pb2.LoraConfig(rank=self.rank, alpha=self.alpha, target_modules=list(self.targets))

    def matches(self, served) -> bool:
        """Whether a policy's ModelInfo.lora is this adapter's shape (then the adapter alone is pushed)."""
        return (served.rank == self.rank and abs(served.alpha - self.alpha) < 1e-9
                and tuple(served.target_modules) == self.targets)


def peft():
    try:
        import peft as module
    except ImportError:  # pragma: no cover - the test extra installs it
        raise RuntimeError("LoRA needs PEFT: pip install 'leap-suite[lora]'") from None
    return module


def wrap(model: torch.nn.Module, settings: LoraSettings) -> torch.nn.Module:
    """The model with an adapter on every target layer (PEFT's init: B = 0, so it computes the
    base model exactly at first); only the adapter trains."""
    config = peft().LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.targets),
                               lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return peft().get_peft_model(model, config)


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors, PEFT-named, on CPU."""
    state = peft().get_peft_model_state_dict(model)
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    result = peft().set_peft_model_state_dict(model, state)
    missing = [k for k in getattr(result, "unexpected_keys", [])]
    if missing:
        raise ValueError(f"the adapter state has tensors the model does not: {missing[:3]}")


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapter merged, Hugging Face names, on CPU."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    deltas: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for path, module in base.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                deltas[f"{path}.base_layer.weight"] = module.get_delta_weight(ADAPTER)
        for name, tensor in base.state_dict().items():
            if ".lora_" in name:
                continue
            value = tensor + deltas[name] if name in deltas else tensor
            merged[name.replace(".base_layer.", ".")] = value.detach().to("cpu", copy=True)
    return merged
