"""`leap health ADDRESS`: ask one service's standard health service whether it is SERVING."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("health", help="check one service's health", description=__doc__)
    parser.add_argument("address", help="host:port of the service, for example 127.0.0.1:50052")
    parser.add_argument("--service", default="", help="service name to ask about (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    parser.add_argument("--wait", type=float, default=0.0, help="keep asking for up to this many seconds until SERVING")
    parser.set_defaults(func=run)


def check(address: str, service: str = "", timeout: float = 5.0) -> str:
    """The status name ("SERVING", "NOT_SERVING", ...) or "UNREACHABLE: <why>"."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True)
        except grpc.RpcError as err:
            return f"UNREACHABLE: {err.code().name} {err.details() or ''}".rstrip()
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_serving(address: str, seconds: float, service: str = "") -> str:
    deadline = time.monotonic() + seconds
    while True:
        status = check(address, service, timeout=min(5.0, max(0.5, deadline - time.monotonic())))
        if status == "SERVING" or time.monotonic() >= deadline:
            return status
        time.sleep(0.2)


def run(args, _extra) -> int:
    status = wait_serving(args.address, args.wait, args.service) if args.wait else check(args.address, args.service, args.timeout)
    print(f"{args.address} {args.service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1
