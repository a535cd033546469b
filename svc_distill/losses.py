"""TU-OPD and Consensus-Residual Decomposition losses (DESIGN.md "TU-OPD"), pure functions.

Shapes: teacher_logps [K, B, T] (l_k,t), student_logps [B, T] (s_t, with grad),
mask [B, T], quality [K, B] (q[k][x] of each example in the batch).

On a fixed set of samples the loss's gradient, sum_t (s_t - T_t) grad s_t / N, is the
gradient of sum_t (s_t - T_t)^2 / 2N (the k2 estimate of the KL to the target): a step
moves every sampled token's logprob toward the target.

`normalizer` lets a learner accumulate gradients over micro-batches (and ranks) and still
get the mean of the whole batch: pass the batch's kept token count and sum the micro-batch
losses, as `svc_trainer.losses.grpo_loss` does.
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


def tu_opd_loss(teacher_logps, student_logps, mask, quality, config: TuOpdConfig, *,
                normalizer: float | torch.Tensor | None = None):
    """Return (loss, skipped): the policy-gradient loss summed over the tokens of kept examples
    and divided by `normalizer` (default: this call's kept token count, a token mean)."""
    weights = teacher_weights(quality, config)
    kept = weights.sum(dim=0) > 0
    skipped = int((~kept).sum())
    # Without CRD the target is the consensus, and sum_k w_k (l_k,t - s_t) = c_t - s_t since the
    # weights of a kept example sum to 1: one expression covers both.
    # The reward is a constant of the step: neither the teachers' scores nor the student's own
    # logprobs carry a gradient through it (teacher logprobs that arrive as tensors with a graph,
    # an in-process teacher for example, must not be trained through the target).
    reward = (target_logps(teacher_logps, quality, weights, config) - student_logps).detach()
    token_mask = mask * kept[:, None].to(mask.dtype)
    count = token_mask.sum() if normalizer is None else torch.as_tensor(normalizer, dtype=student_logps.dtype)
    # An empty mask gives a zero loss that still has a gradient path, so backward works on every rank.
    return -(reward * student_logps * token_mask).sum() / count.clamp_min(1.0), skipped


def teacher_key(k: int) -> str:
    """Name of the per-token value holding teacher k's logprobs l_k,t in a learner Sequence."""
    return f"teacher_logps/{k}"


def quality_key(k: int) -> str:
    """Name of the per-sequence value holding q[k][x] of the sequence's example."""
    return f"quality/{k}"


SAMPLER_LOGPS = "sampler_logps"  # per token: the policy service's logprobs of the sampled tokens


def tu_opd_stats(teacher_logps, student_logps, mask, quality, config: TuOpdConfig,
                 sampler_logps: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Detached statistics of one micro-batch, as means over its kept tokens (so
    `leap.learning.combine_stats` weighs micro-batches by `tokens`):

    kl_target            s_t - T_t: the per-token reverse KL estimate of the student to the target
    kl_teacher_sum/k     (s_t - l_k,t) summed over the tokens teacher k scored, per kept token
    teacher_share/k      share of the kept tokens teacher k scored (weight > 0)
    sampler_gap          |s_t - sampler logprob|: learner and policy service numerics (when given)

    The KL to teacher k over its own tokens is kl_teacher_sum/k / teacher_share/k, a ratio that
    stays exact after the token-weighted combination over micro-batches.
    """
    with torch.no_grad():
        s = student_logps.detach()
        weights = teacher_weights(quality, config)
        kept = weights.sum(dim=0) > 0
        token_mask = mask * kept[:, None].to(mask.dtype)
        tokens = token_mask.sum()
        denominator = tokens.clamp_min(1.0)
        target = target_logps(teacher_logps, quality, weights, config)
        stats = {"kl_target": ((s - target) * token_mask).sum() / denominator, "tokens": tokens}
        for k in range(teacher_logps.shape[0]):
            scored = token_mask * (weights[k] > 0)[:, None].to(mask.dtype)
            stats[f"kl_teacher_sum/{k}"] = ((s - teacher_logps[k]) * scored).sum() / denominator
            stats[f"teacher_share/{k}"] = scored.sum() / denominator
        if sampler_logps is not None:
            stats["sampler_gap"] = ((s - sampler_logps).abs() * token_mask).sum() / denominator
    return stats


@dataclass(frozen=True)
class TuOpdObjective:
    """`tu_opd_loss` as a learner loss (`leap.learning.Learner.train_step`): reads the
    micro-batch's `teacher_logps/k` (per token) and `quality/k` (per sequence) for k < teachers,
    and `sampler_logps` when present. Divides by the whole batch's token count, so summing the
    micro-batch losses gives the batch mean; the batch should hold only kept examples. A
    dataclass, so it pickles to follower ranks."""

    config: TuOpdConfig
    teachers: int

    def __call__(self, logprobs, batch, normalizer, entropy):
        teacher_logps = torch.stack([batch.values[teacher_key(k)] for k in range(self.teachers)])
        quality = torch.stack([batch.values[quality_key(k)] for k in range(self.teachers)])
        loss, _ = tu_opd_loss(teacher_logps, logprobs, batch.loss_mask, quality, self.config,
                              normalizer=normalizer.tokens)
        stats = tu_opd_stats(teacher_logps, logprobs, batch.loss_mask, quality, self.config,
                             batch.values.get(SAMPLER_LOGPS))
        stats["loss"] = loss.detach()
        if entropy is not None:
            stats["entropy"] = (entropy * batch.loss_mask).sum() / batch.loss_mask.sum().clamp_min(1.0)
        return loss, stats
