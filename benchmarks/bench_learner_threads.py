#!/usr/bin/env python3
"""One learner step under each OpenMP wait policy, beside a CPU-bound neighbour, in one run.

A learner step is what the trainer's job does per step (svc_trainer/job.py `learn`): the old
logprobs recomputed, then one GRPO optimizer step, here on a fixed batch (--sequences of
--tokens random token ids of the tiny model's vocabulary, the first quarter masked as the
prompt) of the bootstrapped tiny model, on the learner's own thread (one single-worker
executor, as the job runs it). Torch's CPU build parallelizes each op with libgomp, whose
threads wait for the next parallel region by spinning (OMP_WAIT_POLICY=ACTIVE: for
minutes; unset: about 3 ms after every region) or by sleeping at once (PASSIVE). While
--neighbours CPU-bound neighbours run (processes: the policy's sampling, the sandbox's
compiles; or threads that release the GIL: gRPC's), the spinning threads hold cores the
thread doing the work needs.

libgomp reads the variable once, when torch loads it, so each policy runs in a subprocess of
its own (the policies alternating round by round, so that load on a shared machine hits them
alike), whose environment names it (unset: none; `leap` itself fills in PASSIVE only where
it is unset, so the child loads torch before leap). Each child reports libgomp's spin count
(OMP_DISPLAY_ENV=VERBOSE), which shows the policy took effect. A figure is the median
seconds of a step over every round's timed steps (after --warm untimed ones), with the
spread, and its ratio to the ACTIVE baseline of the same run; cpu_s is the process's CPU
seconds per step (spinning burns them).

    .venv/bin/python benchmarks/bench_learner_threads.py --json runs/bench_learner_threads.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ("ACTIVE", "PASSIVE", "unset")
NEIGHBOURS = ("process", "thread", "none")
BUSY_LOOP = "while True: pass"


def child(args: argparse.Namespace) -> None:
    """One policy's measurement; prints one JSON line. torch loads first, under the
    environment the parent chose (see the module docstring)."""
    import torch  # noqa: F401  (before leap: libgomp reads the policy now)

    sys.path.insert(0, str(ROOT))
    import concurrent.futures
    import hashlib
    import random
    import threading

    from leap.learning import Learner, LearnerSettings, OptimizerSettings, Sequence, with_values
    from svc_trainer.losses import GrpoLossConfig, GrpoObjective

    settings = LearnerSettings(model_path=args.model, optimizer=OptimizerSettings(learning_rate=1e-5),
                               total_updates=args.warm + args.repeats, device="cpu", seed=0)
    rng = random.Random(0)
    learner_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="learner")
    learner = learner_thread.submit(Learner, settings).result()
    vocab = learner.model.config.vocab_size
    prompt = args.tokens // 4
    batch = [Sequence([rng.randrange(5, vocab) for _ in range(args.tokens)], [0] * prompt + [1] * (args.tokens - prompt),
                      {"advantages": 1.0 if i % 2 else -1.0}) for i in range(args.sequences)]
    objective = GrpoObjective(GrpoLossConfig())

    def step() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        old = learner.logprobs(batch)
        learner.train_step(with_values(batch, old_logprobs=old), objective)
        return time.perf_counter() - wall, time.process_time() - cpu

    stop = threading.Event()
    neighbours: list = []
    if args.neighbour == "process":
        neighbours = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.neighbours)]
    elif args.neighbour == "thread":
        def churn() -> None:  # hashlib releases the GIL on large buffers: CPU-bound, as gRPC's C threads
            data = os.urandom(1 << 20)
            while not stop.is_set():
                hashlib.sha256(data).digest()
        neighbours = [threading.Thread(target=churn, daemon=True) for _ in range(args.neighbours)]
        for thread in neighbours:
            thread.start()
    try:
        samples = [learner_thread.submit(step).result() for _ in range(args.warm + args.repeats)][args.warm:]
    finally:
        stop.set()
        for neighbour in neighbours:
            if isinstance(neighbour, subprocess.Popen):
                neighbour.kill()
                neighbour.wait()
            else:
                neighbour.join()
        learner_thread.submit(learner.close).result()
        learner_thread.shutdown()
    print(json.dumps({"step_s": [s for s, _ in samples], "cpu_s": [c for _, c in samples],
                      "torch_threads": torch.get_num_threads()}), flush=True)


def measure(args: argparse.Namespace, policy: str) -> dict:
    """Run one child under `policy`; its figures and libgomp's spin count."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy != "unset":
        env["OMP_WAIT_POLICY"] = policy
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    command = [sys.executable, __file__, "--child", "--model", args.model, "--sequences", str(args.sequences),
               "--tokens", str(args.tokens), "--warm", str(args.warm), "--repeats", str(args.repeats),
               "--neighbour", args.neighbour, "--neighbours", str(args.neighbours)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode:
        raise SystemExit(f"{policy}: the child failed ({done.returncode}):\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    figures["spin_count"] = int(spin.group(1)) if spin else None  # None: not libgomp (no such display)
    return figures


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the bootstrapped tiny model)")
    parser.add_argument("--sequences", type=int, default=16, help="sequences in the batch (B x G of a step)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--warm", type=int, default=2, help="untimed steps first, in every child")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per child")
    parser.add_argument("--rounds", type=int, default=2, help="children per policy, the policies alternating")
    parser.add_argument("--policies", default=",".join(POLICIES), help="OMP_WAIT_POLICY values; unset: none")
    parser.add_argument("--neighbour", choices=NEIGHBOURS, default="process",
                        help="CPU-bound neighbours: busy processes, or threads of the learner's process")
    parser.add_argument("--neighbours", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one child may take")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    policies = [p for p in args.policies.split(",") if p]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        parser.error(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    if not args.model:
        sys.path.insert(0, str(ROOT))
        from leap.commands.demo import bootstrap, demo_toolchain

        args.model = str(bootstrap(ROOT / "runs" / "bench_learner_threads" / "model", demo_toolchain(), True))
    print(f"one learner step ({args.sequences} x {args.tokens} tokens, {args.model}) beside {args.neighbours} "
          f"CPU-bound {args.neighbour} neighbour(s), {os.cpu_count()} cores; the machine may be shared: figures are "
          "ratios measured in one run", flush=True)
    runs: dict[str, list[dict]] = {p: [] for p in policies}
    for round_ in range(args.rounds):
        for policy in policies if round_ % 2 == 0 else policies[::-1]:
            runs[policy].append(measure(args, policy))
            print(f"  round {round_ + 1} {policy}: {spread(runs[policy][-1]['step_s'])}", flush=True)
    samples = {p: [s for r in runs[p] for s in r["step_s"]] for p in policies}
    cpu = {p: [s for r in runs[p] for s in r["cpu_s"]] for p in policies}
    median = {p: statistics.median(samples[p]) for p in policies}
    baseline = median.get("ACTIVE")
    for policy in policies:
        ratio = f", {median[policy] / baseline:.2f} of ACTIVE" if baseline else ""
        print(f"{policy:>8}: {spread(samples[policy])}{ratio}; cpu {statistics.median(cpu[policy]):.3f} s per step; "
              f"libgomp spin count {runs[policy][0]['spin_count']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "step_s": median, "ratio_to_active": {p: median[p] / baseline for p in policies} if baseline else {},
            "cpu_s": {p: statistics.median(cpu[p]) for p in policies}, "samples_s": samples,
            "spin_count": {p: runs[p][0]["spin_count"] for p in policies},
            "torch_threads": runs[policies[0]][0]["torch_threads"], "neighbour": args.neighbour,
            "neighbours": args.neighbours, "sequences": args.sequences, "tokens": args.tokens}, indent=1))


if __name__ == "__main__":
    main()
