"""The runtime every LEAP service is served by (see server.py)."""

from leap.runtime.config import DEFAULT_PORTS, ServerConfig, local_address, option
from leap.runtime.errors import (
    ServiceError,
    StartupError,
    Violations,
    failed_precondition,
    invalid_argument,
    not_found,
    resource_exhausted,
)
from leap.runtime.server import BackgroundServer, Registration, Service, ServiceSpec, serve

__all__ = [
    "DEFAULT_PORTS",
    "BackgroundServer",
    "Registration",
    "ServerConfig",
    "Service",
    "ServiceError",
    "ServiceSpec",
    "StartupError",
    "Violations",
    "failed_precondition",
    "invalid_argument",
    "local_address",
    "not_found",
    "option",
    "resource_exhausted",
    "serve",
]
