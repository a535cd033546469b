"""The contracts as shipped: every service starts with `leap serve` and answers health and
reflection over a real channel; the committed bindings match a fresh generation; `buf lint`
and `buf breaking` pass."""

from __future__ import annotations

import os
import re
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


def test_check_protos_script_runs_lint_breaking_against_the_previous_commit_and_the_binding_check():
    """scripts/check_protos.sh, what buf.yaml names and a contributor runs: buf lint, buf
    breaking (FILE) against HEAD~1, and the bindings' freshness."""
    buf()  # a clear failure when the test extra is missing
    result = subprocess.run(["bash", "scripts/check_protos.sh"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "buf lint: ok" in result.stdout and "bindings: ok" in result.stdout
    if previous_commit_with_protos() is None:
        assert "buf breaking: skipped" in result.stdout
    else:
        assert "buf breaking against HEAD~1: ok" in result.stdout


def test_every_contract_names_its_package_for_go_java_and_csharp():
    """The file options of the languages people generate into, fixed: buf.yaml leaves their
    FILE_SAME_* rules out, so this is what keeps them from changing."""
    for path in sorted((ROOT / "protos" / "leap").rglob("*.proto")):
        service = path.parent.parent.name
        text = path.read_text()
        options = {name: quoted or bare for name, quoted, bare in re.findall(r'^option (\w+) = (?:"([^"]*)"|(\w+));$', text, re.M)}
        assert options == {
            "csharp_namespace": f"Leap.{service.capitalize()}.V1",
            "go_package": f"leapsuite/gen/go/leap/{service}/v1;{service}v1",
            "java_multiple_files": "true",
            "java_outer_classname": f"{service.capitalize()}Proto",
            "java_package": f"leap.{service}.v1",
        }, path.name


def test_the_googleapis_protos_ship_beside_ours_with_their_licence():
    rpc = ROOT / "protos" / "google" / "rpc"
    assert sorted(p.name for p in rpc.glob("*.proto")) == ["code.proto", "error_details.proto", "status.proto"]
    for path in rpc.glob("*.proto"):
        assert 'Licensed under the Apache License, Version 2.0' in path.read_text(), path.name
    assert "Apache License" in (ROOT / "protos" / "google" / "LICENSE").read_text()
    # The same messages as the Python package the services use to encode them.
    from google.rpc import error_details_pb2

    assert "message BadRequest {" in (rpc / "error_details.proto").read_text()
    assert error_details_pb2.BadRequest.DESCRIPTOR.full_name == "google.rpc.BadRequest"
