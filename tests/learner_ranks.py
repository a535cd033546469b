"""Run by test_learning.py under `torch.distributed.run --nproc-per-node 2`: one learner over
two gloo processes (FSDP), driven by rank 0 exactly as the trainer service drives it.

    python -m torch.distributed.run --nproc-per-node 2 tests/learner_ranks.py MODEL_DIR OUT_DIR

Rank 0 takes the steps of `learning_cases.run_steps`, asks every rank for a fingerprint of
the full weights it sees, checkpoints, and reloads the checkpoint into a second learner.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from leap.learning import Learner, LearnerSettings, current_world, follow, release_followers  # noqa: E402
from leap.learning.distributed import exit_process, leave_process_group  # noqa: E402
from tests.learning_cases import SETTINGS_KW, grpo_batch, run_steps  # noqa: E402


def main(model_dir: str, out_dir: str) -> None:
    world = current_world()
    if not world.is_driver:
        follow()
        leave_process_group()
        check_joined_once(world)
        return
    out = Path(out_dir)
    learner = Learner(LearnerSettings(model_dir, **SETTINGS_KW))
    stats = run_steps(learner, grpo_batch())
    fingerprints = learner.rank_fingerprints()
    info = learner.save_checkpoint(out / "checkpoints", step=2, cursor={"next": 2})
    weights = learner.full_state_dict()
    learner.close()
    reloaded = Learner(LearnerSettings(model_dir, **SETTINGS_KW))
    state = reloaded.load_checkpoint(info.path)
    again = reloaded.full_state_dict()
    resumed_updates = reloaded.updates
    reloaded.close()
    release_followers(world)
    check_joined_once(world)
    torch.save(weights, out / "weights.pt")
    (out / "result.json").write_text(json.dumps({
        "world_size": world.size, "stats": stats, "fingerprints": fingerprints,
        "resumed_step": state["step"], "resumed_updates": resumed_updates,
        "reloaded_equal": all(torch.equal(weights[k], again[k]) for k in weights),
    }))


def check_joined_once(world) -> None:
    """After leaving, asking for the world again must not join a second time (that join met
    the first one's stale keys in torchrun's store and hung about one launch in two)."""
    if current_world() is not world or torch.distributed.is_initialized():
        raise SystemExit(f"rank {world.rank}: current_world() joined the process group again after leaving it")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    if current_world().distributed:
        exit_process(0)  # as `leap serve trainer` ends its ranks
