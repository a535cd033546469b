"""The shared service runtime, over real gRPC channels: auth, error mapping with rich
details, INTERNAL without tracebacks, message-size limits, health and graceful SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from leap.commands.health import check as health_check
from leap.reward.v1 import reward_pb2, reward_pb2_grpc
from leap.runtime import BackgroundServer, ServerConfig
from leap.runtime.errors import details_of
from tests.conftest import ROOT, free_port, subprocess_env, wait_for
from tests.runtime_fixture import build_service

TOKEN = "s3cret-token"


def start(**config) -> BackgroundServer:
    settings = ServerConfig(port=free_port(), drain_seconds=0.0, **config)
    return BackgroundServer(build_service(), settings).start()


@pytest.fixture
def server():
    running = start(max_message_bytes=1024 * 1024)
    yield running
    running.stop()


def stub_for(address: str) -> reward_pb2_grpc.RewardServiceStub:
    return reward_pb2_grpc.RewardServiceStub(grpc.insecure_channel(address))


def rank(task_id: str) -> reward_pb2.RankRequest:
    return reward_pb2.RankRequest(groups=[reward_pb2.RankGroup(task_id=task_id)])


def test_ok_call_passes_through(server):
    reply = stub_for(server.address).Rank(rank("ok"), timeout=10)
    assert reply.results[0].task_id == "ok"


def test_invalid_argument_carries_bad_request_details(server):
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(server.address).Rank(reward_pb2.RankRequest(), timeout=10)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "groups" in error.details()
    (bad_request,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    assert bad_request.field_violations[0].field == "groups"


def test_unexpected_exception_is_internal_without_traceback_and_server_keeps_serving(server):
    stub = stub_for(server.address)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rank(rank("boom"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "request id" in caught.value.details()
    assert "Traceback" not in caught.value.details() and "kaboom" not in caught.value.details()
    assert stub.Rank(rank("ok"), timeout=10).results[0].task_id == "ok"


def test_rpc_not_built_yet_answers_unimplemented(server):
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(server.address).GetStats(reward_pb2.GetStatsRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_oversized_message_is_resource_exhausted(server):
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(server.address).Rank(rank("x" * (2 * 1024 * 1024)), timeout=10)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_calls_are_unavailable_until_on_start_is_done_but_health_answers():
    """A restarted service accepts connections before its models are loaded: calls then get
    UNAVAILABLE (clients retry it), never an answer from a servicer that is not ready."""
    import dataclasses

    release = threading.Event()

    async def on_start() -> None:
        while not release.is_set():
            await asyncio.sleep(0.02)

    service = dataclasses.replace(build_service(), on_start=on_start)
    port = free_port()
    server = BackgroundServer(service, ServerConfig(port=port, drain_seconds=0.0))
    starter = threading.Thread(target=server.start)
    starter.start()
    address = f"127.0.0.1:{port}"
    try:
        def answered() -> str | None:
            status = health_check(address, timeout=1.0)
            return None if status.startswith("UNREACHABLE") else status

        assert wait_for(answered, 30, "the server to listen") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as caught:
            stub_for(address).Rank(rank("early"), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "starting" in caught.value.details()
        release.set()
        starter.join(30)
        assert stub_for(address).Rank(rank("ready"), timeout=10).results[0].task_id == "ready"
    finally:
        release.set()
        starter.join(30)
        server.stop()


def test_auth_rejects_missing_and_wrong_token_but_not_health():
    running = start(auth_token=TOKEN)
    try:
        channel = grpc.insecure_channel(running.address)
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Rank(rank("ok"), metadata=metadata, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ok = stub.Rank(rank("ok"), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
        assert ok.results[0].task_id == "ok"
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        running.stop()


def test_client_helper_sends_token_and_deadline():
    from leap.clients import connect

    running = start(auth_token=TOKEN)
    try:
        stub = connect("reward", running.address, aio=False, auth_token=TOKEN, unary_deadline=0.5)
        assert stub.Rank(rank("ok")).results[0].task_id == "ok"
        with pytest.raises(grpc.RpcError) as caught:  # "slow" sleeps 2 s: the default deadline fires
            stub.Rank(rank("slow"))
        assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        stub.channel.close()
    finally:
        running.stop()


def test_the_token_comes_from_a_file_or_the_environment_never_a_flag(tmp_path, capsys):
    from leap.commands import service_spec
    from leap.commands.serve import load_settings
    from leap.runtime import config as cfg

    token_file = tmp_path / "token"
    token_file.write_text(f"  {TOKEN}\n")
    spec = service_spec("reward")
    from_file = load_settings(spec, ["--auth-token-file", str(token_file)])
    assert from_file.auth_token == TOKEN
    from_env = cfg.load(spec.config_class, "reward", env={"LEAP_AUTH_TOKEN": TOKEN})
    assert from_env.auth_token == TOKEN
    with pytest.raises(SystemExit):  # a command line is readable by every user (ps, /proc/PID/cmdline)
        load_settings(spec, ["--auth-token", TOKEN])
    assert "/proc/PID/cmdline" in capsys.readouterr().err
    from leap.cli import UserError
    with pytest.raises(UserError, match="cannot be read"):
        load_settings(spec, ["--auth-token-file", str(tmp_path / "missing")])
    running = start(auth_token_file=str(token_file))  # a file given to the config directly is read at start
    try:
        stub = stub_for(running.address)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Rank(rank("ok"), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Rank(rank("ok"), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10).results
    finally:
        running.stop()


def test_sigterm_drains_in_flight_calls_then_exits():
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime_fixture", str(port)], cwd=ROOT, env=subprocess_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    address = f"127.0.0.1:{port}"
    try:
        channel = grpc.insecure_channel(address)
        grpc.channel_ready_future(channel).result(timeout=60)
        health = health_pb2_grpc.HealthStub(channel)
        outcome = {}

        def slow_call():
            try:
                outcome["reply"] = stub_for(address).Rank(rank("slow"), timeout=30)
            except grpc.RpcError as err:  # pragma: no cover - the assertion below reports it
                outcome["error"] = err

        caller = threading.Thread(target=slow_call)
        caller.start()
        time.sleep(0.5)  # the slow call (2 s) is now in flight
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        caller.join(30)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["reply"].results[0].task_id == "slow"
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert process.wait(30) == 0
        log = process.stderr.read().decode()
        assert '"event": "shutting down"' in log and '"event": "stopped"' in log
    finally:
        if process.poll() is None:
            process.kill()


def test_call_log_is_json_with_request_id_method_code_latency():
    import json

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime_fixture", str(port)], cwd=ROOT, env=subprocess_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        stub.Rank(rank("ok"), metadata=(("x-request-id", "req-42"),), timeout=10)
        with pytest.raises(grpc.RpcError):
            stub.Rank(reward_pb2.RankRequest(), timeout=10)
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        lines = [json.loads(line) for line in process.stderr.read().decode().splitlines() if line.startswith("{")]
        calls = [line for line in lines if line.get("event") == "call"]
        assert {"request_id": "req-42", "code": "OK"}.items() <= calls[0].items()
        assert calls[0]["method"] == "/leap.reward.v1.RewardService/Rank" and calls[0]["latency_ms"] >= 0
        assert calls[1]["code"] == "INVALID_ARGUMENT" and calls[1]["request_id"] != "req-42"
    finally:
        if process.poll() is None:
            process.kill()


def make_certificates(directory) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed; TLS certificates cannot be made for the test")
    d = str(directory)

    def sh(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    sh("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=leap-test-ca")
    for name in ("server", "client"):
        sh("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (directory / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        sh("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
           "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {name: str(directory / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def test_tls_and_mutual_tls(tmp_path):
    from leap.clients import connect

    certs = make_certificates(tmp_path)
    running = start(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca.pem"])
    try:
        good = connect("reward", running.address, aio=False, tls_ca=certs["ca.pem"],
                       tls_cert=certs["client.pem"], tls_key=certs["client.key"])
        assert good.Rank(rank("ok")).results[0].task_id == "ok"
        no_client_cert = connect("reward", running.address, aio=False, tls_ca=certs["ca.pem"], max_attempts=1, unary_deadline=5)
        with pytest.raises(grpc.RpcError) as caught:
            no_client_cert.Rank(rank("ok"))
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake is refused
        plaintext = connect("reward", running.address, aio=False, max_attempts=1, unary_deadline=5)
        with pytest.raises(grpc.RpcError):
            plaintext.Rank(rank("ok"))
        for stub in (good, no_client_cert, plaintext):
            stub.channel.close()
    finally:
        running.stop()
