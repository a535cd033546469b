"""Conformance suites: whether an implementation of a LEAP contract, in any language, keeps
the contract the other services rely on (health, reflection, every v1 RPC, status codes on
bad input, and the semantics callers depend on). `leap conformance SERVICE ADDRESS` runs
them; tests run them against the project's own services.

    from leap.conformance import check_service
    results = check_service("reward", "127.0.0.1:50053")

One module per service holds its `SUITE`; core.py holds the machinery. Checks never change
a service's state (see core.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from leap.clients import STUBS, sync_channel
from leap.conformance.core import CheckResult, Outcome, Suite, Unreachable, ensure_answers, failures, run_suite

SERVICES = tuple(STUBS)
CONNECT_SECONDS = 10.0


def suite_of(service: str) -> Suite:
    if service not in SERVICES:
        raise ValueError(f"unknown service {service!r}; choose one of: {', '.join(SERVICES)}")
    return importlib.import_module(f"leap.conformance.{service}").SUITE


def check_service(service: str, target: str, *, deadline: float = 60.0, connect_seconds: float = CONNECT_SECONDS,
                  options: dict[str, Any] | None = None, **channel_kwargs: Any) -> list[CheckResult]:
    """Run the suite of `service` against `target`; `channel_kwargs` go to
    leap.clients.sync_channel (auth_token, tls_ca, tls_cert, tls_key). Raises Unreachable
    when nothing answers at `target`."""
    suite = suite_of(service)
    channel = sync_channel(target, unary_deadline=deadline, **channel_kwargs)
    try:
        ensure_answers(channel, target, connect_seconds)
        return run_suite(suite, channel, deadline=deadline, options=options or {})
    finally:
        channel.close()


__all__ = ["SERVICES", "CheckResult", "Outcome", "Unreachable", "check_service", "failures", "suite_of"]
