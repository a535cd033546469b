"""Helpers of the sandbox tests: a real SandboxService on a background thread of the test
process (over a real gRPC channel), candidates, and a check for leftover processes."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc

from leap import prompts
from leap.common.v1 import common_pb2
from leap.runtime import BackgroundServer
from leap.sandbox.v1 import sandbox_pb2, sandbox_pb2_grpc
from svc_sandbox.server import SPEC, SandboxConfig
from tests.conftest import free_port

Stage = common_pb2.Stage
CPU = common_pb2.Toolchain.TOOLCHAIN_CPU
CUDA = common_pb2.Toolchain.TOOLCHAIN_CUDA
KERNELBENCH = common_pb2.Toolchain.TOOLCHAIN_KERNELBENCH
Flag = sandbox_pb2.VerdictFlag
Check = sandbox_pb2.Check
HEADER = "#include <math.h>\n#include <stdint.h>\n"
AS_ROOT = os.geteuid() == 0


class Sandbox:
    """A running sandbox and a stub on a channel to it."""

    def __init__(self, server: BackgroundServer, config: SandboxConfig):
        self.server = server
        self.config = config
        self.channel = grpc.insecure_channel(server.address)
        self.stub = sandbox_pb2_grpc.SandboxServiceStub(self.channel)

    @property
    def servicer(self):
        return self.server.service.registrations[0].servicer

    @property
    def work_dir(self) -> Path:
        return self.servicer.evaluator.settings.work_dir

    def evaluate(self, task_id: str, code: str, toolchain: int = CPU, *, timeout: float = 300,
                 **options) -> sandbox_pb2.Verdict:
        candidate = sandbox_pb2.Candidate(task_id=task_id, toolchain=toolchain, source=prompts.answer(code, toolchain))
        request = sandbox_pb2.EvaluateRequest(candidate=candidate, options=sandbox_pb2.EvaluateOptions(**options))
        return self.stub.Evaluate(request, timeout=timeout).verdict

    def batch(self, candidates: list[sandbox_pb2.Candidate], *, timeout: float = 600,
              **options) -> list[sandbox_pb2.Verdict]:
        request = sandbox_pb2.EvaluateBatchRequest(candidates=candidates, options=sandbox_pb2.EvaluateOptions(**options))
        verdicts: dict[int, sandbox_pb2.Verdict] = {}
        for reply in self.stub.EvaluateBatch(request, timeout=timeout):
            assert reply.index not in verdicts
            verdicts[reply.index] = reply.verdict
        assert sorted(verdicts) == list(range(len(candidates)))
        return [verdicts[i] for i in range(len(candidates))]


@contextlib.contextmanager
def running_sandbox(tmp_path: Path, **settings) -> Iterator[Sandbox]:
    settings.setdefault("cache_dir", str(tmp_path / "cache"))
    # Where the uid range starts. Sandboxes of this code take their uids with a lock and never
    # collide; LEAP_TEST_SANDBOX_UID moves tests away from older sandboxes on a shared host
    # that take none (their end-of-job sweep would kill these tests' candidates).
    if "LEAP_TEST_SANDBOX_UID" in os.environ:
        settings.setdefault("sandbox_uid", int(os.environ["LEAP_TEST_SANDBOX_UID"]))
    # Not root (a developer's machine, not CI): the sandbox cannot confine, so it would refuse
    # to start; serve unconfined so the rest of the suite runs (confinement tests skip).
    settings.setdefault("allow_unconfined", not AS_ROOT)
    config = SandboxConfig(port=free_port(), drain_seconds=0.0, grace_seconds=5.0, **settings)
    server = BackgroundServer(SPEC.build(config), config).start()
    sandbox = Sandbox(server, config)
    try:
        yield sandbox
    finally:
        sandbox.channel.close()
        server.stop()


def candidate(task_id: str, code: str, toolchain: int = CPU, label: str = "") -> sandbox_pb2.Candidate:
    return sandbox_pb2.Candidate(task_id=task_id, toolchain=toolchain, source=prompts.answer(code, toolchain),
                                 candidate_id=label)


def flags(verdict: sandbox_pb2.Verdict) -> set[str]:
    return {sandbox_pb2.VerdictFlag.Name(f).removeprefix("VERDICT_FLAG_") for f in verdict.flags}


def describe(verdict: sandbox_pb2.Verdict) -> str:
    return (f"{verdict.candidate_id or verdict.task_id}: stage {Stage.Name(verdict.stage)} flags {sorted(flags(verdict))} "
            f"message {verdict.message!r} runtime {verdict.runtime_error[-300:]!r} log {verdict.compile.log[-300:]!r}")


def processes_in(directory: Path) -> list[int]:
    """Processes whose working directory is under `directory` (leftovers of candidates)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry.name}/cwd")
            except OSError:
                continue
            if cwd.startswith(str(directory)):
                found.append(int(entry.name))
    return found


def processes_of_uids(uids) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(entry.path).st_uid in uids:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def relu(body: str, prelude: str = "") -> str:
    """A relu candidate: `body` runs inside the function (x, y, n in scope)."""
    return f'{HEADER}{prelude}\nextern "C" void relu(const float* x, float* y, int64_t n) {{\n{body}\n}}\n'


RELU_LOOP = "    for (int64_t i = 0; i < n; i++) {\n        y[i] = x[i] > 0.0f ? x[i] : 0.0f;\n    }"
