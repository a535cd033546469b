"""The contracts as shipped: every service starts with `leap serve` and answers health and
reflection over a real channel; the committed bindings match a fresh generation; `buf lint`
and `buf breaking` pass."""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from leap.runtime.config import SERVICES
from tests.conftest import ROOT, leap_serve

SERVICE_NAMES = {
    "policy": "leap.policy.v1.PolicyService",
    "sandbox": "leap.sandbox.v1.SandboxService",
    "reward": "leap.reward.v1.RewardService",
    "trainer": "leap.trainer.v1.TrainerService",
    "distill": "leap.distill.v1.DistillService",
}


def reflected_services(channel: grpc.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
    return {service.name for reply in replies for service in reply.list_services_response.service}


@pytest.mark.parametrize("service", SERVICES)
def test_leap_serve_answers_health_and_reflection(service):
    with leap_serve(service) as (address, _process):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", SERVICE_NAMES[service]):
                status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING, name
            listed = reflected_services(channel)
            assert {SERVICE_NAMES[service], "grpc.health.v1.Health"} <= listed


def test_committed_bindings_match_a_fresh_generation():
    result = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def buf() -> str:
    path = shutil.which("buf") or str(ROOT / ".venv" / "bin" / "buf")
    if not shutil.which(path):
        pytest.fail("the buf binary is missing: install the test extra (pip install -e '.[test]'), which brings buf-bin")
    return path


def test_buf_lint_standard_and_comments():
    result = subprocess.run([buf(), "lint"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def previous_commit_with_protos() -> str | None:
    """HEAD~1 when this checkout has it and it already had the contracts (buf.yaml)."""
    probe = subprocess.run(["git", "cat-file", "-e", "HEAD~1:buf.yaml"], cwd=ROOT, capture_output=True)
    return "HEAD~1" if probe.returncode == 0 else None


def test_buf_breaking_against_previous_commit():
    against = previous_commit_with_protos()
    if against is None:
        pytest.skip("no previous commit with protos in this checkout (first commit, or a shallow clone)")
    result = subprocess.run([buf(), "breaking", "--against", f".git#ref={against}"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
