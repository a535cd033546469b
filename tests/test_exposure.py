"""The deployment rule of the runtime: a server bound beyond loopback without a token or
client certificates refuses to start, unless allow_unauthenticated says otherwise; and a
served process calls its peers with its own token (one suite-wide LEAP_AUTH_TOKEN)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from leap.clients import connect
from leap.clients.channel import use_auth_token
from leap.reward.v1 import reward_pb2
from leap.runtime import BackgroundServer, ServerConfig
from leap.runtime.exposure import exposure_problem, is_loopback
from tests.conftest import ROOT, free_port, subprocess_env
from tests.runtime_fixture import build_service

TOKEN = "deploy-test-token"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.53", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_needs_no_authentication(host):
    assert is_loopback(host)
    assert exposure_problem(ServerConfig(host=host)) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "192.168.1.2", "sandbox", "leap-policy.svc"])
def test_beyond_loopback_needs_a_token_or_client_certificates_or_the_opt_out(host):
    assert not is_loopback(host)
    problem = exposure_problem(ServerConfig(host=host))
    assert problem and host in problem and "auth_token" in problem and "allow_unauthenticated" in problem
    assert "\n" not in problem
    for protected in ({"auth_token": TOKEN}, {"auth_token_file": "/run/secrets/token"},
                      {"tls_client_ca": "/etc/leap/ca.pem"}, {"allow_unauthenticated": True}):
        assert exposure_problem(dataclasses.replace(ServerConfig(host=host), **protected)) is None, protected


def test_tls_without_client_certificates_is_not_authentication():
    """Server-side TLS encrypts but lets anyone call: it does not lift the rule."""
    config = ServerConfig(host="0.0.0.0", tls_cert="server.pem", tls_key="server.key")
    assert exposure_problem(config)


def test_leap_serve_refuses_an_open_port_in_one_line_before_building_the_service():
    port = free_port()
    env = subprocess_env()
    for name in ("LEAP_AUTH_TOKEN", "LEAP_REWARD_AUTH_TOKEN", "LEAP_ALLOW_UNAUTHENTICATED"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "leap", "serve", "reward", "--host", "0.0.0.0", "--port", str(port)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refusing to serve on 0.0.0.0" in lines[0], done.stderr
    assert "serving" not in done.stdout


def test_the_opt_out_is_read_from_the_environment():
    from leap.runtime import config as cfg

    settings = cfg.load(ServerConfig, "reward", env={"LEAP_ALLOW_UNAUTHENTICATED": "true", "LEAP_HOST": "0.0.0.0"})
    assert settings.allow_unauthenticated and exposure_problem(settings) is None


def test_an_embedded_server_is_held_to_the_same_rule():
    with pytest.raises(PermissionError, match="refusing to serve on 0.0.0.0"):
        BackgroundServer(build_service(), ServerConfig(host="0.0.0.0", port=free_port())).start()


def test_channels_without_a_token_of_their_own_send_the_process_token():
    """What `leap serve` sets up: the trainer's stubs of policy, sandbox and reward carry the
    token the trainer itself requires."""
    server = BackgroundServer(build_service(), ServerConfig(port=free_port(), auth_token=TOKEN, drain_seconds=0.0)).start()
    try:
        request = reward_pb2.RankRequest(groups=[reward_pb2.RankGroup(task_id="ok")])
        use_auth_token(TOKEN)
        implicit = connect("reward", server.address, aio=False, max_attempts=1)
        assert implicit.Rank(request).results[0].task_id == "ok"
        explicit_none = connect("reward", server.address, aio=False, auth_token="", max_attempts=1)
        with pytest.raises(Exception) as caught:
            explicit_none.Rank(request)
        assert caught.value.code().name == "UNAUTHENTICATED"
        for stub in (implicit, explicit_none):
            stub.channel.close()
    finally:
        use_auth_token(None)
        server.stop()


def test_every_kind_of_aio_call_carries_the_token():
    """grpc.aio files an interceptor under the first call kind it implements only: the
    trainer's UpdateWeights (a client stream) once went out without the token."""
    import asyncio

    import grpc

    from leap.clients import aio_channel

    async def main() -> dict[str, str | None]:
        seen: dict[str, str | None] = {}

        def record(kind, context):
            seen[kind] = dict(context.invocation_metadata()).get("authorization")

        async def unary_unary(request, context):
            record("unary_unary", context)
            return b"ok"

        async def unary_stream(request, context):
            record("unary_stream", context)
            yield b"ok"

        async def stream_unary(requests, context):
            async for _ in requests:
                pass
            record("stream_unary", context)
            return b"ok"

        async def stream_stream(requests, context):
            async for _ in requests:
                pass
            record("stream_stream", context)
            yield b"ok"

        handlers = {"UU": grpc.unary_unary_rpc_method_handler(unary_unary),
                    "US": grpc.unary_stream_rpc_method_handler(unary_stream),
                    "SU": grpc.stream_unary_rpc_method_handler(stream_unary),
                    "SS": grpc.stream_stream_rpc_method_handler(stream_stream)}
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.S", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channel = aio_channel(f"127.0.0.1:{port}", auth_token=TOKEN, max_attempts=1)
        try:
            await channel.unary_unary("/t.S/UU")(b"x")
            [_ async for _ in channel.unary_stream("/t.S/US")(b"x")]
            await channel.stream_unary("/t.S/SU")(iter([b"a", b"b"]))
            [_ async for _ in channel.stream_stream("/t.S/SS")(iter([b"a"]))]
        finally:
            await channel.close()
            await server.stop(0)
        return seen

    assert asyncio.run(main()) == dict.fromkeys(["unary_unary", "unary_stream", "stream_unary", "stream_stream"],
                                                f"Bearer {TOKEN}")
