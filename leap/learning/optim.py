"""AdamW and its learning-rate schedule (linear warm-up, then constant or cosine), with the
defaults of `leap.common.v1.OptimizerConfig`."""

from __future__ import annotations

import dataclasses
import math

import torch

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """Plain values of `leap.common.v1.OptimizerConfig` with its documented defaults."""

    learning_rate: float = 1e-5
    warmup_steps: int = 0
    schedule: str = "constant"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 turns clipping off (the norm is still measured)
    epochs_per_batch: int = 1
    micro_batch_tokens: int = 4096
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    min_lr_ratio: float = 0.0  # cosine decays to learning_rate * min_lr_ratio

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    @classmethod
    def from_proto(cls, config) -> OptimizerSettings:
        """From a `leap.common.v1.OptimizerConfig` (zero or unset fields take the defaults)."""
        defaults = cls()
        return cls(
            learning_rate=config.learning_rate if config.HasField("learning_rate") else defaults.learning_rate,
            warmup_steps=config.warmup_steps or 0,
            schedule=config.schedule or defaults.schedule,
            weight_decay=config.weight_decay or 0.0,
            max_grad_norm=config.max_grad_norm if config.HasField("max_grad_norm") else defaults.max_grad_norm,
            epochs_per_batch=config.epochs_per_batch or defaults.epochs_per_batch,
            micro_batch_tokens=config.micro_batch_tokens or defaults.micro_batch_tokens,
        )

    def to_proto(self, message) -> None:
        """Write the resolved values into an OptimizerConfig (defaults made explicit)."""
        message.learning_rate = self.learning_rate
        message.warmup_steps = self.warmup_steps
        message.schedule = self.schedule
        message.weight_decay = self.weight_decay
        message.max_grad_norm = self.max_grad_norm
        message.epochs_per_batch = self.epochs_per_batch
        message.micro_batch_tokens = self.micro_batch_tokens


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Multiplier of the peak learning rate after `update` optimizer updates (picklable, so a
    LambdaLR built on it checkpoints cleanly)."""

    warmup_steps: int
    total_steps: int
    kind: str = "constant"
    min_ratio: float = 0.0

    def __call__(self, update: int) -> float:
        if self.warmup_steps > 0 and update < self.warmup_steps:
            return (update + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (update - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings, total_updates: int
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters (no weight decay on biases and norms) and its schedule."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.dim() < 2 or "norm" in name.lower() else decay).append(param)
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=settings.learning_rate, betas=settings.betas, eps=settings.eps)
    schedule = Schedule(settings.warmup_steps, total_updates, settings.schedule, settings.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return optimizer, scheduler
