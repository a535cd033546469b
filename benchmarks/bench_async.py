#!/usr/bin/env python3
"""Asynchronous rollouts against the synchronous loop, as ratios measured in one run: the
same run of the embedded default (the bootstrapped tiny model, cpu toolchain, fixed seeds)
at max_staleness 0 (generate, judge, learn, push) and 1 (the next step's rollouts generated
and judged while the learner trains), each on a fresh local stack of its own.

- step time: the median `time/step_s` of the steps after the first (step 1 has no learner
  step to overlap at staleness 1 and fills the pipeline), sync and async;
- pass@1: first-turn pass@1 on fresh samples of the training tasks after the last step
  (`eval_train_tasks`, a seed no training rollout uses), with its standard error
  sqrt(p (1 - p) / n) over the n samples.

Targets (DESIGN.md): async step time at most 0.75 of sync, at equal pass@1 within its
standard error. On 2 cores the policy's generation, the sandbox's compiles and the learner
compete for the same cores, so the overlap only buys the time either side waits; the
figures say what it bought here.

    .venv/bin/python benchmarks/bench_async.py --json runs/bench_async/results.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from leap.commands.demo import bootstrap, demo_toolchain  # noqa: E402


def run(args, staleness: int, model: Path, toolchain: int, work: Path) -> list[dict]:
    from google.protobuf import json_format

    from leap.clients import connect
    from leap.common.v1 import common_pb2
    from leap.experiments.runs import run_to_end
    from leap.experiments.stack import experiment_stack
    from leap.trainer.v1 import trainer_pb2

    config = trainer_pb2.RunConfig(
        model_path=str(model.resolve()), steps=args.steps, tasks_per_step=args.tasks_per_step,
        group_size=args.group_size, max_turns=args.max_turns, toolchain=toolchain, seed=args.seed,
        eval_samples=args.eval_samples, eval_turns=1, eval_train_tasks=True, eval_tasks=["silu"],
        checkpoint_every=args.steps, max_staleness=staleness, display_name=f"staleness {staleness}",
        optimizer=common_pb2.OptimizerConfig(learning_rate=args.learning_rate))
    with experiment_stack(work, model) as stack:
        trainer = connect("trainer", stack.addresses["trainer"], aio=False)
        try:
            finished = run_to_end(trainer, trainer_pb2, config, f"staleness {staleness}", progress=not args.quiet)
        finally:
            trainer.channel.close()
    events = [json_format.MessageToDict(e, preserving_proto_field_name=True) for e in finished.events]
    for event in events:
        event.setdefault("values", {})
        event["step"] = int(event.get("step", 0))
    work.mkdir(parents=True, exist_ok=True)
    (work / "events.json").write_text(json.dumps(events) + "\n")
    return events


def summary(events: list[dict]) -> dict:
    trains = [e["values"] for e in events if e["kind"] == "train"]
    steps = [t["time/step_s"] for t in trains[1:]] or [t["time/step_s"] for t in trains]
    final = [e["values"] for e in events if e["kind"] == "eval" and "train_tasks/pass_at_1/turn_1" in e["values"]][-1]
    p = final["train_tasks/pass_at_1/turn_1"]
    n = int(final["train_tasks/samples"])
    return {"step_s": statistics.median(steps), "step_s_all": steps, "pass_at_1": p,
            "pass_at_1_stderr": math.sqrt(p * (1 - p) / n) if n else 0.0, "samples": n,
            "learn_s": statistics.median(t.get("time/learn_s", 0.0) for t in trains),
            "rollout_s": statistics.median(t.get("time/rollout_s", 0.0) for t in trains)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the bootstrapped tiny model)")
    parser.add_argument("--out", default="runs/bench_async")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    toolchain = demo_toolchain()
    model = Path(args.model) if args.model else bootstrap(out / "model", toolchain, args.quiet)
    results = {staleness: summary(run(args, staleness, model, toolchain, out / f"staleness-{staleness}"))
               for staleness in (0, 1)}
    sync, asyn = results[0], results[1]
    ratio = asyn["step_s"] / sync["step_s"]
    gap = abs(asyn["pass_at_1"] - sync["pass_at_1"])
    stderr = math.hypot(sync["pass_at_1_stderr"], asyn["pass_at_1_stderr"])
    print(f"step time: sync {sync['step_s']:.1f} s, async {asyn['step_s']:.1f} s (median of steps 2..{args.steps}): "
          f"async/sync = {ratio:.2f} (target <= 0.75)")
    print(f"  sync: rollout {sync['rollout_s']:.1f} s + learn {sync['learn_s']:.1f} s per step; "
          f"async: rollout {asyn['rollout_s']:.1f} s beside learn {asyn['learn_s']:.1f} s")
    print(f"pass@1 (training tasks, fresh samples, turn 1): sync {sync['pass_at_1']:.3f} +- "
          f"{sync['pass_at_1_stderr']:.3f}, async {asyn['pass_at_1']:.3f} +- {asyn['pass_at_1_stderr']:.3f}: "
          f"gap {gap:.3f} against a combined standard error of {stderr:.3f}")
    figures = {"sync_step_s": sync["step_s"], "async_step_s": asyn["step_s"], "sync_pass_at_1": sync["pass_at_1"],
               "async_pass_at_1": asyn["pass_at_1"], "sync_pass_at_1_stderr": sync["pass_at_1_stderr"],
               "async_pass_at_1_stderr": asyn["pass_at_1_stderr"], "ratio": ratio, "details": results}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(figures, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
