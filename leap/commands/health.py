"""`leap health ADDRESS`: ask one service's standard health service whether it is SERVING.

Against a TLS service give `--tls-ca` (or `--tls` for the system's roots), and for mTLS
`--tls-cert` and `--tls-key`; health checks need no auth token."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("health", help="check one service's health", description=__doc__)
    parser.add_argument("address", help="host:port of the service, for example 127.0.0.1:50052")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    parser.add_argument("--wait", type=float, default=0.0, help="keep asking for up to this many seconds until SERVING")
    parser.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CA certificates")
    parser.add_argument("--tls-ca", metavar="FILE", help="connect with TLS, trusting this PEM CA certificate")
    parser.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate, for a service that requires mTLS")
    parser.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", metavar="NAME",
                        help="name the server's certificate must carry, when it differs from ADDRESS's host")
    parser.set_defaults(func=run)


def credentials(tls: bool = False, tls_ca: str | None = None, tls_cert: str | None = None,
                tls_key: str | None = None) -> grpc.ChannelCredentials | None:
    """Channel credentials for these options (None: plaintext). ValueError when a file is
    missing or only one of tls_cert and tls_key is given."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (tls or tls_ca or tls_cert):
        return None
    files = {}
    for flag, path in (("--tls-ca", tls_ca), ("--tls-cert", tls_cert), ("--tls-key", tls_key)):
        if path:
            try:
                files[flag] = Path(path).read_bytes()
            except OSError as err:
                raise ValueError(f"{flag}: cannot read {path!r}: {err.strerror or err}") from None
    return grpc.ssl_channel_credentials(root_certificates=files.get("--tls-ca"), private_key=files.get("--tls-key"),
                                        certificate_chain=files.get("--tls-cert"))


def check(address: str, service: str = "", timeout: float = 5.0, credentials: grpc.ChannelCredentials | None = None,
          server_name: str | None = None) -> str:
    """The status name ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE: <why>"."""
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = grpc.insecure_channel(address, options) if credentials is None else \
        grpc.secure_channel(address, credentials, options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as err:
            return f"UNREACHABLE: {err.code().name} {err.details() or ''}".rstrip()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(address: str, seconds: float, service: str = "", credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None) -> str:
    deadline = time.monotonic() + seconds
    while True:
        status = check(address, service, min(5.0, max(0.5, deadline - time.monotonic())), credentials, server_name)
        if status == "SERVING" or time.monotonic() >= deadline:
            return status
        time.sleep(0.2)


def run(args, _extra) -> int:
    from leap.cli import UserError

    try:
        creds = credentials(args.tls, args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as err:
        raise UserError(str(err)) from None
    if args.wait:
        status = wait_serving(args.address, args.wait, args.service, creds, args.tls_server_name)
    else:
        status = check(args.address, args.service, args.timeout, creds, args.tls_server_name)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1
