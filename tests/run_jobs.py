"""A job with the contract of a real learner job, minus the model, for the run registry and
run API tests: each step waits a little, reports metrics and writes a real checkpoint
(through leap.learning.checkpoint) every few steps, on a stop request and at the end."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

from leap.learning import checkpoint as ckpt
from leap.learning.registry import RunContext, RunRecord, RunFailure


@dataclasses.dataclass
class CountingJob:
    step_seconds: float = 0.05
    checkpoint_every: int = 2
    fail_at_step: int = 0  # raise at this step (a service that went away)
    hold: threading.Event | None = None  # when set, steps wait for it (to freeze a run mid-way)

    def __call__(self, ctx: RunContext) -> None:
        at = ctx.latest_checkpoint()
        start = ckpt.read_state(at.path)["step"] if at else 0
        for step in range(start + 1, ctx.total_steps + 1):
            time.sleep(self.step_seconds)
            if self.hold is not None:
                self.hold.wait()
            if step == self.fail_at_step:
                self.save(ctx, step - 1)
                raise RunFailure(f"sandbox at 127.0.0.1:1 stopped answering at step {step}")
            ctx.emit("train", step, {"loss": 1.0 / step, "step_squared": float(step * step)})
            if step % self.checkpoint_every == 0 or ctx.stop_requested() or step == ctx.total_steps:
                self.save(ctx, step)
            if ctx.stop_requested():
                return

    @staticmethod
    def save(ctx: RunContext, step: int) -> None:
        if step < 1:
            return
        temp = ckpt.new_temp_dir(ctx.checkpoint_dir, step)
        (temp / ckpt.STATE).write_text(json.dumps({"format": ckpt.FORMAT_VERSION, "step": step}))
        ctx.checkpoint_saved(ckpt.finalize(temp, step))


def factory(**kwargs):
    def make(record: RunRecord) -> CountingJob:
        return CountingJob(**{**kwargs, **record.config.get("job", {})})

    return make
