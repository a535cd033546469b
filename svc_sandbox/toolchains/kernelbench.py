"""The kernelbench toolchain: a PyTorch module `ModelNew` (which may build C++/CUDA with
`load_inline`) checked and timed against the problem's own `Model`.

A probe (a process with no candidate code) runs the problem's Model once to learn its
tensors' dtypes and shapes: they size the session's regions. In the session, the reference
process builds Model, makes every call's inputs from get_inputs() with the service's seeds
(writing them into both regions), and computes the expected outputs; the candidate's harness
builds ModelNew (its "compile"), wraps the region's buffers as tensors (torch.frombuffer),
and writes its results into them. Both are seeded alike before construction, so their
parameters match. On a GPU, STAGE copies the batch's inputs to the device and FETCH the
results back, as on the cuda toolchain.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import Any

from leap import tasks
from leap.common.v1 import common_pb2
from leap.sandbox.v1 import sandbox_pb2
from svc_sandbox import shm, trust, verdicts
from svc_sandbox.evaluator import place
from svc_sandbox.isolation import Zygote
from svc_sandbox.toolchains.base import ReferenceJob, Toolchain

Stage = common_pb2.Stage
Check = sandbox_pb2.Check


def torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class KernelbenchToolchain(Toolchain):
    def device(self, request) -> str:
        wanted = self.settings.kernelbench_device
        if wanted == "cpu" or (wanted == "auto" and self.evaluator.devices.cuda_count == 0):
            return "cpu"
        return f"cuda:{request.device_index}"

    def _probe(self, zygote: Zygote, problem: str, device: str, task_id: str, model_seed: int,
               failure: list[str]) -> dict[str, Any] | None:
        key = ("kernelbench", task_id, device, hashlib.sha256(problem.encode()).hexdigest())

        def compute() -> dict[str, Any] | None:
            with self.evaluator.job_dir(zygote) as folder:  # a run job, as the slot's uid (no candidate code)
                place(folder / "problem.py", problem)
                events = self.evaluator.talk(zygote, {"kind": "kernelbench_probe", "problem": "problem.py",
                                                      "device": device, "model_seed": model_seed,
                                                      "threads": self.settings.threads},
                                             folder, self.settings.run_timeout * 4)
                log = verdicts.read_log(folder / "run.log")
            found = next((e for e in events if e.get("event") in ("probe", "error")), None)
            if found is None or found.get("event") == "error":
                failure.append(str((found or {}).get("message") or log[-2000:] or "the probe did not answer"))
                return None
            return found

        return self.evaluator.references.probe(key, compute)

    def evaluate(self, request, code: str, verdict: sandbox_pb2.Verdict, zygote: Zygote, cwd: Path) -> None:
        settings = self.settings
        problem = tasks.kernelbench_file(request.task.id, settings.task_dirs).read_text()
        device = self.device(request)
        verdict.device = "cpu" if device == "cpu" else self.evaluator.devices.name(request.device_index)
        errors = zygote.preload("torch")
        if errors:
            verdict.stage = Stage.STAGE_RUN
            verdict.message = f"runtime error: PyTorch cannot be imported: {errors['torch']}"
            return
        fresh = request.on(Check.CHECK_FRESH_INPUTS)
        seeds = [int.from_bytes(hashlib.sha256(f"{request.seed}/{t if fresh else 0}".encode()).digest()[:4], "little")
                 for t in range(request.trials)]
        failure: list[str] = []
        probe = self._probe(zygote, problem, device, request.task.id, request.seed, failure)
        if probe is None:
            verdict.stage = Stage.STAGE_RUN
            verdict.message = "runtime error: the reference Model failed: " + "".join(failure)[-500:]
            return
        layout = shm.Layout(shm.tensors_of([t["name"] for t in probe["input_tensors"]],
                                           [t["dtype"] for t in probe["input_tensors"]],
                                           [t["shape"] for t in probe["input_tensors"]]),
                            shm.tensors_of([t["name"] for t in probe["output_tensors"]],
                                           [t["dtype"] for t in probe["output_tensors"]],
                                           [t["shape"] for t in probe["output_tensors"]]), 1)
        # The problem travels as a copy in each job's directory: the task directory itself
        # need not be readable by the candidates' uid.
        place(cwd / "candidate.py", code)
        place(cwd / "problem.py", problem)
        verdict.compile.compiler = "python"
        verdict.compile.compiler_version = f"Python {os.sys.version.split()[0]}, torch {torch_version()}"
        cuda = device != "cpu"
        options = self.options(request, staged=cuda, load_timeout=settings.kernelbench_build_timeout,
                               tolerance=request.task.tolerance, reference_timeout=settings.run_timeout * 4,
                               on_device=cuda)
        common = {"problem": "problem.py", "device": device, "model_seed": request.seed, "inputs": probe["inputs"],
                  "threads": settings.threads, "device_sync": request.on(Check.CHECK_DEVICE_SYNC),
                  "l2_flush": request.on(Check.CHECK_L2_FLUSH), "memory_bytes": 0 if cuda else settings.memory_bytes}
        # No CPU-time limit (a build runs many compiler processes). (Where the candidates' uid
        # cannot read the Python installation, which load_inline builds against, the service
        # refuses the toolchain.)
        limits = dataclasses.replace(self.limits(options, cpu=False, processes=True),
                                     file_bytes=max(settings.file_bytes, 1 << 30))
        limits = dataclasses.replace(limits, processes=max(limits.processes, 256) if limits.processes else 0)
        env = {"TORCH_EXTENSIONS_DIR": str(cwd / "torch_extensions"), "MAX_JOBS": str(max(1, settings.threads)),
               "PYTHONDONTWRITEBYTECODE": "1"}
        candidate = self.job({"kind": "kernelbench", "candidate": "candidate.py", **common}, cwd, limits, "run.log",
                             drop_privileges=True, env=env)
        reference = ReferenceJob({"kind": "kernelbench_reference", **common}, self.limits(options, cpu=False, processes=False),
                                 {"problem.py": problem}, env={"PYTHONDONTWRITEBYTECODE": "1"})
        sampling = None
        if cuda:
            sampling = functools.partial(self.evaluator.telemetry.sampling, request.device_index,
                                         settings.telemetry_interval)
        lock = self.evaluator.devices.lock(request.device_index) if cuda and request.timing else None
        source = trust.ReferenceSource(seeds, self.evaluator.references,
                                       ("kernelbench", request.task.id, device, hashlib.sha256(problem.encode()).hexdigest()))
        measurement = self.measure(zygote, layout, source, options, verdict, candidate=candidate,
                                   reference=reference, sampling=sampling, lock=lock)
        verdict.compile.seconds = measurement.load_seconds if measurement else 0.0
        log = verdicts.read_log(cwd / "run.log")
        verdict.compile.log = verdicts.trim(verdict, log, settings.max_log_bytes)
        if verdict.stage == Stage.STAGE_COMPILE:
            verdict.message = "compile error: " + verdicts.last_line(log)
