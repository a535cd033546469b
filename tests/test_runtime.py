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


# -- bounded statuses (issue #15, item 6) ------------------------------------------------


def wire_bytes(error: grpc.RpcError) -> int:
    """What a failed call's status cost in the trailers: the percent-encoded message plus
    the base64 of grpc-status-details-bin."""
    from grpc_status import rpc_status

    from leap.runtime.errors import message_wire_bytes, status_wire_bytes

    status = rpc_status.from_call(error)
    return status_wire_bytes(status) if status is not None else message_wire_bytes(error.details() or "")


def bad_request_of(error: grpc.RpcError) -> error_details_pb2.BadRequest:
    (bad_request,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.BadRequest)]
    return bad_request


def test_many_violations_are_capped_with_a_count_of_the_rest(server):
    """GetTaskHistory with 100 empty ids: the client (default limits) gets INVALID_ARGUMENT
    listing 20 of them and one "..." entry counting the other 80, all far under 8 KiB."""
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(server.address).GetTaskHistory(reward_pb2.GetTaskHistoryRequest(task_ids=[""] * 100), timeout=10)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = bad_request_of(error).field_violations
    assert [v.field for v in violations[:20]] == [f"task_ids[{i}]" for i in range(20)]
    assert len(violations) == 21 and violations[20].field == "..." and "and 80 more" in violations[20].description
    assert "task_ids[0]: must not be empty" in error.details() and "more" in error.details()
    assert wire_bytes(error) <= 4096


def test_a_lone_violation_reaches_the_message_whole_where_it_fits():
    """Most errors name one field, and the explanation is at the end of its description: a
    client that reads only the status message (another language's, a log line) gets all of it;
    one too long for the message, or several, are shortened there (the BadRequest keeps each)."""
    from leap.runtime.errors import MAX_MESSAGE_WIRE_BYTES, Violations, invalid_argument, message_wire_bytes

    why = ("no teacher reaches rho = 0.5 on any training task (the highest pass rate there is 0.375): "
           "every example would be skipped")
    assert invalid_argument("config.reliability_threshold", why).message == f"invalid request: config.reliability_threshold: {why}"
    long = invalid_argument("config.train_tasks", "é" * 390 + " the end")  # 400 characters, mostly 3 wire bytes each
    assert "chars cut" in long.message and long.message.endswith(" the end")
    assert message_wire_bytes(long.message) <= MAX_MESSAGE_WIRE_BYTES
    several = Violations().add("config.steps", why).add("config.seed", why).error().message
    assert several.count("chars cut") == 2 and "config.seed" in several


def test_echoed_values_are_cut_with_their_length(server):
    """A 20 KB task id comes back as its first 120 characters and its length."""
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(server.address).GetTaskHistory(reward_pb2.GetTaskHistoryRequest(task_ids=["t" * 20_000]), timeout=10)
    error = caught.value
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "t" * 120 + "... (20000 chars)" in error.details() and "t" * 121 not in error.details()
    (info,) = [d for d in details_of(error) if isinstance(d, error_details_pb2.ResourceInfo)]
    assert info.resource_name == "t" * 120 + "... (20000 chars)"
    assert wire_bytes(error) <= 4096


def test_a_status_of_megabytes_from_a_careless_handler_still_reaches_the_client(server):
    """A handler raising a 1 MB message with 5,000 violations of 2.5 KB each (raw
    ServiceError, no Violations): the runtime shrinks it; the client sees INVALID_ARGUMENT
    with the first violations, not RESOURCE_EXHAUSTED for oversized metadata."""
    with pytest.raises(grpc.RpcError) as caught:
        stub_for(server.address).Rank(rank("huge-error"), timeout=30)
    error = caught.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    violations = bad_request_of(error).field_violations
    assert violations[0].field.startswith("groups[0].fff") and "chars cut" in violations[0].field
    assert violations[-1].field == "..." and int(violations[-1].description.split()[1]) == 5000 - (len(violations) - 1)
    assert error.details().startswith("mmm") and len(error.details()) <= 768
    assert wire_bytes(error) <= 4096


def test_bounded_status_of_any_detail_fits_the_budget():
    """Unit check of the generic bound: strings, maps and repeated fields of any detail type
    shrink until the status fits; a status that fits is untouched."""
    from leap.runtime.errors import MAX_STATUS_WIRE_BYTES, bounded_status, status_wire_bytes

    info = error_details_pb2.ErrorInfo(reason="BIG", metadata={str(i): "v" * 3000 for i in range(200)})
    status = bounded_status(grpc.StatusCode.FAILED_PRECONDITION, "\x00é%" * 50_000, [info])
    assert status_wire_bytes(status) <= MAX_STATUS_WIRE_BYTES
    (packed,) = status.details
    unpacked = error_details_pb2.ErrorInfo()
    packed.Unpack(unpacked)
    assert unpacked.reason == "BIG" and 0 < len(unpacked.metadata) < 200
    small = bounded_status(grpc.StatusCode.NOT_FOUND, "task 'relu' not found", [error_details_pb2.ResourceInfo(
        resource_type="task", resource_name="relu")])
    assert small.message == "task 'relu' not found"
    assert small.details[0].Unpack(unpacked := error_details_pb2.ResourceInfo()) and unpacked.resource_name == "relu"


# -- request bytes: parsed after auth, per-RPC limits, finite floats (items 7, 8, 1) -------


RANK = "/leap.reward.v1.RewardService/Rank"
UPDATE_WEIGHTS = "/leap.policy.v1.PolicyService/UpdateWeights"
GENERATE_STREAM = "/leap.policy.v1.PolicyService/GenerateStream"
GARBAGE = b"\xff\xff\xff\xff\x0f not a protobuf"


def test_garbage_bytes_are_invalid_argument_on_unary_and_stream_rpcs(server):
    channel = grpc.insecure_channel(server.address)
    with pytest.raises(grpc.RpcError) as caught:
        channel.unary_unary(RANK)(GARBAGE, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid leap.reward.v1.RankRequest message" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        list(channel.unary_stream(GENERATE_STREAM)(GARBAGE, timeout=10))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    from leap.policy.v1 import policy_pb2

    good = policy_pb2.UpdateWeightsRequest(model="m", chunk=policy_pb2.TensorChunk(data=b"abc")).SerializeToString()
    with pytest.raises(grpc.RpcError) as caught:
        channel.stream_unary(UPDATE_WEIGHTS)(iter([good, good, GARBAGE, good]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields_of(caught.value) == ["messages[2]"]
    # The server keeps serving, the streams too.
    reply = channel.stream_unary(UPDATE_WEIGHTS)(iter([good] * 3), timeout=10)
    assert policy_pb2.UpdateWeightsResponse.FromString(reply).tensors_updated == 3


def violated_fields_of(error: grpc.RpcError) -> list[str]:
    from leap.runtime.errors import violated_fields

    return violated_fields(error)


def test_garbage_bytes_are_refused_after_auth_and_logged_as_json_with_a_request_id():
    """Unauthenticated garbage is UNAUTHENTICATED (nothing is parsed before auth); with the
    token it is INVALID_ARGUMENT, in the JSON call log with the request id; no gRPC
    "Unexpected DecodeError" line."""
    import json

    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.runtime_fixture", str(port), TOKEN], cwd=ROOT, env=subprocess_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=60)
        rank_raw = channel.unary_unary(RANK)
        with pytest.raises(grpc.RpcError) as caught:
            rank_raw(GARBAGE, metadata=(("x-request-id", "garbage-1"),), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            rank_raw(GARBAGE, metadata=(("x-request-id", "garbage-2"), ("authorization", f"Bearer {TOKEN}")),
                     timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        process.send_signal(signal.SIGTERM)
        process.wait(30)
        text = process.stderr.read().decode()
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        calls = {line["request_id"]: line for line in lines if line.get("event") == "call"}
        assert calls["garbage-1"]["code"] == "UNAUTHENTICATED"
        assert calls["garbage-2"]["code"] == "INVALID_ARGUMENT" and calls["garbage-2"]["method"] == RANK
        assert "DecodeError" not in text and all(line.startswith("{") for line in text.splitlines() if line.strip())
    finally:
        if process.poll() is None:
            process.kill()


def test_each_rpc_has_its_own_receive_limit_checked_before_parsing(server):
    """GetTaskHistory takes at most 64 KiB: 100 KB of ids is RESOURCE_EXHAUSTED naming the
    limit (garbage of that size too: the size is checked first). UpdateWeights takes the
    server's ceiling (1 MiB here): 900 KB chunks pass, 2 MiB is refused by gRPC itself."""
    from leap.policy.v1 import policy_pb2

    stub = stub_for(server.address)
    channel = grpc.insecure_channel(server.address)
    too_many_ids = reward_pb2.GetTaskHistoryRequest(task_ids=["t" * 1000] * 100).SerializeToString()
    for request in (too_many_ids, GARBAGE * 10_000):
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/leap.reward.v1.RewardService/GetTaskHistory")(request, timeout=10)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "65536-byte limit of GetTaskHistory" in caught.value.details()
        (info,) = [d for d in details_of(caught.value) if isinstance(d, error_details_pb2.ErrorInfo)]
        assert info.reason == "REQUEST_TOO_LARGE" and info.metadata["limit_bytes"] == "65536"
    with pytest.raises(grpc.RpcError) as caught:  # just under the limit: parsed, and refused for what it says
        stub.GetTaskHistory(reward_pb2.GetTaskHistoryRequest(task_ids=["t" * 1000] * 60), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    weights = policy_pb2_grpc_stub(server.address)
    chunk = policy_pb2.UpdateWeightsRequest(chunk=policy_pb2.TensorChunk(data=b"w" * 900_000))
    assert weights.UpdateWeights(iter([chunk] * 3), timeout=30).bytes_received == 2_700_000
    with pytest.raises(grpc.RpcError) as caught:
        weights.UpdateWeights(iter([policy_pb2.UpdateWeightsRequest(chunk=policy_pb2.TensorChunk(
            data=b"w" * 2_000_000))]), timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def policy_pb2_grpc_stub(address: str):
    from leap.policy.v1 import policy_pb2_grpc

    return policy_pb2_grpc.PolicyServiceStub(grpc.insecure_channel(address))


def test_a_limit_for_an_rpc_the_service_lacks_is_refused_at_start():
    from leap.runtime import Registration, Service
    from leap.runtime.server import method_rules

    registration = Registration("leap.reward.v1.RewardService", reward_pb2_grpc.add_RewardServiceServicer_to_server,
                                object(), request_limits={"Rnak": 1024})
    with pytest.raises(ValueError, match="no RPC Rnak"):
        method_rules([registration], 1 << 20)
    assert Service  # the registration above is what a Service holds


def ranked(speedups: list[float]) -> reward_pb2.RankRequest:
    trajectories = [reward_pb2.Trajectory(turns=[reward_pb2.TurnResult(speedup=s)]) for s in speedups]
    return reward_pb2.RankRequest(groups=[reward_pb2.RankGroup(task_id="ok", trajectories=trajectories)])


def test_non_finite_floats_are_refused_naming_each_field(server):
    stub = stub_for(server.address)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rank(ranked([1.0, float("nan"), float("inf"), -float("inf"), 2.0]), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violated_fields_of(caught.value) == [f"groups[0].trajectories[{i}].turns[0].speedup" for i in (1, 2, 3)]
    assert "finite" in caught.value.details()
    assert stub.Rank(ranked([1.0, 5e-324, 1e308]), timeout=10).results[0].task_id == "ok"
    big = ranked([1.5] * 30_000 + [float("nan")])  # over 256 KiB: parsed and walked on a worker thread
    assert big.ByteSize() > 256 * 1024
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rank(big, timeout=30)
    assert violated_fields_of(caught.value) == ["groups[0].trajectories[30000].turns[0].speedup"]


def test_a_float_field_can_be_exempted_from_the_finite_check():
    import dataclasses

    from leap.runtime import Registration

    base = build_service()
    reward = dataclasses.replace(base.registrations[0], finite_exempt=frozenset({"leap.reward.v1.TurnResult.speedup"}))
    assert isinstance(reward, Registration)
    service = dataclasses.replace(base, registrations=[reward, *base.registrations[1:]])
    with BackgroundServer(service, ServerConfig(port=free_port(), drain_seconds=0.0)) as running:
        assert stub_for(running.address).Rank(ranked([float("inf")]), timeout=10).results[0].task_id == "ok"


def test_non_finite_fields_walks_maps_repeated_and_nested_messages():
    from google.protobuf import struct_pb2

    from leap.runtime.checks import has_floats, non_finite_fields

    value = struct_pb2.Struct()
    value.update({"lr": float("inf"), "ok": 1.0, "nested": {"x": [1.0, float("nan")]}})
    nested = "fields['nested'].struct_value.fields['x'].list_value.values[1].number_value"
    assert sorted(non_finite_fields(value)) == ["fields['lr'].number_value", nested]
    assert list(non_finite_fields(value, frozenset({"google.protobuf.Value.number_value"}))) == []
    assert not has_floats(reward_pb2.GetTaskHistoryRequest.DESCRIPTOR) and has_floats(reward_pb2.RankRequest.DESCRIPTOR)


# -- the authorization header (item 12) --------------------------------------------------


def test_bearer_scheme_is_case_insensitive_and_duplicate_headers_are_refused():
    running = start(auth_token=TOKEN)
    try:
        stub = stub_for(running.address)
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert stub.Rank(rank("ok"), metadata=(("authorization", f"{scheme} {TOKEN}"),), timeout=10).results
        duplicates = [(("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer wrong")),
                      (("authorization", "Bearer wrong"), ("authorization", f"Bearer {TOKEN}")),
                      (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {TOKEN}"))]
        for metadata in duplicates:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Rank(rank("ok"), metadata=metadata, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "exactly one" in caught.value.details()
        for value in ("Basic " + TOKEN, "Bearer " + TOKEN + "x", "Bearer", TOKEN, "Bearer " + "x" * 5000):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Rank(rank("ok"), metadata=(("authorization", value),), timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        running.stop()


# -- settings and TLS mistakes are one friendly line (item 12) -----------------------------


def serve_fails(capsys, service: str, *args: str) -> str:
    """`leap serve SERVICE ARGS` run in this process: exit code 2 and one line on stderr."""
    from leap.cli import main

    assert main(["serve", service, "--port", str(free_port()), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leap serve: "), lines
    return lines[0]


def test_bad_numbers_in_flags_are_one_line_naming_the_setting(capsys):
    result = subprocess.run([sys.executable, "-m", "leap", "serve", "sandbox", "--workers", "-3"], cwd=ROOT,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip() == "leap serve: workers: must be at least 0, got -3"
    assert "port: must be at most 65535" in serve_fails(capsys, "reward", "--port", "70000")
    assert "keepalive_seconds: must be a finite number, got nan" in serve_fails(capsys, "policy", "--keepalive-seconds",
                                                                                 "nan")
    assert "grace_seconds: must be at least 0" in serve_fails(capsys, "trainer", "--grace-seconds", "-1")
    assert "max_concurrent_runs: must be at least 1" in serve_fails(capsys, "distill", "--max-concurrent-runs", "0")
    assert "log_level: must be one of debug, info, warning, error" in serve_fails(capsys, "reward", "--log-level",
                                                                                  "loud")
    assert "timing_trials: expected an integer, got 'ten'" in serve_fails(capsys, "sandbox", "--timing-trials", "ten")


def service_config_classes():
    from leap.commands import SERVICE_MODULES, service_spec

    return [(name, service_spec(name).config_class) for name in SERVICE_MODULES]


@pytest.mark.parametrize("name,config_class", service_config_classes(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_declared_range_is_enforced_and_every_default_is_inside_it(name, config_class):
    """For every service: each default lies in its declared range (or is a non-negative
    quantity), and one step outside each declared bound is refused naming the setting."""
    import dataclasses

    from leap.runtime import config as cfg

    checked = 0
    for f in cfg.fields_of(config_class):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert cfg.range_problem(f, default) == "", f"{name}.{f.name}: its default {default!r} is out of range"
        for bound, step in (("minimum", -1), ("maximum", +1)):
            if f.metadata.get(bound) is None:
                continue
            kind = cfg.field_type(config_class, f)
            outside = f.metadata[bound] + step * (1 if kind is int else 0.5)
            with pytest.raises(ValueError, match=f"^{f.name}: must be at"):
                cfg.load(config_class, name, env={}, overrides={f.name: str(outside)})
            checked += 1
    assert checked >= 3  # the server settings every service has declare ranges


def test_tls_mistakes_name_the_real_problem(tmp_path, capsys):
    certs = make_certificates(tmp_path)
    assert "tls_cert is set but tls_key is not" in serve_fails(capsys, "reward", "--tls-cert", certs["server.pem"])
    assert "tls_key is set but tls_cert is not" in serve_fails(capsys, "reward", "--tls-key", certs["server.key"])
    swapped = serve_fails(capsys, "reward", "--tls-cert", certs["server.key"], "--tls-key", certs["server.pem"])
    assert "swapped" in swapped and "another process" not in swapped
    mismatch = serve_fails(capsys, "reward", "--tls-cert", certs["server.pem"], "--tls-key", certs["client.key"])
    assert "the key does not match the certificate" in mismatch
    assert "cannot read" in serve_fails(capsys, "reward", "--tls-cert", str(tmp_path / "nope.pem"),
                                        "--tls-key", certs["server.key"])
    alone = serve_fails(capsys, "reward", "--tls-client-ca", certs["ca.pem"])
    assert "tls_client_ca needs tls_cert and tls_key" in alone
    # An embedder building a Server directly gets the same sentence.
    with pytest.raises(ValueError, match="swapped"):
        start(tls_cert=certs["server.key"], tls_key=certs["server.pem"])


def test_leap_health_checks_a_tls_and_an_mtls_service(tmp_path, capsys):
    from leap.cli import main

    certs = make_certificates(tmp_path)
    tls = start(tls_cert=certs["server.pem"], tls_key=certs["server.key"])
    mtls = start(tls_cert=certs["server.pem"], tls_key=certs["server.key"], tls_client_ca=certs["ca.pem"])
    try:
        assert main(["health", tls.address, "--tls-ca", certs["ca.pem"]]) == 0
        assert capsys.readouterr().out.strip().endswith(": SERVING")
        assert main(["health", tls.address, "--timeout", "2"]) == 1  # plaintext against TLS
        assert "UNREACHABLE" in capsys.readouterr().out
        client = ["--tls-cert", certs["client.pem"], "--tls-key", certs["client.key"]]
        assert main(["health", mtls.address, "--tls-ca", certs["ca.pem"], *client]) == 0
        assert main(["health", mtls.address, "--tls-ca", certs["ca.pem"], "--timeout", "2"]) == 1  # no client cert
        assert main(["health", mtls.address.replace("127.0.0.1", "localhost"), "--tls-ca", certs["ca.pem"],
                     "--tls-server-name", "localhost", *client, "--wait", "5"]) == 0
        capsys.readouterr()
        assert main(["health", tls.address, "--tls-cert", certs["client.pem"]]) == 2
        assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    finally:
        tls.stop()
        mtls.stop()


def test_page_tokens_are_opaque_and_only_ours_for_the_same_query_come_back():
    import base64

    from leap.runtime.paging import decode_page_token, encode_page_token, is_offset

    query = {"split": "train", "toolchain": 1}
    token = encode_page_token(100, query)
    assert "100" not in token and decode_page_token(token, dict(reversed(query.items())), is_offset) == 100
    forged = [
        "-5", base64.urlsafe_b64encode(b"-5").decode(), "", "x" * 5000, "%%%", "AAAA",
        encode_page_token(-5, query), encode_page_token(1.5, query), encode_page_token(True, query),
        encode_page_token("5", query), encode_page_token(100, {"split": "heldout", "toolchain": 1}),
        base64.urlsafe_b64encode(b'{"v": 1, "q": "x", "p": NaN}').decode(),
    ]
    for bad in forged:
        with pytest.raises(ValueError):
            decode_page_token(bad, query, is_offset)


def test_the_non_finite_prefilter_never_skips_a_non_finite_float():
    """MAYBE_NON_FINITE (the byte pattern every NaN and infinity of any sign has in float and
    double encodings) matches every non-finite value and rarely an ordinary request."""
    import math
    import struct

    from leap.runtime.interceptors import MAYBE_NON_FINITE

    specials = [math.nan, -math.nan, math.inf, -math.inf, struct.unpack("<d", b"\xff" * 8)[0]]
    for value in specials:
        for fmt in ("<d", "<f"):
            assert MAYBE_NON_FINITE.search(b"\x00" + struct.pack(fmt, value) + b"\x00"), (value, fmt)
    group = reward_pb2.RankGroup(task_id="ok", trajectories=[reward_pb2.Trajectory(turns=[
        reward_pb2.TurnResult(stage=5, speedup=1.0 + i / 7, generated_tokens=100 + i)]) for i in range(200)])
    assert MAYBE_NON_FINITE.search(reward_pb2.RankRequest(groups=[group]).SerializeToString()) is None


@pytest.mark.parametrize("name", ["policy", "sandbox", "reward", "trainer", "distill"])
def test_every_rpc_of_every_service_has_its_own_request_limit(name, tmp_path):
    """Each service's Registration names a request limit for every RPC of its contract (an
    RPC left out would get the 4 MiB default, too much for an id and too little for a
    batch)."""
    import dataclasses

    from google.protobuf import descriptor_pool

    from leap.commands import service_spec

    spec = service_spec(name)
    fields = {f.name for f in dataclasses.fields(spec.config_class)}
    settings: dict = {key: str(tmp_path / key) for key in ("history_path", "runs_dir", "cache_dir", "work_dir")
                      if key in fields}
    if "keep_freed_memory" in fields:
        settings["keep_freed_memory"] = False  # process-wide malloc settings: not in the test process
    service = spec.build(spec.config_class(port=free_port(), **settings))
    for registration in service.registrations:
        methods = {m.name for m in descriptor_pool.Default().FindServiceByName(registration.service_name).methods}
        assert set(registration.request_limits) == methods, registration.service_name
