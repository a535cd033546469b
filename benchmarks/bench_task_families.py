#!/usr/bin/env python3
"""How fast the task families generate, beside loading the built-in suite in the same run.

A sandbox generates the tasks it serves at start-up (`task_families`), so this is what
`--task-families elementwise:10000` adds to a start. Prints, per family, tasks per second
(the median of `--repeats` runs of `--count` tasks each, capped at the family's size) and the
seconds 10,000 tasks take at that rate; and the same per-task cost as a ratio to reading one
task of the built-in suite from its folder (TOML, reference and examples), measured in the
same run. The target: 10,000 tasks of a family in under 10 s.

    python benchmarks/bench_task_families.py [--count 2000] [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from leap import tasks
from leap.tasks import families


def per_task_seconds(fn, count: int, repeats: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) / count)
    return statistics.median(samples), samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000, help="tasks per run (capped at a family's size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the figures here")
    args = parser.parse_args()

    def load_suite() -> None:
        tasks._builtin.cache_clear()  # read the folders again, as a fresh process does
        tasks.load_suite()

    suite_count = len(tasks.load_suite())
    suite_s, _ = per_task_seconds(load_suite, suite_count, args.repeats)
    figures = {"suite_task_ms": suite_s * 1e3, "families": {}}
    print(f"built-in suite: {suite_s * 1e3:.3f} ms per task ({suite_count} tasks)")
    for name, module in sorted(families.FAMILIES.items()):
        count = min(args.count, module.SIZE)
        seconds, samples = per_task_seconds(lambda: families.generate_many(name, 0, count), count, args.repeats)
        row = {"tasks_per_s": 1 / seconds, "seconds_for_10000": 10_000 * seconds, "size": module.SIZE,
               "ratio_to_suite_task": seconds / suite_s, "samples_ms_per_task": [s * 1e3 for s in samples]}
        figures["families"][name] = row
        print(f"{name:12s} {row['tasks_per_s']:8.0f} tasks/s   10,000 in {row['seconds_for_10000']:5.2f} s   "
              f"{row['ratio_to_suite_task']:.3f} of a suite task's load   ({module.SIZE:,} structures)")
    worst = max(row["seconds_for_10000"] for row in figures["families"].values())
    figures["goal_met"] = worst < 10.0
    print(f"goal (10,000 in under 10 s): {'met' if figures['goal_met'] else 'missed'}, slowest family {worst:.2f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)


if __name__ == "__main__":
    main()
