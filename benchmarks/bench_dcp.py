"""DCP's saving, as a ratio measured in one run on this machine (DESIGN.md, "Figures"): the
sandbox evaluations per training step of LEAP (DCP gate) against unpruned multi-turn
(every group with a failure expanded), same model, seed and steps, each mode on a fresh
stack of its own; and the pass@1 each reached on fresh samples of the training tasks, so
the saving is read at the accuracy it came with. Target: at least 40% fewer evaluations
per step at the same pass rate.

    python benchmarks/bench_dcp.py --model DIR --out runs/bench_dcp [--steps 10]

`leap dcp-experiment` is the full comparison (single-turn too, curves, time to a target);
this prints the one figure. Writes results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from leap.commands.dcp_experiment import train_mode  # noqa: E402
from leap.commands.demo import bootstrap, demo_toolchain  # noqa: E402
from leap.experiments import compare  # noqa: E402


def per_step(events: list[dict], key: str) -> float:
    trains = [e["values"] for e in events if e["kind"] == "train"]
    return sum(t.get(key, 0.0) for t in trains) / max(1, len(trains))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the bootstrapped tiny model)")
    parser.add_argument("--out", default="runs/bench_dcp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--eval-every", type=int, default=0)
    parser.add_argument("--eval-samples", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    toolchain = demo_toolchain()
    model = Path(args.model) if args.model else bootstrap(out / "model", toolchain, args.quiet)
    runs = {mode: train_mode(args, mode, model, toolchain, out / mode) for mode in ("leap", "multiturn")}
    metric = f"train_tasks/pass_at_1/turn_{args.max_turns}"
    results = {mode: {"evaluations_per_step": per_step(events, "sandbox/evaluations"),
                      "seconds_per_step": per_step(events, "time/step_s"),
                      "expanded_share": per_step(events, "expanded_share"),
                      "final_pass_at_1": compare.curve(events, metric)[-1].accuracy}
               for mode, events in runs.items()}
    leap, multi = results["leap"], results["multiturn"]
    fewer = 1 - leap["evaluations_per_step"] / multi["evaluations_per_step"]
    results["leap_fewer_evaluations_per_step"] = fewer
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"sandbox evaluations per step: leap {leap['evaluations_per_step']:.1f}, multiturn "
          f"{multi['evaluations_per_step']:.1f}: {fewer:.0%} fewer (target >= 40%); expanded share "
          f"{leap['expanded_share']:.0%} vs {multi['expanded_share']:.0%}")
    print(f"training-task pass@1 at turn {args.max_turns} after {args.steps} steps: leap {leap['final_pass_at_1']:.3f}, "
          f"multiturn {multi['final_pass_at_1']:.3f}; seconds per step {leap['seconds_per_step']:.1f} vs "
          f"{multi['seconds_per_step']:.1f}")


if __name__ == "__main__":
    main()
