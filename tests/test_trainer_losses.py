"""The GRPO loss of DESIGN.md against values computed by hand on small tensors.

The batch: two sequences of three tokens, old logprobs 0, so each ratio is exp(logp):

    seq 0, A = +1: ratios 1.5, 1.0, 0.5       mask 1 1 1
    seq 1, A = -2: ratios 0.5, 1.1, 2.0       mask 1 1 0

With clip_low 0.2 and clip_high 0.28 the clip range is [0.8, 1.28]; per token
-min(r A, clip(r) A):

    seq 0: -1.28 (clipped high), -1.0, -0.5 (A > 0 and r low: the unclipped term wins)
    seq 1: +1.6 (clipped low: max(2 * 0.5, 2 * 0.8)), +2.2, masked (would be 4.0)

token-mean = (-1.28 - 1.0 - 0.5 + 1.6 + 2.2) / 5 = 0.204
seq-mean-token-mean = ((-2.78 / 3) + (3.8 / 2)) / 2 = 0.4866...
"""

from __future__ import annotations

import math

import pytest
import torch

from svc_trainer.losses import SEQ_MEAN_TOKEN_MEAN, TOKEN_MEAN, GrpoLossConfig, aggregate, grpo_loss, k3_kl

RATIOS = [[1.5, 1.0, 0.5], [0.5, 1.1, 2.0]]
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADVANTAGES = torch.tensor([1.0, -2.0])


def logprobs(requires_grad: bool = True) -> torch.Tensor:
    return torch.log(torch.tensor(RATIOS, dtype=torch.float64)).requires_grad_(requires_grad)


def old() -> torch.Tensor:
    return torch.zeros(2, 3, dtype=torch.float64)


def test_token_mean_with_clipping_on_both_sides():
    loss, stats = grpo_loss(logprobs(), old(), ADVANTAGES, MASK, GrpoLossConfig(clip_low=0.2, clip_high=0.28))
    assert loss.item() == pytest.approx(0.204)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 5)  # seq 1, token 0
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 5)  # seq 0, token 0
    assert stats["clip_frac"].item() == pytest.approx(2 / 5)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 1.0 + 0.5 + 0.5 + 1.1) / 5)
    assert stats["ratio_min"].item() == pytest.approx(0.5)
    assert stats["ratio_max"].item() == pytest.approx(1.5)  # the masked 2.0 is not counted
    assert stats["tokens"].item() == 5


def test_gradient_is_zero_on_clipped_and_masked_tokens():
    lp = logprobs()
    loss, _ = grpo_loss(lp, old(), ADVANTAGES, MASK, GrpoLossConfig(clip_low=0.2, clip_high=0.28))
    loss.backward()
    # d/dlogp of -A * r is -A * r on unclipped tokens, 0 where the clipped term is active; / 5 tokens.
    expected = torch.tensor([[0.0, -1.0, -0.5], [0.0, 2.2, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(lp.grad, expected)


def test_seq_mean_token_mean():
    config = GrpoLossConfig(clip_low=0.2, clip_high=0.28, aggregation=SEQ_MEAN_TOKEN_MEAN)
    loss, _ = grpo_loss(logprobs(), old(), ADVANTAGES, MASK, config)
    assert loss.item() == pytest.approx(((-1.28 - 1.0 - 0.5) / 3 + (1.6 + 2.2) / 2) / 2)


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    per_token = ADVANTAGES.unsqueeze(-1).expand(2, 3).clone()
    a, _ = grpo_loss(logprobs(), old(), ADVANTAGES, MASK)
    b, _ = grpo_loss(logprobs(), old(), per_token, MASK)
    assert a.item() == pytest.approx(b.item())


def test_ratio_one_is_the_plain_policy_gradient():
    # On the first pass (logp == logp_old) nothing is clipped and the loss is -mean(A).
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    loss, stats = grpo_loss(lp, old(), ADVANTAGES, MASK)
    assert loss.item() == pytest.approx(-(3 * 1.0 + 2 * -2.0) / 5)
    assert stats["clip_frac"].item() == 0.0


def test_k3_kl_values():
    lp = torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64)
    ref = torch.tensor([math.log(2.0), -math.log(2.0), -1.0], dtype=torch.float64)
    kl = k3_kl(lp, ref)
    assert kl[0].item() == pytest.approx(2.0 - math.log(2.0) - 1.0)
    assert kl[1].item() == pytest.approx(0.5 + math.log(2.0) - 1.0)
    assert kl[2].item() == pytest.approx(0.0)


def test_kl_term_is_added_with_beta():
    lp = logprobs()
    ref = lp.detach().clone()
    ref[0, 0] += math.log(2.0)  # one token where the reference is twice as likely
    ref[1, 2] += 5.0  # a masked token: must not count
    config = GrpoLossConfig(clip_low=0.2, clip_high=0.28, kl_beta=0.5)
    loss, stats = grpo_loss(lp, old(), ADVANTAGES, MASK, config, ref_logprobs=ref)
    kl_token = 1.0 - math.log(2.0)
    assert loss.item() == pytest.approx(0.204 + 0.5 * kl_token / 5)
    assert stats["kl"].item() == pytest.approx(kl_token / 5)


def test_kl_needs_a_reference():
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(logprobs(), old(), ADVANTAGES, MASK, GrpoLossConfig(kl_beta=0.1))


def test_zero_beta_reports_no_kl():
    _, stats = grpo_loss(logprobs(), old(), ADVANTAGES, MASK)
    assert "kl" not in stats


@pytest.mark.parametrize("aggregation", [TOKEN_MEAN, SEQ_MEAN_TOKEN_MEAN])
def test_micro_batches_with_the_batch_normalizer_sum_to_the_batch_loss(aggregation):
    config = GrpoLossConfig(aggregation=aggregation)
    whole, _ = grpo_loss(logprobs(), old(), ADVANTAGES, MASK, config)
    normalizer = MASK.sum() if aggregation == TOKEN_MEAN else torch.tensor(2.0)
    parts = [
        grpo_loss(logprobs()[i : i + 1], old()[i : i + 1], ADVANTAGES[i : i + 1], MASK[i : i + 1], config,
                  normalizer=normalizer)[0]
        for i in range(2)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item())


def test_empty_mask_gives_zero_and_still_backpropagates():
    lp = logprobs()
    loss, stats = grpo_loss(lp, old(), ADVANTAGES, torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and stats["tokens"].item() == 0
    assert torch.count_nonzero(lp.grad) == 0


def test_aggregate_rejects_unknown_modes_and_config_checks_ranges():
    with pytest.raises(ValueError):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")
    with pytest.raises(ValueError):
        GrpoLossConfig(clip_low=1.0)
    with pytest.raises(ValueError):
        GrpoLossConfig(aggregation="mean")


# A third sequence from a group that tied: advantage 0 on two generated tokens, ratio 1.
TIED_RATIOS = [1.0, 1.0]


def test_tied_sequences_left_out_still_count_in_the_token_mean():
    # All generated tokens of the batch: 5 above plus the tied sequence's 2. The tied tokens add
    # 0 to the sum, so the token mean is (-1.28 - 1.0 - 0.5 + 1.6 + 2.2) / 7, not / 5 (TRL's
    # GRPOTrainer and DESIGN.md: the mean over all generated tokens).
    lp = torch.log(torch.tensor(RATIOS + [TIED_RATIOS + [1.0]], dtype=torch.float64)).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    advantages = torch.tensor([1.0, -2.0, 0.0])
    whole, _ = grpo_loss(lp, torch.zeros(3, 3, dtype=torch.float64), advantages, mask)
    whole.backward()
    assert whole.item() == pytest.approx(1.02 / 7)

    # The trainer's path: the tied sequence dropped before the forward pass, the normalizer of all.
    kept_lp = logprobs()
    dropped, _ = grpo_loss(kept_lp, old(), ADVANTAGES, MASK, normalizer=7.0)
    dropped.backward()
    assert dropped.item() == pytest.approx(whole.item())
    assert torch.allclose(kept_lp.grad, lp.grad[:2])
    assert torch.allclose(kept_lp.grad, torch.tensor([[0.0, -1.0, -0.5], [0.0, 2.2, 0.0]], dtype=torch.float64) / 7)


def test_tied_sequences_left_out_still_count_in_the_seq_mean():
    config = GrpoLossConfig(aggregation=SEQ_MEAN_TOKEN_MEAN)
    loss, _ = grpo_loss(logprobs(), old(), ADVANTAGES, MASK, config, normalizer=3.0)
    assert loss.item() == pytest.approx(((-1.28 - 1.0 - 0.5) / 3 + (1.6 + 2.2) / 2) / 3)


def test_approx_kl_old_is_the_k1_estimate():
    _, stats = grpo_loss(logprobs(), old(), ADVANTAGES, MASK)
    kept = [1.5, 1.0, 0.5, 0.5, 1.1]
    assert stats["approx_kl_old"].item() == pytest.approx(-sum(math.log(r) for r in kept) / 5)


def test_the_truncated_importance_ratio_weighs_each_token_by_min_of_old_over_sampler_and_the_cap():
    from svc_trainer.losses import GrpoLossConfig, grpo_loss

    torch.manual_seed(0)
    logprobs = torch.randn(2, 5, requires_grad=True)
    old = logprobs.detach() + 0.1 * torch.randn(2, 5)
    sampler = old - torch.tensor([[0.0, 0.5, 1.0, -0.3, 2.0], [0.1, 0.0, -1.0, 0.2, 0.0]])  # w = exp(old - sampler)
    advantages = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, 5)
    plain, _ = grpo_loss(logprobs, old, advantages, mask, GrpoLossConfig())
    same, _ = grpo_loss(logprobs, old, advantages, mask, GrpoLossConfig(importance_cap=2.0), sampler_logprobs=old)
    assert torch.equal(plain, same)  # a sampler that agrees with the learner weighs every token 1
    capped, stats = grpo_loss(logprobs, old, advantages, mask, GrpoLossConfig(importance_cap=2.0),
                              sampler_logprobs=sampler)
    ratio = torch.exp(logprobs - old)
    a = advantages[:, None].expand_as(ratio)
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.28))
    weight = torch.clamp(torch.exp(old - sampler), max=2.0)
    torch.testing.assert_close(capped, (weight * pg).mean())
    assert stats["importance_capped_frac"].item() == pytest.approx(2 / 10)  # exp(1) and exp(2) exceed 2
    capped.backward()
    assert logprobs.grad is not None
    with pytest.raises(ValueError):
        grpo_loss(logprobs, old, advantages, mask, GrpoLossConfig(importance_cap=2.0))
