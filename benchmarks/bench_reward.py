#!/usr/bin/env python3
"""What the reward service costs next to one sandbox evaluation.

Prints microseconds per group of G rollouts (default 16) for Gate and Rank, in-process (the
pure algorithms) and through gRPC (batched, a real server on loopback in this process),
beside the cost of one real `g++` compile of a trivial kernel measured in the same run, as a
ratio. The target: a group costs a negligible share (well under 1%) of one compile.

Also the cost of recording a Gate call against the size of the task history (SQLite): the
same call with 64 tasks recorded and with `--history-tasks` (default 50 000, the service's
bound) recorded, as a ratio. The target: about 1 (O(1) work per group, whatever the history
holds; the JSON file it replaced took 0.45 s a call at 60 000 tasks).

    python benchmarks/bench_reward.py [--group-size 16] [--groups 64] [--repeats 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from leap.reward.v1 import reward_pb2 as pb
from leap.reward.v1 import reward_pb2_grpc
from leap.runtime import BackgroundServer
from leap.runtime.logging import configure_logging
from svc_reward.gate import GateParams, Rollout, gate
from svc_reward.history import HistoryStore, TaskRecord
from svc_reward.rank import RankParams, Turn, rank_group
from svc_reward.server import RewardConfig, build
from svc_reward.stages import Stage

KERNEL = """
#include <cstddef>
extern "C" void relu(const float* x, float* y, std::size_t n) {
  #pragma omp parallel for
  for (std::size_t i = 0; i < n; ++i) y[i] = x[i] > 0.f ? x[i] : 0.f;
}
"""


def random_turn(rng: random.Random) -> Turn:
    stage = rng.choice(list(Stage))
    speedup = rng.uniform(0.3, 4.0) if stage == Stage.PASSED and rng.random() < 0.9 else None
    return Turn(stage, speedup, rng.randint(50, 600))


def workload(groups: int, size: int, seed: int = 0):
    rng = random.Random(seed)
    gate_groups = [(f"task{g % 40}", [Rollout(t.stage, t.speedup) for t in (random_turn(rng) for _ in range(size))])
                   for g in range(groups)]
    rank_groups = [[[random_turn(rng) for _ in range(rng.randint(1, 3))] for _ in range(size)] for _ in range(groups)]
    return gate_groups, rank_groups


def gate_request(gate_groups, dry_run: bool) -> pb.GateRequest:
    return pb.GateRequest(dry_run=dry_run, groups=[
        pb.GateGroup(task_id=task, rollouts=[pb.RolloutResult(stage=int(r.stage), speedup=r.speedup or 0.0)
                                             for r in rollouts])
        for task, rollouts in gate_groups])


def rank_request(rank_groups) -> pb.RankRequest:
    return pb.RankRequest(groups=[
        pb.RankGroup(task_id=f"task{g}", trajectories=[
            pb.Trajectory(turns=[pb.TurnResult(stage=int(t.stage), speedup=t.speedup or 0.0, generated_tokens=t.tokens)
                                 for t in trajectory])
            for trajectory in group])
        for g, group in enumerate(rank_groups)])


def median_seconds(work, repeats: int) -> float:
    work()  # warm up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def compile_seconds(repeats: int) -> float:
    compiler = shutil.which("g++")
    if compiler is None:
        sys.exit("g++ is needed for the baseline compile")
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "relu.cpp"
        source.write_text(KERNEL)
        command = [compiler, "-O2", "-std=c++17", "-fopenmp", "-shared", "-fPIC", str(source), "-o",
                   str(Path(folder) / "relu.so")]
        return median_seconds(lambda: subprocess.run(command, check=True), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=16, help="rollouts per group (G)")
    parser.add_argument("--groups", type=int, default=64, help="groups per batch (one gRPC call)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions (the median is reported)")
    parser.add_argument("--history-tasks", type=int, default=50_000, help="tasks in the large history")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()

    configure_logging("warning")  # no log line per call while timing
    gate_groups, rank_groups = workload(args.groups, args.group_size)
    per_group = {}
    per_group["Gate, in-process"] = median_seconds(lambda: gate(gate_groups, GateParams(), {}, 0.0), args.repeats)
    params = RankParams()
    per_group["Rank, in-process"] = median_seconds(lambda: [rank_group(g, params) for g in rank_groups], args.repeats)

    with tempfile.TemporaryDirectory() as folder:
        config = RewardConfig(port=_free_port(), drain_seconds=0.0, history_path=str(Path(folder) / "history.sqlite3"))
        with BackgroundServer(build(config), config) as server, grpc.insecure_channel(server.address) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            dry, recording = gate_request(gate_groups, dry_run=True), gate_request(gate_groups, dry_run=False)
            ranked = rank_request(rank_groups)
            per_group["Gate, gRPC (dry run)"] = median_seconds(lambda: stub.Gate(dry, timeout=30), args.repeats)
            per_group["Gate, gRPC (recorded, fsync)"] = median_seconds(lambda: stub.Gate(recording, timeout=30),
                                                                       args.repeats)
            per_group["Rank, gRPC"] = median_seconds(lambda: stub.Rank(ranked, timeout=30), args.repeats)

    by_history = history_scaling(gate_groups, args.history_tasks, args.repeats)
    compile_s = compile_seconds(max(3, args.repeats // 4))
    print(f"one g++ compile of a trivial kernel: {compile_s * 1e3:.1f} ms (median, same run)")
    print(f"G = {args.group_size}, {args.groups} groups per batch; medians of {args.repeats} runs\n")
    print(f"{'':32} {'us / group':>12} {'compile / group':>16} {'share of a compile':>19}")
    for name, seconds in per_group.items():
        group_s = seconds / args.groups
        print(f"{name:32} {group_s * 1e6:12.1f} {compile_s / group_s:15.0f}x {group_s / compile_s:18.4%}")
    small, large = by_history
    print(f"\nrecorded Gate of {args.groups} groups (SQLite, fsync): {small * 1e3:.2f} ms with only its own tasks in the "
          f"history, {large * 1e3:.2f} ms with {args.history_tasks} more: ratio {large / small:.2f} (target about 1)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "group_size": args.group_size, "groups": args.groups, "repeats": args.repeats, "compile_s": compile_s,
            "per_group_s": {name: seconds / args.groups for name, seconds in per_group.items()},
            "history": {"small_tasks": len({t for t, _ in gate_groups}), "large_tasks": args.history_tasks, "small_call_s": small,
                        "large_call_s": large, "ratio": large / small},
        }, indent=1))


def history_scaling(groups, large_tasks: int, repeats: int) -> tuple[float, float]:
    """Median seconds of one recording call with only its own tasks in the history, and with
    `large_tasks` more recorded first."""
    task_ids = [task_id for task_id, _ in groups]
    results = []
    for extra in (0, large_tasks):
        with tempfile.TemporaryDirectory() as folder:
            store = HistoryStore(Path(folder) / "h.sqlite3", max_tasks=large_tasks + len(groups))
            if extra:
                filler = {f"filler-{i:06d}": TaskRecord(f"filler-{i:06d}", 0.5, 8, 4, 1, 0.0) for i in range(extra)}
                store.record_call([], lambda known: (filler, b"", None))

            def call() -> None:
                store.record_call(task_ids, lambda known: (gate(groups, GateParams(), known, 0.0).history, b"", None))

            results.append(median_seconds(call, repeats))
            store.close()
    return results[0], results[1]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
