"""The shared learner (leap.learning) on a real tiny transformer: batching, logprobs, the
optimizer step, gradient accumulation, checkpoints that survive a kill, and two processes
(FSDP on gloo) agreeing with one."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch

from leap.learning import (
    Learner, LearnerSettings, OptimizerSettings, Schedule, Sequence, collate, latest_checkpoint, list_checkpoints,
    micro_batches, shard, token_logprobs, with_values,
)
from leap.learning import checkpoint as ckpt
from leap.learning.model import check_model_dir, load_model
from tests.conftest import ROOT, free_port, subprocess_env
from tests.learning_cases import SETTINGS_KW, grpo_batch, run_steps, train_from
from tests.tiny_lm import build_tiny_model
from svc_trainer.losses import GrpoLossConfig, GrpoObjective


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def new_learner(model_dir, **overrides) -> Learner:
    return Learner(LearnerSettings(str(model_dir), **{**SETTINGS_KW, **overrides}))


# --- batching (pure) --------------------------------------------------------------------------


def test_micro_batches_respect_the_budget_and_cover_every_sequence_once():
    lengths = [5, 40, 12, 12, 7, 100, 3, 33]
    groups = micro_batches(lengths, 48)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        padded = max(lengths[i] for i in group) * len(group)
        assert padded <= 48 or len(group) == 1  # only an over-long sequence goes alone over budget
    assert [5] in groups  # the 100-token sequence has its own micro-batch
    assert micro_batches(lengths, 48) == groups  # the same lengths, the same grouping


def test_shard_balances_tokens_and_covers_every_sequence_once():
    lengths = [50, 10, 10, 10, 10, 10, 40, 5]
    parts = shard(lengths, 2)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 10
    assert shard([7], 3) == [[0], [], []]


def test_collate_pads_on_the_right_and_keeps_values():
    a = Sequence([1, 2, 3], [0, 1, 1], {"adv": 0.5, "old": [0.0, -1.0, -2.0]})
    b = Sequence([4, 5], [0, 1], {"adv": -1.0, "old": [0.0, -3.0]})
    batch = collate([a, b], pad_token_id=9)
    assert batch.input_ids.tolist() == [[1, 2, 3], [4, 5, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.values["adv"].tolist() == [0.5, -1.0]
    assert batch.values["old"].tolist() == [[0.0, -1.0, -2.0], [0.0, -3.0, 0.0]]


def test_sequence_rejects_a_mask_on_the_first_token_and_misaligned_values():
    with pytest.raises(ValueError, match="position 0"):
        Sequence([1, 2], [1, 1])
    with pytest.raises(ValueError, match="entries"):
        Sequence([1, 2], [0, 1], {"old": [0.0]})


def test_schedule_warms_up_then_holds_or_decays():
    constant = Schedule(warmup_steps=4, total_steps=10, kind="constant")
    assert [constant(u) for u in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = Schedule(warmup_steps=2, total_steps=10, kind="cosine")
    assert cosine(0) == 0.5 and cosine(2) == pytest.approx(1.0)
    assert cosine(6) == pytest.approx(0.5) and cosine(10) == pytest.approx(0.0)


def test_optimizer_settings_from_proto_take_documented_defaults():
    from leap.common.v1 import common_pb2

    settings = OptimizerSettings.from_proto(common_pb2.OptimizerConfig())
    assert (settings.learning_rate, settings.max_grad_norm, settings.epochs_per_batch, settings.micro_batch_tokens) \
        == (1e-5, 1.0, 1, 4096)
    zero_clip = OptimizerSettings.from_proto(common_pb2.OptimizerConfig(max_grad_norm=0.0, learning_rate=0.5))
    assert zero_clip.max_grad_norm == 0.0 and zero_clip.learning_rate == 0.5


# --- the model --------------------------------------------------------------------------------


def test_check_model_dir_says_what_is_missing(tmp_path, model_dir):
    assert check_model_dir(model_dir) is None
    assert "not a directory" in check_model_dir(tmp_path / "nope")
    assert "config.json" in check_model_dir(tmp_path)


def test_token_logprobs_are_the_temperature_scaled_log_softmax_of_the_sampled_token(model_dir):
    model = load_model(model_dir, trainable=False)
    ids = torch.tensor([[11, 42, 7, 99, 120], [5, 17, 230, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad():
        got, entropy = token_logprobs(model, ids, attention, temperature=0.7, with_entropy=True)
        logits = model(input_ids=ids[:1]).logits[0].float() / 0.7
    expected = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    assert got[0, 0] == 0.0
    assert torch.allclose(got[0, 1:], expected, atol=1e-5)
    probs = torch.softmax(logits[:-1], -1)
    assert torch.allclose(entropy[0, 1:], -(probs * probs.log()).sum(-1), atol=1e-4)
    with torch.no_grad():
        alone, _ = token_logprobs(model, ids[1:, :3], attention[1:, :3], temperature=0.7)
        hot, _ = token_logprobs(model, ids[:1], attention[:1], temperature=1.0)
    assert torch.allclose(alone[0], got[1, :3], atol=1e-5)  # right padding does not change real tokens
    assert not torch.allclose(hot[0, 1:], got[0, 1:])  # temperature matters


# --- the optimizer step -----------------------------------------------------------------------


def mean_logprob(learner, sequences, sign: float) -> float:
    """Mean logprob of the completion tokens of the sequences whose advantage has `sign`."""
    values = []
    for seq, logprobs in zip(sequences, learner.logprobs(sequences)):
        if math.copysign(1.0, seq.values["advantages"]) == sign:
            values += [lp for lp, m in zip(logprobs, seq.loss_mask) if m]
    return sum(values) / len(values)


def test_a_grpo_step_raises_the_logprob_of_positive_advantage_tokens(model_dir):
    learner = new_learner(model_dir)
    sequences = grpo_batch()
    before_pos, before_neg = mean_logprob(learner, sequences, 1.0), mean_logprob(learner, sequences, -1.0)
    weights = {k: v.clone() for k, v in learner.full_state_dict().items()}
    stats = run_steps(learner, sequences, steps=1)[0]
    after_pos, after_neg = mean_logprob(learner, sequences, 1.0), mean_logprob(learner, sequences, -1.0)
    assert after_pos > before_pos and after_neg < before_neg
    assert any(not torch.equal(weights[k], v) for k, v in learner.full_state_dict().items())
    assert learner.updates == 2 and stats["updates"] == 2.0  # two epochs: two optimizer updates
    assert stats["grad_norm"] > 0 and stats["tokens"] == sum(s.loss_tokens for s in sequences)
    assert stats["ratio_mean_last_pass"] != 1.0  # the second pass works off the sampler's weights


def test_the_first_pass_reproduces_the_old_logprobs_exactly(model_dir):
    learner = new_learner(model_dir)
    sequences = grpo_batch()
    old = learner.logprobs(sequences)
    stats = learner.train_step(with_values(sequences, old_logprobs=old), GrpoObjective(GrpoLossConfig()), epochs=1)
    assert stats["ratio_min"] == 1.0 and stats["ratio_max"] == 1.0 and stats["clip_frac"] == 0.0


def test_gradient_accumulation_does_not_change_the_update(model_dir):
    sequences = grpo_batch()
    results = []
    for budget in (40, 100_000):  # many micro-batches, or the whole batch at once
        learner = new_learner(model_dir, optimizer=OptimizerSettings(learning_rate=3e-3, micro_batch_tokens=budget))
        old = learner.logprobs(sequences)
        stats = learner.train_step(with_values(sequences, old_logprobs=old), GrpoObjective(GrpoLossConfig()))
        # The accumulated gradient of the update is still on the parameters. (Weights are not
        # compared: Adam's first update is lr * sign(g), which float noise on gradients near 0 flips.)
        results.append((stats, {n: p.grad.clone() for n, p in learner.model.named_parameters()}))
    (many, many_grads), (one, one_grads) = results
    assert many["micro_batches"] > 1 and one["micro_batches"] == 1
    assert many["loss"] == pytest.approx(one["loss"], abs=1e-6)
    assert many["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5)
    assert all(torch.allclose(many_grads[k], one_grads[k], atol=1e-7) for k in one_grads)


def test_kl_to_a_frozen_reference(model_dir):
    learner = new_learner(model_dir, reference=True)
    sequences = grpo_batch()
    objective = GrpoObjective(GrpoLossConfig(kl_beta=0.1))
    for _ in range(2):
        old = learner.logprobs(sequences)
        ref = learner.logprobs(sequences, reference=True)
        stats = learner.train_step(with_values(sequences, old_logprobs=old, ref_logprobs=ref), objective)
    assert stats["kl"] > 0  # the policy moved away from the reference, which stayed put
    assert learner.logprobs(sequences, reference=True) == ref


# --- checkpoints ------------------------------------------------------------------------------


def optimizer_tensors(learner) -> dict[str, torch.Tensor]:
    named = {id(p): n for n, p in learner.model.named_parameters()}
    out = {}
    for param, state in learner.optimizer.state.items():
        for key, value in state.items():
            out[f"{named[id(param)]}.{key}"] = value.clone() if torch.is_tensor(value) else torch.tensor(value)
    return out


def assert_same_learner_state(a, b):
    assert a.updates == b.updates
    wa, wb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    oa, ob = optimizer_tensors(a), optimizer_tensors(b)
    assert oa.keys() == ob.keys() and oa
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    assert a.current_lr() == b.current_lr()


def test_checkpoint_round_trip_restores_everything(model_dir, tmp_path):
    cosine = OptimizerSettings(learning_rate=3e-3, warmup_steps=1, schedule="cosine", micro_batch_tokens=96)
    learner = new_learner(model_dir, optimizer=cosine, total_updates=6)
    train_from(learner, tmp_path, 0, 2)
    next_draw = torch.rand(3)  # what the RNG gives right after the checkpoint was written
    info = latest_checkpoint(tmp_path)
    assert info.step == 2 and (info.path / "model" / "config.json").is_file()
    restored = new_learner(model_dir, optimizer=cosine, total_updates=6)
    state = restored.load_checkpoint(info.path)
    assert state["step"] == 2 and state["cursor"] == {"next_step": 3}
    assert_same_learner_state(learner, restored)
    assert torch.equal(torch.rand(3), next_draw)  # the RNG continues where it was saved
    # The model directory inside is a plain Hugging Face model the policy service can load.
    assert torch.equal(load_model(info.path / "model").state_dict()["lm_head.weight"],
                       learner.full_state_dict()["lm_head.weight"])


def start_child(model_dir, root, steps, hang_at=None):
    args = [sys.executable, str(ROOT / "tests" / "learner_child.py"), str(model_dir), str(root), str(steps)]
    if hang_at is not None:
        args.append(str(hang_at))
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=subprocess_env(),
                            text=True, start_new_session=True)


def wait_for_line(process, wanted: str, timeout: float = 120.0) -> list[str]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError(f"child ended before printing {wanted!r}; it printed {seen}")
        seen.append(line.strip())
        if line.strip() == wanted:
            return seen
    raise AssertionError(f"no {wanted!r} within {timeout} s")


def test_killed_during_a_checkpoint_write_and_resumed_matches_an_uninterrupted_run(model_dir, tmp_path):
    """SIGKILL a real training process while it writes the checkpoint of step 3 (every file
    written, not yet sealed): the half-written one is never listed, the run resumes from step
    2 with the same step counter and optimizer state, and ends where an uninterrupted run ends."""
    root = tmp_path / "killed"
    child = start_child(model_dir, root, steps=4, hang_at=3)
    try:
        wait_for_line(child, "hanging")
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert leftovers, "the kill should have left the unsealed write of step 3 behind"
    assert [c.step for c in list_checkpoints(root)] == [1, 2]

    straight = new_learner(model_dir)  # the same steps, never interrupted
    train_from(straight, tmp_path / "straight", 0, 2)

    resumed = new_learner(model_dir)
    state = resumed.load_checkpoint(latest_checkpoint(root).path)
    assert state["step"] == 2 and state["cursor"]["next_step"] == 3
    assert_same_learner_state(straight, resumed)

    train_from(straight, tmp_path / "straight", 2, 4)
    train_from(resumed, root, state["step"], 4)
    assert [c.step for c in list_checkpoints(root)] == [3, 4]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # the next save cleaned up
    assert_same_learner_state(straight, resumed)


def test_a_checkpoint_with_a_damaged_file_is_not_listed(model_dir, tmp_path):
    learner = new_learner(model_dir)
    learner.save_checkpoint(tmp_path, 1)
    info = learner.save_checkpoint(tmp_path, 2)
    with open(info.path / "optimizer.pt", "r+b") as f:
        f.truncate(100)  # as if the disk lost the end of the file
    assert [c.step for c in list_checkpoints(tmp_path)] == [1]
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        learner.load_checkpoint(info.path)


def test_saving_a_step_again_replaces_it_and_prune_keeps_the_newest(model_dir, tmp_path):
    learner = new_learner(model_dir)
    for step in (1, 2, 3):
        learner.save_checkpoint(tmp_path, step, keep_last=2)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    learner.save_checkpoint(tmp_path, 3, cursor={"again": True}, keep_last=2)
    assert ckpt.read_state(latest_checkpoint(tmp_path).path)["cursor"] == {"again": True}
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]


# --- several processes ------------------------------------------------------------------------


def test_two_processes_with_fsdp_agree_with_one(model_dir, tmp_path):
    """The same learner code over two gloo processes (FSDP2): the ranks hold the same
    weights, and they are the weights one process computes for the same batch."""
    out = tmp_path / "ranks"
    out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(ROOT / "tests" / "learner_ranks.py"), str(model_dir), str(out)]
    done = subprocess.run(command, env=subprocess_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == 2
    first, second = result["fingerprints"]
    assert first == second  # both ranks see the same full weights
    assert result["resumed_step"] == 2 and result["resumed_updates"] == 4 and result["reloaded_equal"]

    single = new_learner(model_dir)
    single_stats = run_steps(single, grpo_batch())
    for mine, theirs in zip(single_stats, result["stats"]):
        assert theirs["loss"] == pytest.approx(mine["loss"], abs=1e-5)
        assert theirs["grad_norm"] == pytest.approx(mine["grad_norm"], rel=1e-4)
        assert theirs["tokens"] == mine["tokens"]
    distributed = torch.load(out / "weights.pt")
    reference = single.full_state_dict()
    assert all(torch.allclose(distributed[k], reference[k], atol=1e-5) for k in reference)


# --- non-finite updates -----------------------------------------------------------------------


def nan_loss(logprobs, batch, normalizer, entropy):
    loss = (logprobs * batch.loss_mask).sum() / normalizer.tokens
    return loss * float("nan"), {"loss": float("nan")}


@pytest.mark.parametrize("case", ["nan loss", "infinite learning rate"])
def test_a_non_finite_update_raises_and_leaves_the_weights_and_optimizer_of_the_last_good_one(model_dir, case):
    if case == "nan loss":  # a loss that is NaN: stopped before the optimizer moves anything
        learner, loss_fn, what = new_learner(model_dir), nan_loss, "loss"
    else:  # a learning rate StartRun would refuse, set here directly: the step makes the weights non-finite
        settings = dict(SETTINGS_KW, optimizer=OptimizerSettings(learning_rate=math.inf, micro_batch_tokens=96))
        learner, loss_fn, what = new_learner(model_dir, **settings), GrpoObjective(GrpoLossConfig()), "weights"
    sequences = grpo_batch()
    before = {k: v.clone() for k, v in learner.full_state_dict().items()}
    with pytest.raises(ArithmeticError) as caught:
        old = learner.logprobs(sequences)
        learner.train_step(with_values(sequences, old_logprobs=old), loss_fn)
    assert getattr(caught.value, "what", None) == what and str(caught.value).startswith(f"the {what} became")
    if what == "loss":
        assert learner.updates == 0 and not learner.optimizer.state
        assert all(torch.equal(before[k], v) for k, v in learner.full_state_dict().items())
    else:
        assert any(not torch.isfinite(v).all() for v in learner.full_state_dict().values())
    from leap.common.v1 import common_pb2

    sentence = caught.value.sentence(4, common_pb2.OptimizerConfig(learning_rate=1e-3, max_grad_norm=1.0))
    assert sentence.startswith(f"step 4: the {what} became") and "optimizer.learning_rate" in sentence
