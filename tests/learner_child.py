"""A learner training in its own process, for the kill-and-resume tests of test_learning.py.

    python tests/learner_child.py MODEL_DIR CHECKPOINTS STEPS [HANG_AT_STEP]

Trains `learning_cases.step_batch(step)` for steps 1..STEPS, checkpointing after every step,
and prints "step N" once step N's checkpoint is sealed. With HANG_AT_STEP, the write of that
step's checkpoint stops after every file is written but before it is sealed, prints
"hanging", and waits to be killed: a kill in the middle of a checkpoint write.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from leap.learning import Learner, LearnerSettings  # noqa: E402
from leap.learning import checkpoint as ckpt  # noqa: E402
from tests.learning_cases import SETTINGS_KW, train_from  # noqa: E402


def main(model_dir: str, root: str, steps: int, hang_at: int | None) -> None:
    if hang_at is not None:
        real_finalize = ckpt.finalize

        def finalize(temp, step):
            if step == hang_at:
                print("hanging", flush=True)
                time.sleep(3600)
            return real_finalize(temp, step)

        ckpt.finalize = finalize
    learner = Learner(LearnerSettings(model_dir, **SETTINGS_KW))
    train_from(learner, root, 0, steps, announce=lambda step: print(f"step {step}", flush=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
