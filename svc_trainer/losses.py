"""The GRPO loss of DESIGN.md, as pure torch functions (no model, no I/O).

Per token t of the model's own output, with advantage A:

    ratio_t = exp(logp_t - logp_old_t)
    pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1          (k3 estimator of KL(pi || pi_ref))
    loss_t  = pg_t + kl_beta * kl_t

averaged over the tokens the loss mask keeps (token-mean), or over sequences of each
sequence's token mean (seq-mean-token-mean).

Asynchronous rollouts (sampled by weights older than the learner's: `importance_cap` C > 0)
add the truncated importance ratio of the sampler's logprobs, TIS (Yao et al., "Your
efficient RL framework secretly brings you off-policy RL training"; AReaL's decoupled PPO):

    w_t     = min(exp(logp_old_t - logp_sampler_t), C)                     (no gradient)
    pg_t    = -w_t * min(ratio_t * A, clip(ratio_t, 1 - clip_low, 1 + clip_high) * A)

`logp_old` is the learner's recomputation at the start of the step (the proximal policy the
ratio is clipped around), `logp_sampler` what the policy service reported when it sampled.
w_t corrects the expectation from the sampler's distribution to the learner's; the cap
bounds its variance (C = 2 by default). With C = 0 (synchronous runs) w_t is not computed at
all, so the loss is exactly the one above. The mask keeps only tokens the model generated:
prompt and feedback tokens never carry a gradient.

`normalizer` lets a learner accumulate gradients over micro-batches (and ranks) and still get
the mean of the *whole* batch: pass the batch's total token count (token-mean) or sequence
count (seq-mean-token-mean) and sum the micro-batch losses. The whole batch is every
generated sequence of the step: the trainer leaves zero-advantage sequences out of the
forward pass (they carry no gradient without a KL term) but counts them in the normalizer,
so the loss is the mean over all generated tokens, as in TRL's GRPOTrainer, and its scale
does not depend on how many groups tied (`svc_trainer.batch.learning_batch`).
"""

from __future__ import annotations

import dataclasses
import torch

TOKEN_MEAN = "token-mean"
SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
AGGREGATIONS = (TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN)


@dataclasses.dataclass(frozen=True)
class GrpoLossConfig:
    """The loss's hyperparameters; the defaults are DESIGN.md's."""

    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.28  # ratio clipped above at 1 + clip_high (DAPO's clip-higher)
    kl_beta: float = 0.0  # weight of the k3 KL to the reference; 0 keeps no reference
    aggregation: str = TOKEN_MEAN
    importance_cap: float = 0.0  # C of the truncated importance ratio (stale rollouts); 0: off

    def __post_init__(self) -> None:
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ValueError("clip_low must be in [0, 1) and clip_high at least 0")
        if self.kl_beta < 0:
            raise ValueError("kl_beta must be at least 0")
        if self.importance_cap < 0:
            raise ValueError("importance_cap must be at least 0 (0 turns the correction off)")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) on tokens sampled from pi: always >= 0,
    unbiased, and low-variance (Schulman's k3)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str = TOKEN_MEAN,
              normalizer: float | torch.Tensor | None = None) -> torch.Tensor:
    """Average `per_token` [N, T] over the kept tokens (mask [N, T]).

    token-mean: sum of kept values / normalizer (default: the number of kept tokens).
    seq-mean-token-mean: sum over sequences of (sequence's kept sum / its kept count) /
    normalizer (default: the number of sequences with at least one kept token).
    An empty mask gives 0 (with a gradient path, so every rank can still call backward).
    """
    mask = mask.to(per_token.dtype)
    if aggregation == TOKEN_MEAN:
        total = (per_token * mask).sum()
        count = mask.sum() if normalizer is None else normalizer
    elif aggregation == SEQ_MEAN_TOKEN_MEAN:
        tokens = mask.sum(dim=-1)
        seq_means = (per_token * mask).sum(dim=-1) / tokens.clamp(min=1.0)
        total = seq_means.sum()
        count = (tokens > 0).sum().to(per_token.dtype) if normalizer is None else normalizer
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if isinstance(count, torch.Tensor):
        return total / count.clamp(min=1.0)
    return total / max(float(count), 1.0)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GrpoLossConfig = GrpoLossConfig(),
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
    sampler_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss and its statistics.

    logprobs      [N, T]  log pi(token) under the model being trained (carries the gradient)
    old_logprobs  [N, T]  the same under the weights that sampled the batch (no gradient)
    advantages    [N] or [N, T]  per sequence, or per token (per-turn advantages)
    mask          [N, T]  1 on the model's own tokens, 0 on prompt, feedback and padding
    ref_logprobs  [N, T]  under the frozen reference; required when config.kl_beta > 0
    entropy       [N, T]  entropy of the policy at each position, only reported
    sampler_logprobs [N, T]  the sampler's logprobs; required when config.importance_cap > 0

    Statistics are means over the kept tokens of this call (detached), plus `tokens`, so a
    learner can combine micro-batches weighted by their token counts
    (`leap.learning.combine_stats`); `loss` is this call's share of the whole batch's loss.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(logprobs)
    mask_f = mask.to(logprobs.dtype)
    old_logprobs = old_logprobs.detach()
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
    pg = torch.maximum(unclipped, clipped)
    weight = None
    if config.importance_cap > 0:
        if sampler_logprobs is None:
            raise ValueError("importance_cap > 0 needs sampler_logprobs")
        raw = torch.exp(old_logprobs - sampler_logprobs.detach())
        weight = torch.clamp(raw, max=config.importance_cap)
        pg = weight * pg
    per_token = pg
    kl = None
    if config.kl_beta > 0:
        if ref_logprobs is None:
            raise ValueError("kl_beta > 0 needs ref_logprobs")
        kl = k3_kl(logprobs, ref_logprobs.detach())
        per_token = per_token + config.kl_beta * kl
    loss = aggregate(per_token, mask_f, config.aggregation, normalizer)

    with torch.no_grad():
        keep = mask_f > 0
        tokens = keep.sum()
        clipped_low = keep & (ratio < 1.0 - config.clip_low) & (advantages < 0)
        clipped_high = keep & (ratio > 1.0 + config.clip_high) & (advantages > 0)

        def mean(values: torch.Tensor) -> torch.Tensor:
            return (values.to(torch.float32) * keep).sum() / tokens.clamp(min=1)

        kept_ratio = ratio[keep]
        stats = {
            "loss": loss.detach(),
            "pg_loss": mean(pg),
            "clip_frac_low": mean(clipped_low),
            "clip_frac_high": mean(clipped_high),
            "clip_frac": mean(clipped_low | clipped_high),
            "ratio_mean": mean(ratio),
            "ratio_min": kept_ratio.min() if kept_ratio.numel() else torch.tensor(1.0),
            "ratio_max": kept_ratio.max() if kept_ratio.numel() else torch.tensor(1.0),
            # k1 estimate of KL(pi_old || pi), mean of log pi_old - log pi over the tokens pi_old
            # sampled: how far this pass has moved from the weights that sampled the batch
            "approx_kl_old": mean(-log_ratio),
            "advantage_mean": mean(advantages),
            "tokens": tokens.to(torch.float32),
        }
        if kl is not None:
            stats["kl"] = mean(kl)
        if weight is not None:
            stats["importance_weight_mean"] = mean(weight)
            stats["importance_capped_frac"] = mean(raw > config.importance_cap)
        if entropy is not None:
            stats["entropy"] = mean(entropy)
    return loss, stats


@dataclasses.dataclass(frozen=True)
class GrpoObjective:
    """`grpo_loss` as a learner loss (`leap.learning.Learner.train_step`): reads the
    micro-batch's `advantages` (per sequence or per token), `old_logprobs`, when kl_beta
    > 0 `ref_logprobs`, and when importance_cap > 0 `sampler_logprobs`. A dataclass, so it pickles to follower ranks."""

    config: GrpoLossConfig = GrpoLossConfig()

    def __call__(self, logprobs, batch, normalizer, entropy):
        per_sequence = self.config.aggregation == SEQ_MEAN_TOKEN_MEAN
        return grpo_loss(
            logprobs, batch.values["old_logprobs"], batch.values["advantages"], batch.loss_mask, self.config,
            ref_logprobs=batch.values.get("ref_logprobs"), entropy=entropy,
            normalizer=normalizer.sequences if per_sequence else normalizer.tokens,
            sampler_logprobs=batch.values.get("sampler_logprobs"),
        )
