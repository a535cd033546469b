"""TU-OPD and CRD losses against hand-computed values (DESIGN.md "TU-OPD")."""

from __future__ import annotations

import pytest
import torch

from svc_distill.losses import TuOpdConfig, target_logps, teacher_weights, tu_opd_loss

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
