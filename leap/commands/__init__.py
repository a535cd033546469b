"""Subcommands of the `leap` command (see leap/cli.py)."""

from __future__ import annotations

import importlib

from leap.runtime.config import SERVICES

SERVICE_MODULES = {name: f"svc_{name}.server" for name in SERVICES}


def service_spec(name: str):
    """The ServiceSpec of a service package, imported by name (the CLI is the one place that
    knows every service; services never import each other)."""
    from leap.cli import UserError

    if name not in SERVICE_MODULES:
        raise UserError(f"unknown service {name!r}; choose one of: {', '.join(SERVICE_MODULES)}")
    return importlib.import_module(SERVICE_MODULES[name]).SPEC
