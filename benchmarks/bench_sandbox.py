"""Sandbox speed and timing noise, as ratios measured in one run on this machine (DESIGN.md,
"Figures"):

1. compile: one kernel through the sandbox's compile stage cold and from the cache, against
   the same kernel built by torch.utils.cpp_extension.load_inline (targets: >= 20x faster
   cold, a cache hit under 5 ms); and a whole Evaluate over gRPC, cold and cached;
2. throughput: the built-in suite's solutions in one batch, with 1 worker and with one per
   core, through `leap serve sandbox`, after a first batch that every task's first timed
   evaluation makes slower (target: near-linear in the cores); with --baseline, the same for
   an earlier checkout (goal: at least 0.7 of its throughput);
3. noise: the relu and gemm solutions evaluated --noise-runs times each (default 30) with the
   machine as it is, beside --busy CPU-bound processes, and with --load demo while `leap demo`
   trains on the same cores; the 95th over the 5th percentile of the speedups (goal: at most
   1.3 in each), and for --baseline the same;
4. with --gpu: every CUDA solution on the large preset against the PyTorch baseline, and
   the effect of the L2 flush and the device synchronize on timings.

    python benchmarks/bench_sandbox.py --json runs/bench_sandbox.json --baseline ../main --load demo

Writes results.json (and --json) and sandbox.png to --out. The sandboxes it starts use uids
from --sandbox-uid up: no other sandbox on the machine may use them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from tqdm import tqdm  # noqa: E402

from leap import prompts, tasks  # noqa: E402
from leap.common.v1 import common_pb2  # noqa: E402
from leap.runtime import BackgroundServer  # noqa: E402
from leap.runtime.logging import configure_logging, get_logger  # noqa: E402
from leap.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc  # noqa: E402
from svc_sandbox.server import SPEC, SandboxConfig, available_cores  # noqa: E402

CPU, CUDA = common_pb2.Toolchain.TOOLCHAIN_CPU, common_pb2.Toolchain.TOOLCHAIN_CUDA
SOLUTION = tasks.ExampleKind.EXAMPLE_KIND_SOLUTION


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Sandbox:
    def __init__(self, directory: Path, **settings):
        config = SandboxConfig(port=free_port(), drain_seconds=0.0, cache_dir=str(directory / f"cache-{uuid.uuid4().hex}"),
                               log_level="warning", **settings)
        self.server = BackgroundServer(SPEC.build(config), config).start()
        self.channel = grpc.insecure_channel(self.server.address)
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(self.channel)
        self.servicer = self.server.service.registrations[0].servicer

    def close(self) -> None:
        self.channel.close()
        self.server.stop()

    def evaluate(self, task_id: str, code: str, toolchain: int = CPU, **options) -> sandbox_pb2.Verdict:
        candidate = sandbox_pb2.Candidate(task_id=task_id, toolchain=toolchain, source=prompts.answer(code, toolchain))
        return self.stub.Evaluate(sandbox_pb2.EvaluateRequest(candidate=candidate, options=sandbox_pb2.EvaluateOptions(
            **options)), timeout=600).verdict

    def batch(self, candidates, **options) -> tuple[list[sandbox_pb2.Verdict], float]:
        started = time.perf_counter()
        replies = list(self.stub.EvaluateBatch(sandbox_pb2.EvaluateBatchRequest(
            candidates=candidates, options=sandbox_pb2.EvaluateOptions(**options)), timeout=3600))
        return [r.verdict for r in sorted(replies, key=lambda r: r.index)], time.perf_counter() - started


def solution(task_id: str, toolchain: int = CPU) -> str:
    return tasks.examples(tasks.get_task(task_id), toolchain, SOLUTION)[0].source


def unique(code: str) -> str:
    return code + f"// {uuid.uuid4().hex}\n"


def compile_stage(sandbox: Sandbox, code: str, runs: int) -> list[float]:
    """Seconds of the compile stage alone (the evaluator's own code path, in this process)."""
    from svc_sandbox.evaluator import resolve

    evaluator = sandbox.servicer.evaluator
    zygote = sandbox.servicer.pool.zygotes[0]
    task = tasks.get_task("relu")
    request = resolve(sandbox_pb2.Candidate(task_id="relu", toolchain=CPU, source=code), sandbox_pb2.EvaluateOptions(
        raw_source=True), task, evaluator.settings)
    seconds = []
    for _ in range(runs):
        verdict = sandbox_pb2.Verdict()
        with evaluator.job_dir(zygote) as cwd:
            started = time.perf_counter()
            assert evaluator.toolchains[CPU].compile(request, code, verdict, zygote, cwd) is not None, verdict.compile.log
            seconds.append(time.perf_counter() - started)
    return seconds


def load_inline_seconds(code: str, runs: int, directory: Path) -> list[float]:
    import torch.utils.cpp_extension as cpp

    wrapper = (code + "\n#include <torch/extension.h>\ntorch::Tensor run(torch::Tensor x) {\n"
               "    auto y = torch::empty_like(x);\n    relu(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());\n"
               "    return y;\n}\n")
    seconds = []
    for i in tqdm(range(runs), desc="load_inline (cold)", leave=False):
        build = directory / f"load_inline-{i}-{uuid.uuid4().hex[:8]}"
        build.mkdir()
        started = time.perf_counter()
        cpp.load_inline(name=f"bench_relu_{uuid.uuid4().hex[:8]}", cpp_sources=wrapper, functions=["run"],
                        extra_cflags=["-O3", "-march=native", "-fopenmp"], build_directory=str(build), verbose=False)
        seconds.append(time.perf_counter() - started)
    return seconds


def ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def bench_compile(directory: Path, quick: bool) -> dict:
    sandbox = Sandbox(directory, workers=1)
    try:
        code = solution("relu")
        cold = []
        for _ in tqdm(range(3 if quick else 10), desc="sandbox compile (cold)", leave=False):
            cold += compile_stage(sandbox, unique(code), 1)
        warm_code = unique(code)
        compile_stage(sandbox, warm_code, 1)
        hit = compile_stage(sandbox, warm_code, 20 if quick else 100)
        evaluate_cold = [sandbox.evaluate("relu", unique(code), timing=False).wall_seconds for _ in range(3 if quick else 10)]
        evaluate_hit = [sandbox.evaluate("relu", warm_code, timing=False).wall_seconds for _ in range(10 if quick else 50)]
        evaluate_timed = [sandbox.evaluate("relu", warm_code).wall_seconds for _ in range(5 if quick else 20)]
    finally:
        sandbox.close()
    inline = load_inline_seconds(code, 1 if quick else 2, directory)
    return {"sandbox_cold_ms": ms(cold), "sandbox_hit_ms": ms(hit), "load_inline_cold_ms": ms(inline),
            "cold_speedup_vs_load_inline": ms(inline) / ms(cold), "evaluate_cold_ms": ms(evaluate_cold),
            "evaluate_cached_ms": ms(evaluate_hit), "evaluate_cached_timed_ms": ms(evaluate_timed)}


class Served:
    """`leap serve sandbox` of a checkout (this one, or the baseline it is compared with) as a
    process of its own, reached over gRPC: both sides measured the same way, in one run."""

    def __init__(self, checkout: Path, directory: Path, uid: int, **flags):
        from leap.commands.health import check

        self.checkout = checkout
        python = checkout / ".venv" / "bin" / "python"
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        args = [str(python if python.exists() else sys.executable), "-m", "leap", "serve", "sandbox", "--port", str(port),
                "--cache-dir", str(directory / f"cache-{uuid.uuid4().hex}"), "--sandbox-uid", str(uid),
                "--log-level", "warning"]
        for name, value in flags.items():
            args += [f"--{name.replace('_', '-')}", str(value)]
        env = dict(os.environ, PYTHONPATH=str(checkout))
        self.log = open(directory / f"serve-{port}.log", "wb")
        self.process = subprocess.Popen(args, cwd=checkout, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + 180
        while check(self.address, timeout=1.0) != "SERVING":
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the sandbox of {checkout} did not start: see {self.log.name}")
            time.sleep(0.2)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(self.channel)

    def evaluate(self, task_id: str, code: str, **options) -> sandbox_pb2.Verdict:
        candidate = sandbox_pb2.Candidate(task_id=task_id, toolchain=CPU, source=prompts.answer(code, CPU))
        return self.stub.Evaluate(sandbox_pb2.EvaluateRequest(candidate=candidate, options=sandbox_pb2.EvaluateOptions(
            **options)), timeout=600).verdict

    def batch(self, candidates, **options) -> tuple[list[sandbox_pb2.Verdict], float]:
        started = time.perf_counter()
        replies = list(self.stub.EvaluateBatch(sandbox_pb2.EvaluateBatchRequest(
            candidates=candidates, options=sandbox_pb2.EvaluateOptions(**options)), timeout=3600))
        return [r.verdict for r in sorted(replies, key=lambda r: r.index)], time.perf_counter() - started

    def close(self) -> None:
        if getattr(self, "channel", None) is not None:
            self.channel.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


@contextlib.contextmanager
def served(checkout: Path, directory: Path, uid: int, **flags):
    sandbox = Served(checkout, directory, uid, **flags)
    try:
        yield sandbox
    finally:
        sandbox.close()


def bench_throughput(directory: Path, quick: bool, checkout: Path, uid: int, **flags) -> dict:
    """The built-in suite's solutions (each made distinct, so each compiles) in one batch, with
    1 worker and one per core; timing_trials=5 and warmup_runs=1 as every version of this
    benchmark has used; `flags`: more `leap serve sandbox` options.

    Each service first judges the suite once (`first_batch`: what a service just started
    costs, every task's first timed evaluation measuring its pace), then the measured batch
    (`per_second`: a service that has seen its tasks, as one does through a training run)."""
    suite = tasks.load_suite()
    copies = 1 if quick else 2
    cores = available_cores()
    results = {}

    def batch_of(count: int) -> list:
        return [sandbox_pb2.Candidate(task_id=t.id, toolchain=CPU, source=prompts.answer(unique(solution(t.id))))
                for t in suite for _ in range(count)]

    for workers in sorted({1, cores}):
        with served(checkout, directory, uid, workers=workers, threads_per_candidate=1, **flags) as sandbox:
            first = batch_of(1)
            _, first_seconds = sandbox.batch(first, timing_trials=5, warmup_runs=1)
            batch = batch_of(copies)
            verdicts, seconds = sandbox.batch(batch, timing_trials=5, warmup_runs=1)
            failed = [f"{v.task_id}: {v.message}" for v in verdicts if v.stage != common_pb2.Stage.STAGE_PASSED]
            results[workers] = {"candidates": len(batch), "seconds": seconds, "per_second": len(batch) / seconds,
                                "first_batch": {"candidates": len(first), "seconds": first_seconds,
                                                "per_second": len(first) / first_seconds},
                                "not_passed": failed}
    scaling = results[cores]["per_second"] / results[1]["per_second"] if cores > 1 else 1.0
    return {"cores": cores, "by_workers": results, "scaling": scaling, "scaling_efficiency": scaling / cores}


# ------------------------------------------------------------------------------------------
# Noise: one honest solution evaluated many times, with the machine quiet, beside CPU-bound
# processes, or while a `leap demo` trains on the same cores.


@contextlib.contextmanager
def busy(count: int):
    """`count` CPU-bound processes (each spins a core) for as long as the block lasts."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


@contextlib.contextmanager
def demo_load(directory: Path, warmup: float, limit: float):
    """`leap demo` training on this machine (its own stack: policy, sandbox, reward, trainer),
    started `warmup` seconds before the block (the tiny model is built, or taken from
    `directory`'s cache, and the stack starts) and ended after it, or after `limit` seconds."""
    directory.mkdir(parents=True, exist_ok=True)
    log = open(directory / "demo-load.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "leap", "demo", "--steps", "1000", "--quiet",
                                "--out", str(directory)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    killer = threading.Timer(limit, lambda: os.killpg(process.pid, signal.SIGTERM))
    killer.start()
    try:
        deadline = time.monotonic() + warmup
        while time.monotonic() < deadline and process.poll() is None:
            time.sleep(1)
        if process.poll() is not None:
            raise RuntimeError(f"leap demo ended early: see {log.name}")
        yield
    finally:
        killer.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def spread(values: list[float]) -> float:
    """95th over 5th percentile (the noise figure of DESIGN.md); inf when a value is 0."""
    import numpy as np

    low, high = np.percentile(values, 5), np.percentile(values, 95)
    return float(high / low) if low > 0 else float("inf")


def bench_noise(sandbox: Served, runs: int, label: str) -> dict:
    rows = {}
    for task_id in ("relu", "gemm"):
        code = solution(task_id)
        sandbox.evaluate(task_id, code)  # compiled and its pools drawn before the runs that count
        speedups, widths, unreliable, seconds = [], [], 0, []
        for _ in tqdm(range(runs), desc=f"noise {label} {task_id}", leave=False):
            verdict = sandbox.evaluate(task_id, code)
            assert verdict.stage == common_pb2.Stage.STAGE_PASSED, verdict.message
            speedups.append(verdict.speedup)
            seconds.append(verdict.wall_seconds)
            if verdict.speedup_high:
                widths.append((verdict.speedup_high - verdict.speedup_low) / verdict.speedup)
            unreliable += sandbox_pb2.VERDICT_FLAG_TIMING_UNRELIABLE in verdict.flags
        rows[task_id] = {"speedups": speedups, "p95_over_p5": spread(speedups), "median": statistics.median(speedups),
                         "min": min(speedups), "max": max(speedups), "timing_unreliable": unreliable,
                         "median_interval_width": statistics.median(widths) if widths else None,
                         "median_evaluate_s": statistics.median(seconds)}
    return rows


def noise_conditions(args: argparse.Namespace, directory: Path, checkout: Path, uid: int, **flags) -> dict:
    """The noise figure of one checkout under every condition asked for (`flags`: more
    `leap serve sandbox` options)."""
    results = {}
    runs = 8 if args.quick else args.noise_runs
    conditions = [("quiet", contextlib.nullcontext)]
    if args.busy:
        conditions.append((f"beside {args.busy} busy processes", lambda: busy(args.busy)))
    if args.load == "demo":
        conditions.append(("while leap demo trains", lambda: demo_load(Path(args.load_dir), args.load_warmup,
                                                                      args.load_seconds)))
    with served(checkout, directory, uid, **flags) as sandbox:
        for label, condition in conditions:
            with condition():
                row = results[label] = {"load_average": os.getloadavg()[0], **bench_noise(sandbox, runs, label)}
            for task_id in ("relu", "gemm"):
                r = row[task_id]
                print(f"{checkout.name} noise, {label} (load {row['load_average']:.1f}), {task_id}: p95/p5 "
                      f"{r['p95_over_p5']:.2f} (goal <= 1.3), median {r['median']:.2f}x, {r['min']:.2f}-{r['max']:.2f}x, "
                      f"{r['timing_unreliable']} TIMING_UNRELIABLE", flush=True)
    return results


def bench_gpu(directory: Path, quick: bool) -> dict:
    sandbox = Sandbox(directory)
    try:
        if not sandbox.servicer.evaluator.devices.cuda_count:
            return {"skipped": sandbox.servicer.evaluator.devices.reason}
        suite = tasks.load_suite()
        batch = [sandbox_pb2.Candidate(task_id=t.id, toolchain=CUDA, source=prompts.answer(solution(t.id, CUDA), CUDA))
                 for t in suite]
        verdicts, seconds = sandbox.batch(batch)
        per_task = {v.task_id: {"stage": common_pb2.Stage.Name(v.stage), "speedup": v.speedup,
                                "candidate_ms": v.candidate_timing.median_ms, "reference_ms": v.reference_timing.median_ms,
                                "candidate_std_ms": v.candidate_timing.std_ms, "compile_s": v.compile.seconds,
                                "speedup_low": v.speedup_low, "speedup_high": v.speedup_high,
                                "flags": [sandbox_pb2.VerdictFlag.Name(f) for f in v.flags],
                                "sm_clock_mhz": [s.sm_clock_mhz for s in v.telemetry][:3]} for v in verdicts}
        checks = {}
        for task_id in ("relu", "gemv", "softmax"):
            code = solution(task_id, CUDA)
            rows = {}
            for label, disabled in (("all checks", []), ("no L2 flush", [sandbox_pb2.CHECK_L2_FLUSH]),
                                    ("no device sync", [sandbox_pb2.CHECK_DEVICE_SYNC])):
                verdict = sandbox.evaluate(task_id, code, CUDA, disabled_checks=disabled, timing_trials=20)
                rows[label] = {"median_ms": verdict.candidate_timing.median_ms, "std_ms": verdict.candidate_timing.std_ms}
            checks[task_id] = rows
        cached = sandbox.evaluate("relu", solution("relu", CUDA), CUDA)
        return {"batch_seconds": seconds, "per_task": per_task, "timing_checks": checks,
                "nvcc_cold_s": per_task["relu"]["compile_s"], "cached_evaluate_ms": cached.wall_seconds * 1e3,
                "passed": sum(p["stage"] == "STAGE_PASSED" for p in per_task.values()), "tasks": len(per_task)}
    finally:
        sandbox.close()


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if "gpu" in results and "per_task" in results["gpu"] else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    c = results["compile"]
    axes[0].bar(["sandbox\ncache hit", "sandbox\ncold", "load_inline\ncold"],
                [c["sandbox_hit_ms"], c["sandbox_cold_ms"], c["load_inline_cold_ms"]], color=["#4c9", "#49c", "#c74"])
    axes[0].set_yscale("log")
    axes[0].set_ylabel("compile latency (ms, log)")
    axes[0].set_title(f"compile: {c['cold_speedup_vs_load_inline']:.0f}x faster than load_inline")
    t = results["throughput"]["current"]
    workers = sorted(int(w) for w in t["by_workers"])
    axes[1].plot(workers, [t["by_workers"][w]["per_second"] for w in workers], "o-", label="measured")
    axes[1].plot(workers, [t["by_workers"][workers[0]]["per_second"] * w for w in workers], "--", label="linear")
    axes[1].set_xlabel("workers")
    axes[1].set_ylabel("candidates / s")
    axes[1].set_title(f"batch throughput ({t['scaling']:.2f}x on {t['cores']} cores)")
    axes[1].legend()
    if panels == 3:
        per_task = results["gpu"]["per_task"]
        names = sorted(per_task)
        axes[2].barh(names, [per_task[n]["speedup"] for n in names])
        axes[2].axvline(1.0, color="k", lw=0.8)
        axes[2].set_xscale("log")
        axes[2].set_title("CUDA solutions vs PyTorch (large preset)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def save(results: dict, out: Path, json_path: str | None) -> None:
    """Write what is measured so far (a long run that fails late keeps its earlier parts)."""
    text = json.dumps(results, indent=2, default=str)
    (out / "results.json").write_text(text)
    if json_path:
        Path(json_path).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/bench_sandbox", help="directory for results.json and sandbox.png")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--sections", default="compile,throughput,noise",
                        help="what to measure, comma-separated: compile, throughput, noise (default all three)")
    parser.add_argument("--gpu", action="store_true", help="also run the GPU part (needs an NVIDIA GPU)")
    parser.add_argument("--gpu-only", action="store_true", help="run only the GPU part")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--baseline", help="a checkout of an earlier sandbox (for example the main branch's) to "
                                           "measure the same way in the same run: throughput and noise are reported "
                                           "against it")
    parser.add_argument("--noise-runs", type=int, default=30, help="evaluations per task and condition (default 30)")
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound processes to start for the noise figure's "
                                                            "busy condition (default 2; 0: leave it out)")
    parser.add_argument("--load", choices=["none", "demo"], default="none",
                        help="demo: also measure the noise while `leap demo` trains on this machine")
    parser.add_argument("--load-dir", default="runs/bench-demo-load", help="where the demo load keeps its model "
                                                                           "(built once, then reused)")
    parser.add_argument("--load-warmup", type=float, default=120.0, help="seconds the demo runs before measuring")
    parser.add_argument("--load-seconds", type=float, default=1800.0, help="the demo is stopped after this long")
    parser.add_argument("--sandbox-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a `leap serve sandbox` option for the current checkout's sandboxes (throughput and "
                             "noise; repeatable), to measure a setting against the baseline: for example "
                             "timing_max_runs=8 (what trades throughput against the timing's interval)")
    parser.add_argument("--sandbox-uid", type=int, default=62000,
                        help="uid base of the sandboxes started here (each gets its own range: other sandboxes on "
                             "this host must not share it)")
    args = parser.parse_args()
    options = {}
    for item in args.sandbox_option:
        name, equals, value = item.partition("=")
        if not equals or not name.strip():
            parser.error(f"--sandbox-option takes NAME=VALUE (for example timing_max_runs=8), got {item!r}")
        options[name.strip().replace("-", "_")] = value
    configure_logging("warning")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = get_logger("bench")
    sections = set() if args.gpu_only else {s.strip() for s in args.sections.split(",") if s.strip()}
    checkouts = {"current": ROOT}
    if args.baseline:
        checkouts["baseline"] = Path(args.baseline).resolve()
    results: dict = {"machine": {"cores": available_cores(), "load_average_at_start": os.getloadavg(),
                                 "note": "figures vary with what else runs on the machine: compare ratios taken in "
                                         "one run"},
                     "checkouts": {k: str(v) for k, v in checkouts.items()}, "current_options": options}
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as scratch:
        directory = Path(scratch)
        os.chmod(directory, 0o755)
        if "compile" in sections:
            results["compile"] = bench_compile(directory, args.quick)
            c = results["compile"]
            print(f"compile, cold:           sandbox {c['sandbox_cold_ms']:.0f} ms, load_inline {c['load_inline_cold_ms']:.0f} ms"
                  f" -> {c['cold_speedup_vs_load_inline']:.0f}x faster (target >= 20x)")
            print(f"compile, cache hit:      {c['sandbox_hit_ms']:.2f} ms (target < 5 ms)")
            print(f"Evaluate over gRPC:      cold {c['evaluate_cold_ms']:.0f} ms, cached {c['evaluate_cached_ms']:.0f} ms, "
                  f"cached and timed {c['evaluate_cached_timed_ms']:.0f} ms")
        if "throughput" in sections:
            results["throughput"] = {}
            for offset, (name, checkout) in enumerate(checkouts.items()):
                t = results["throughput"][name] = bench_throughput(directory, args.quick, checkout,
                                                                   args.sandbox_uid + 100 * offset,
                                                                   **(options if name == "current" else {}))
                for workers, row in sorted(t["by_workers"].items()):
                    print(f"{name} batch, {workers} worker(s): {row['candidates']} candidates in {row['seconds']:.1f} s "
                          f"= {row['per_second']:.2f}/s" + (f" ({len(row['not_passed'])} did not pass)"
                                                             if row["not_passed"] else "")
                          + f" (a just-started service's first batch: {row['first_batch']['per_second']:.2f}/s)")
                print(f"{name} throughput scaling: {t['scaling']:.2f}x with {t['cores']} workers")
                save(results, out, args.json)
            if "baseline" in checkouts:
                cores = available_cores()
                ratio = (results["throughput"]["current"]["by_workers"][cores]["per_second"]
                         / results["throughput"]["baseline"]["by_workers"][cores]["per_second"])
                first = (results["throughput"]["current"]["by_workers"][cores]["first_batch"]["per_second"]
                         / results["throughput"]["baseline"]["by_workers"][cores]["first_batch"]["per_second"])
                results["throughput"]["current_over_baseline"] = ratio
                results["throughput"]["first_batch_current_over_baseline"] = first
                print(f"throughput against the baseline: {ratio:.2f} (goal >= 0.7); a just-started service's first "
                      f"batch: {first:.2f}")
        if "noise" in sections:
            results["noise"] = {}
            for offset, (name, checkout) in enumerate(checkouts.items()):
                results["noise"][name] = noise_conditions(args, directory, checkout,
                                                          args.sandbox_uid + 100 * (offset + 2),
                                                          **(options if name == "current" else {}))
                save(results, out, args.json)
        if args.gpu or args.gpu_only:
            results["gpu"] = bench_gpu(directory, args.quick)
            g = results["gpu"]
            if "skipped" in g:
                print(f"gpu: skipped ({g['skipped']})")
            else:
                print(f"gpu: {g['passed']}/{g['tasks']} CUDA solutions passed; nvcc cold {g['nvcc_cold_s']:.2f} s; "
                      f"cached Evaluate {g['cached_evaluate_ms']:.0f} ms")
                for task_id, row in sorted(g["per_task"].items()):
                    print(f"  {task_id:14s} {row['stage']:13s} {row['candidate_ms']:9.3f} ms vs {row['reference_ms']:9.3f} ms"
                          f"  speedup {row['speedup']:.2f} ({row['speedup_low']:.2f}-{row['speedup_high']:.2f})"
                          f"  {' '.join(row['flags'])}")
                for task_id, rows in g["timing_checks"].items():
                    print(f"  {task_id}: " + ", ".join(f"{k} {v['median_ms']:.3f} ms" for k, v in rows.items()))
    save(results, out, args.json)
    if "compile" in results and "throughput" in results:
        plot(results, out / "sandbox.png")
    log.warning("benchmark written", out=str(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
