"""TU-OPD and CRD losses against hand-computed values (DESIGN.md "TU-OPD"), the batch-wide
normalizer of gradient accumulation, and the learner objective with its statistics."""

from __future__ import annotations

import pytest
import torch

from leap.learning import Normalizer, Sequence, collate
from svc_distill.losses import (
    SAMPLER_LOGPS, TuOpdConfig, TuOpdObjective, quality_key, target_logps, teacher_key, teacher_weights, tu_opd_loss,
)

# Two teachers, one example of two tokens: both reliable at rho 0.5 (q 0.6 and 0.9).
QUALITY = torch.tensor([[0.6], [0.9]])
TEACHERS = torch.tensor([[[-1.0, -3.0]], [[-2.0, -1.0]]])
STUDENT = [[-1.0, -1.0]]


def student():
    return torch.tensor(STUDENT, requires_grad=True)


def test_weights_follow_quality_among_reliable_teachers():
    weights = teacher_weights(torch.tensor([[0.8, 0.2], [0.4, 0.1]]), TuOpdConfig(rho=0.5))
    assert torch.allclose(weights, torch.tensor([[1.0, 0.0], [0.0, 0.0]]))
    assert torch.allclose(teacher_weights(QUALITY, TuOpdConfig()), torch.tensor([[0.4], [0.6]]))


@pytest.mark.parametrize("config, expected", [
    # consensus [-1.6, -1.8]; winner (q 0.9) residual max(-2+1.6, 0)=0, max(-1+1.8, 0)=0.8
    (TuOpdConfig(), [-1.6, -1.0]),
    (TuOpdConfig(crd=False), [-1.6, -1.8]),
    # equal weights: consensus [-1.5, -2.0], residual [0, 1]
    (TuOpdConfig(weighting=False), [-1.5, -1.0]),
    (TuOpdConfig(single_best=True), [-2.0, -1.0]),
    (TuOpdConfig(gating=False, rho=0.95), [-1.6, -1.0]),
])
def test_target_of_each_ablation(config, expected):
    weights = teacher_weights(QUALITY, config)
    assert torch.allclose(target_logps(TEACHERS, QUALITY, weights, config), torch.tensor([expected]))


def test_crd_loss_and_gradient_push_the_student_toward_the_target():
    s = student()
    loss, skipped = tu_opd_loss(TEACHERS, s, torch.ones(1, 2), QUALITY, TuOpdConfig())
    loss.backward()
    # reward = target - s = [-0.6, 0]; loss = -mean(reward * s) = -0.3; grad = -reward / 2
    assert skipped == 0 and loss.item() == pytest.approx(-0.3)
    assert torch.allclose(s.grad, torch.tensor([[0.3, 0.0]]))


def test_plain_consensus_loss_without_crd():
    loss, _ = tu_opd_loss(TEACHERS, student(), torch.ones(1, 2), QUALITY, TuOpdConfig(crd=False))
    assert loss.item() == pytest.approx(-0.7)  # reward [-0.6, -0.8]


def test_examples_without_a_reliable_teacher_are_skipped_and_counted():
    teachers = torch.tensor([[[-1.0, -2.0], [-1.0, -1.0]], [[-3.0, -3.0], [-1.0, -1.0]]])
    quality = torch.tensor([[0.8, 0.2], [0.4, 0.1]])
    loss, skipped = tu_opd_loss(teachers, torch.tensor([[-2.0, -2.0], [-5.0, -5.0]]), torch.ones(2, 2), quality,
                                TuOpdConfig(rho=0.5))
    # only example 0 kept, target teacher 0 = [-1, -2]; reward [1, 0]; loss = -(1 * -2) / 2
    assert skipped == 1 and loss.item() == pytest.approx(1.0)


def test_no_reliable_teacher_anywhere_gives_a_zero_loss_that_still_backpropagates():
    s = student()
    loss, skipped = tu_opd_loss(TEACHERS, s, torch.ones(1, 2), QUALITY, TuOpdConfig(rho=0.95))
    loss.backward()
    assert skipped == 1 and loss.item() == 0.0 and torch.equal(s.grad, torch.zeros(1, 2))


# Two examples of two tokens each; example 1 as above, example 2: both teachers agree on -1
# where the student says -2 (target -1, reward 1 on both tokens).
TWO_TEACHERS = torch.tensor([[[-1.0, -3.0], [-1.0, -1.0]], [[-2.0, -1.0], [-1.0, -1.0]]])
TWO_QUALITY = torch.tensor([[0.6, 0.6], [0.9, 0.9]])
TWO_STUDENT = [[-1.0, -1.0], [-2.0, -2.0]]


def test_micro_batch_losses_with_the_batch_normalizer_sum_to_the_batch_mean():
    whole = torch.tensor(TWO_STUDENT, requires_grad=True)
    loss, _ = tu_opd_loss(TWO_TEACHERS, whole, torch.ones(2, 2), TWO_QUALITY, TuOpdConfig())
    loss.backward()
    # sum(reward * s): example 1 (-0.6)(-1) + 0 = 0.6, example 2 (1)(-2) * 2 = -4; loss = -(0.6 - 4) / 4
    assert loss.item() == pytest.approx(0.85)
    parts = torch.tensor(TWO_STUDENT, requires_grad=True)
    total = sum(tu_opd_loss(TWO_TEACHERS[:, [i]], parts[[i]], torch.ones(1, 2), TWO_QUALITY[:, [i]], TuOpdConfig(),
                            normalizer=4.0)[0] for i in range(2))
    total.backward()
    assert total.item() == pytest.approx(0.85)  # -0.15 + 1.0; without the normalizer: -0.3 + 2.0
    assert torch.allclose(parts.grad, whole.grad)


def objective_batch(student_logps):
    """The two examples as a learner micro-batch: one prompt token, then the two sampled tokens."""
    sequences = [
        Sequence([5, 6, 7], [0, 1, 1], {teacher_key(0): [0.0, *TWO_TEACHERS[0, i].tolist()],
                                        teacher_key(1): [0.0, *TWO_TEACHERS[1, i].tolist()],
                                        quality_key(0): 0.6, quality_key(1): 0.9,
                                        SAMPLER_LOGPS: [0.0, *(v + 0.5 for v in student_logps[i])]})
        for i in range(2)
    ]
    logprobs = torch.tensor([[0.0, *row] for row in student_logps], requires_grad=True)
    return collate(sequences), logprobs


def test_the_learner_objective_reads_teachers_and_quality_from_the_batch():
    batch, logprobs = objective_batch(TWO_STUDENT)
    loss, stats = TuOpdObjective(TuOpdConfig(), teachers=2)(logprobs, batch, Normalizer(tokens=4.0, sequences=2.0), None)
    assert loss.item() == pytest.approx(0.85)
    # s - T: example 1 [0.6, 0], example 2 [-1, -1]
    assert stats["kl_target"].item() == pytest.approx((0.6 - 2) / 4)
    # s - l_0: [0, 2], [-1, -1]; s - l_1: [1, 0], [-1, -1]; both teachers scored every token
    assert stats["kl_teacher_sum/0"].item() == pytest.approx(0.0) and stats["teacher_share/0"].item() == 1.0
    assert stats["kl_teacher_sum/1"].item() == pytest.approx(-0.25)
    assert stats["sampler_gap"].item() == pytest.approx(0.5) and stats["tokens"].item() == 4


def test_a_teacher_that_did_not_score_an_example_is_left_out_of_its_kl():
    batch, logprobs = objective_batch(TWO_STUDENT)
    batch.values[quality_key(1)][1] = 0.1  # teacher 1 unreliable on example 2: it never scored it
    _, stats = TuOpdObjective(TuOpdConfig(), teachers=2)(logprobs, batch, Normalizer(tokens=4.0, sequences=2.0), None)
    assert stats["teacher_share/1"].item() == pytest.approx(0.5)
    # over its own tokens (example 1): mean(s - l_1) = mean(1, 0)
    assert stats["kl_teacher_sum/1"].item() / stats["teacher_share/1"].item() == pytest.approx(0.5)


def test_teacher_logprobs_are_a_detached_target():
    # Teacher scores that arrive with a graph (an in-process teacher) must not be trained:
    # the gradient reaches the student only, and the same as for plain floats.
    teachers = TEACHERS.clone().requires_grad_(True)
    s = student()
    loss, _ = tu_opd_loss(teachers, s, torch.ones(1, 2), QUALITY, TuOpdConfig())
    loss.backward()
    assert teachers.grad is None
    assert torch.allclose(s.grad, torch.tensor([[0.3, 0.0]]))
