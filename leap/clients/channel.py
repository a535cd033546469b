"""Channels to LEAP services: retries on UNAVAILABLE only, round-robin load balancing over
every address a `dns:///` target resolves to, a deadline on every call, optional TLS and
bearer-token auth.

    from leap.clients import connect
    sandbox = connect("sandbox", "dns:///sandbox:50052")           # a grpc.aio stub
    verdict = await sandbox.Evaluate(request)                       # 60 s deadline by default

Replicas behind one DNS name are spread over with `round_robin`; a call that finds a
replica gone is retried (UNAVAILABLE) and lands on another.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

UNARY_DEADLINE_SECONDS = 60.0
STREAM_DEADLINE_SECONDS = 24 * 3600.0  # streams (metrics, telemetry) are long by nature

# The bearer token of channels opened without one (auth_token=None): `leap serve` sets it to
# the service's own auth_token, so that with one suite-wide token (LEAP_AUTH_TOKEN) a trainer
# or distiller reaches the services it calls with the token they all require.
_process_auth_token: str | None = None


def use_auth_token(token: str | None) -> None:
    """Make `token` the bearer token of every channel this process opens without one."""
    global _process_auth_token
    _process_auth_token = token or None


def service_config(max_attempts: int = 5) -> str:
    """gRPC service config: round_robin, and retries with backoff for UNAVAILABLE only
    (max_attempts < 2 means no retries)."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if max_attempts >= 2:
        config["methodConfig"] = [
            {
                "name": [{}],  # every method of every service
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    return json.dumps(config)


def channel_options(max_message_bytes: int = 64 * 1024 * 1024, max_attempts: int = 5) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.service_config", service_config(max_attempts)),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        # Re-resolve DNS quickly when a replica goes away.
        ("grpc.dns_min_time_between_resolutions_ms", 1_000),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def _credentials(tls_ca: str | None, tls_cert: str | None, tls_key: str | None) -> grpc.ChannelCredentials | None:
    if not tls_ca:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
    )


def _metadata(existing: Sequence[tuple[str, str]] | None, auth_token: str | None) -> list[tuple[str, str]] | None:
    if not auth_token:
        return list(existing) if existing is not None else None
    items = [item for item in (existing or ()) if item[0] != "authorization"]
    return [*items, ("authorization", f"Bearer {auth_token}")]


class _AioDefaults:
    """Adds the default deadline and the auth token to every call of an aio channel. grpc.aio
    files an interceptor under the first call kind it implements only, so each kind has a
    class of its own (one class of all four would leave streaming calls without the token)."""

    def __init__(self, auth_token: str | None, unary_deadline: float, stream_deadline: float):
        self.auth_token = auth_token
        self.unary_deadline = unary_deadline
        self.stream_deadline = stream_deadline

    def _details(self, details: grpc.aio.ClientCallDetails, deadline: float) -> grpc.aio.ClientCallDetails:
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout if details.timeout is not None else deadline,
            metadata=_metadata(details.metadata, self.auth_token),
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


class _AioUnaryUnary(_AioDefaults, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details, self.unary_deadline), request)


class _AioUnaryStream(_AioDefaults, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details, self.stream_deadline), request)


class _AioStreamUnary(_AioDefaults, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details, self.stream_deadline), request_iterator)


class _AioStreamStream(_AioDefaults, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details, self.stream_deadline), request_iterator)


class _SyncCallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


class _SyncDefaults(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds the default deadline and the auth token to every call of a blocking channel."""

    def __init__(self, auth_token: str | None, unary_deadline: float, stream_deadline: float):
        self.auth_token = auth_token
        self.unary_deadline = unary_deadline
        self.stream_deadline = stream_deadline

    def _details(self, details, deadline):
        return _SyncCallDetails(
            details.method,
            details.timeout if details.timeout is not None else deadline,
            _metadata(details.metadata, self.auth_token),
            details.credentials,
            getattr(details, "wait_for_ready", None),
            getattr(details, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details, self.unary_deadline), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details, self.stream_deadline), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details, self.stream_deadline), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details, self.stream_deadline), request_iterator)


def aio_channel(
    target: str,
    *,
    auth_token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    unary_deadline: float = UNARY_DEADLINE_SECONDS,
    stream_deadline: float = STREAM_DEADLINE_SECONDS,
    max_message_bytes: int = 64 * 1024 * 1024,
    max_attempts: int = 5,
) -> grpc.aio.Channel:
    """An asyncio channel with LEAP's defaults (see the module docstring)."""
    auth_token = _process_auth_token if auth_token is None else auth_token
    interceptors = [kind(auth_token, unary_deadline, stream_deadline)
                    for kind in (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)]
    options = channel_options(max_message_bytes, max_attempts)
    credentials = _credentials(tls_ca, tls_cert, tls_key)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


def sync_channel(
    target: str,
    *,
    auth_token: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    unary_deadline: float = UNARY_DEADLINE_SECONDS,
    stream_deadline: float = STREAM_DEADLINE_SECONDS,
    max_message_bytes: int = 64 * 1024 * 1024,
    max_attempts: int = 5,
) -> grpc.Channel:
    """A blocking channel with LEAP's defaults (see the module docstring)."""
    auth_token = _process_auth_token if auth_token is None else auth_token
    options = channel_options(max_message_bytes, max_attempts)
    credentials = _credentials(tls_ca, tls_cert, tls_key)
    if credentials is None:
        base = grpc.insecure_channel(target, options=options)
    else:
        base = grpc.secure_channel(target, credentials, options=options)
    return grpc.intercept_channel(base, _SyncDefaults(auth_token, unary_deadline, stream_deadline))
