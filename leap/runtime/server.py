"""The gRPC server every LEAP service runs in.

A service package hands the runtime a `Service` (its servicers and start/stop hooks); the
runtime adds what every service must have: the standard health service and server
reflection, JSON logs of every call, errors mapped to statuses with rich details, optional
TLS and bearer-token auth, message-size and keepalive limits, and a graceful shutdown on
SIGTERM (health turns NOT_SERVING, in-flight calls finish within the grace period).

Handlers run on one asyncio event loop: CPU-heavy work (generation, compiling, training)
belongs in a thread or process pool (`asyncio.to_thread`, `loop.run_in_executor`), never on
the loop itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import signal
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from leap.runtime.config import DEFAULT_PORTS, ServerConfig, resolve_auth_token
from leap.runtime.exposure import check_exposure
from leap.runtime.interceptors import CallInterceptor
from leap.runtime.logging import configure_logging, get_logger, library_output_as_logs

HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


@dataclasses.dataclass
class Registration:
    """One gRPC service implementation to add to the server."""

    service_name: str  # full name, for example "leap.sandbox.v1.SandboxService"
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


@dataclasses.dataclass
class Service:
    """What a service package gives the runtime."""

    name: str  # short name: "policy", "sandbox", ...
    registrations: list[Registration]
    on_start: Callable[[], Awaitable[None]] | None = None  # runs before health turns SERVING
    on_stop: Callable[[], Awaitable[None]] | None = None  # runs after in-flight calls drained


@dataclasses.dataclass
class ServiceSpec:
    """A service package's entry point: its config class and how to build it."""

    name: str
    config_class: type
    build: Callable[[Any], Service]
    description: str = ""


def server_options(config: ServerConfig) -> list[tuple[str, Any]]:
    keepalive_ms = int(config.keepalive_seconds * 1000)
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
    ]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not (config.tls_cert or config.tls_key):
        return None
    if not (config.tls_cert and config.tls_key):
        raise ValueError("TLS needs both tls_cert and tls_key")
    pair = (Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())
    client_ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def resolved_port(service_name: str, config: ServerConfig) -> int:
    return config.port or DEFAULT_PORTS.get(service_name, 0)


class Server:
    """One running service. `await start()`, then `await wait()`; `stop()` from anywhere."""

    def __init__(self, service: Service, config: ServerConfig):
        self.service = service
        self.config = config
        self.log = get_logger(f"leap.{service.name}")
        self.health = health.aio.HealthServicer()
        self.interceptor = CallInterceptor(resolve_auth_token(config), exempt_prefixes=(f"/{HEALTH_SERVICE}/",))
        self.grpc_server = grpc.aio.server(interceptors=[self.interceptor], options=server_options(config))
        self.port = 0
        self._stopped = asyncio.Event()
        self._stop_requested = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        check_exposure(self.config)
        names = [r.service_name for r in self.service.registrations]
        for registration in self.service.registrations:
            registration.add_to_server(registration.servicer, self.grpc_server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
        reflection.enable_server_reflection([*names, HEALTH_SERVICE, reflection.SERVICE_NAME], self.grpc_server)
        port = resolved_port(self.service.name, self.config)
        target = f"{self.config.host}:{port}"
        credentials = server_credentials(self.config)
        try:
            if credentials is None:
                self.port = self.grpc_server.add_insecure_port(target)
            else:
                self.port = self.grpc_server.add_secure_port(target, credentials)
        except RuntimeError as err:  # grpc raises when the port cannot be bound
            raise OSError(f"cannot listen on {target}: {err}. Is another process using port {port}? Pass --port.") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {target}: is another process using port {port}? Pass --port.")
        for name in ("", *names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.grpc_server.start()
        if self.service.on_start is not None:
            try:
                await self.service.on_start()
            except BaseException:  # a service that cannot start (StartupError): nothing keeps listening
                await self.grpc_server.stop(0)
                raise
        self.interceptor.starting = False
        for name in ("", *names):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.log.info("serving", address=self.address, services=names, tls=credentials is not None,
                      auth=bool(self.interceptor.expected_auth))

    async def wait(self) -> None:
        await self._stop_requested.wait()
        await self._shutdown()

    def request_stop(self) -> None:
        """Ask for a graceful shutdown; safe to call from signal handlers on the loop."""
        self._stop_requested.set()

    async def _shutdown(self) -> None:
        self.log.info("shutting down", drain_seconds=self.config.drain_seconds, grace_seconds=self.config.grace_seconds)
        await self.health.enter_graceful_shutdown()
        await asyncio.sleep(self.config.drain_seconds)
        await self.grpc_server.stop(self.config.grace_seconds)
        if self.service.on_stop is not None:
            await self.service.on_stop()
        self.log.info("stopped")
        self._stopped.set()


async def serve(service: Service, config: ServerConfig, *, handle_signals: bool = True) -> None:
    """Run `service` until SIGTERM or SIGINT, then shut down gracefully."""
    server = Server(service, config)
    if handle_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
    await server.start()
    await server.wait()


def run(spec: ServiceSpec, config: ServerConfig) -> None:
    """Blocking entry point of `leap serve`."""
    configure_logging(config.log_level, service=spec.name)
    check_exposure(config)  # before building the service: refuse at once, not after loading models
    from leap.clients.channel import use_auth_token

    use_auth_token(resolve_auth_token(config))  # the services it calls require the suite's one token too
    # `kill -USR1 PID` prints every thread's stack to stderr: how to see where a service hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    with library_output_as_logs():  # progress bars, library loggers and prints: JSON lines too
        service = spec.build(config)
        asyncio.run(serve(service, config))


class BackgroundServer:
    """A service running on its own event loop in a thread, for tests and embedding.

        with BackgroundServer(spec.build(config), config) as server:
            channel = grpc.insecure_channel(server.address)
    """

    def __init__(self, service: Service, config: ServerConfig):
        self.service = service
        self.config = config
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._thread = threading.Thread(target=self._main, name=f"leap-{service.name}", daemon=True)

    @property
    def address(self) -> str:
        assert self._server is not None
        return self._server.address

    def start(self, timeout: float = 120.0) -> BackgroundServer:
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.service.name} did not start within {timeout} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        if self._loop is not None and self._server is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._server.request_stop)
        self._thread.join(timeout)

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._server = Server(self.service, self.config)
            try:
                await self._server.start()
            except BaseException as err:  # surface start errors to the caller's thread
                self._error = err
                self._ready.set()
                return
            self._ready.set()
            await self._server.wait()

        asyncio.run(main())

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
