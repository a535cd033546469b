"""TU-OPD and Consensus-Residual Decomposition losses (DESIGN.md "TU-OPD"), pure functions.

Shapes: teacher_logps [K, B, T] (l_k,t), student_logps [B, T] (s_t, with grad),
mask [B, T], quality [K, B] (q[k][x] of each example in the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TuOpdConfig:
    rho: float = 0.5  # reliability threshold: teacher k is reliable on x when q[k][x] >= rho
    crd_lambda: float = 1.0  # weight of the winner's positive residual
    gating: bool = True  # off: every teacher is reliable
    weighting: bool = True  # off: reliable teachers weigh equally
    crd: bool = True  # off: plain quality-weighted sampled-token OPD
    single_best: bool = False  # only the best teacher (argmax q) teaches


def teacher_weights(quality: torch.Tensor, config: TuOpdConfig) -> torch.Tensor:
    """w_k(x) [K, B]; columns of examples with no reliable teacher are all zero."""
    if config.single_best:
        best = quality.argmax(dim=0)
        reliable = torch.zeros_like(quality, dtype=torch.bool)
        reliable[best, torch.arange(quality.shape[1])] = True
        if config.gating:
            reliable &= quality >= config.rho
    elif config.gating:
        reliable = quality >= config.rho
    else:
        reliable = torch.ones_like(quality, dtype=torch.bool)
    raw = torch.where(reliable, quality if config.weighting else torch.ones_like(quality), 0.0)
    total = raw.sum(dim=0, keepdim=True)
    return torch.where(total > 0, raw / total.clamp_min(1e-12), 0.0)


def target_logps(teacher_logps, quality, weights, config: TuOpdConfig) -> torch.Tensor:
    """CRD target T_t = c_t + lambda * max(l_k*,t - c_t, 0), [B, T]."""
    consensus = (weights[:, :, None] * teacher_logps).sum(dim=0)
    if not config.crd:
        return consensus
    masked_quality = torch.where(weights > 0, quality, -1.0)
    winner = masked_quality.argmax(dim=0)
    winner_logps = teacher_logps[winner, torch.arange(quality.shape[1])]
    return consensus + config.crd_lambda * (winner_logps - consensus).clamp_min(0.0)


def tu_opd_loss(teacher_logps, student_logps, mask, quality, config: TuOpdConfig):
    """Return (loss, skipped): token-mean policy-gradient loss over kept examples."""
    weights = teacher_weights(quality, config)
    kept = weights.sum(dim=0) > 0
    skipped = int((~kept).sum())
    # Without CRD the target is the consensus, and sum_k w_k (l_k,t - s_t) = c_t - s_t since the
    # weights of a kept example sum to 1: one expression covers both.
    reward = target_logps(teacher_logps, quality, weights, config) - student_logps.detach()
    token_mask = mask * kept[:, None].to(mask.dtype)
    count = token_mask.sum()
    if count == 0:
        return (student_logps * 0).sum(), skipped
    return -(reward * student_logps * token_mask).sum() / count, skipped
