"""The deployment rule every server obeys: a service that can be reached from beyond this
machine's loopback interface authenticates its callers (a bearer token, or client
certificates), unless the operator has said in so many words that it need not.

A sandbox runs the code it is sent and a trainer starts runs on request, so an open port on
a shared network is remote code execution for anyone who finds it. Binding 127.0.0.1 (the
default, and what `leap up` does) needs nothing; `0.0.0.0`, `::` or any other address, as in
a container, needs `auth_token` or `tls_client_ca`, or `allow_unauthenticated = true`.
"""

from __future__ import annotations

import ipaddress


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a port on this machine's loopback interface. A hostname
    other than localhost counts as beyond it (it may resolve to anything)."""
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def exposure_problem(config) -> str | None:
    """Why a server with `config` (a ServerConfig) must not start, in one line, or None."""
    if (is_loopback(config.host) or config.auth_token or getattr(config, "auth_token_file", "")
            or config.tls_client_ca or config.allow_unauthenticated):
        return None
    return (f"refusing to serve on {config.host} without authentication: set auth_token (LEAP_AUTH_TOKEN), "
            "auth_token_file or tls_client_ca, bind 127.0.0.1, or set allow_unauthenticated=true "
            "(LEAP_ALLOW_UNAUTHENTICATED=true) to serve anyway")


def check_exposure(config) -> None:
    """Raise PermissionError (an OSError: `leap serve` prints it as one line) when `config`
    would serve beyond loopback without authentication."""
    problem = exposure_problem(config)
    if problem:
        raise PermissionError(problem)
