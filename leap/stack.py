"""The local stack: every service as a child process on loopback (`leap up`).

    with LocalStack(log_dir="runs/logs") as stack:   # starts, waits until all are SERVING
        print(stack.addresses["sandbox"])
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from leap.commands import service_spec
from leap.commands.health import check
from leap.runtime import config as cfg
from leap.runtime.server import resolved_port


@dataclass
class Child:
    name: str
    address: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class LocalStack:
    """Start `services` (default: all five) with `leap serve`, each logging JSON to log_dir."""

    services: Iterable[str] = cfg.SERVICES
    config_file: str | None = None
    log_dir: str | os.PathLike = "runs/logs"
    extra_args: Mapping[str, list[str]] = field(default_factory=dict)
    env: Mapping[str, str] | None = None
    children: dict[str, Child] = field(default_factory=dict)

    @property
    def addresses(self) -> dict[str, str]:
        return {name: child.address for name, child in self.children.items()}

    def start(self, timeout: float = 300.0) -> LocalStack:
        """Start every service and wait until each is SERVING; whatever stops this part way (a
        service that exits, the timeout, Ctrl-C or SIGTERM) stops the ones already started."""
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> LocalStack:
        log_dir = Path(self.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        for name in self.services:
            spec = service_spec(name)
            settings = cfg.load(spec.config_class, name, config_file=self.config_file, env=self.env)
            host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
            address = f"{host}:{resolved_port(name, settings)}"
            command = [sys.executable, "-m", "leap", "serve", name]
            if self.config_file:
                command += ["--config", str(self.config_file)]
            command += list(self.extra_args.get(name, []))
            log_path = log_dir / f"{name}.log"
            log_file = open(log_path, "ab")
            process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=dict(self.env) if self.env else None,
                start_new_session=True,  # Ctrl-C in the terminal reaches only us; we stop them in order
            )
            log_file.close()
            self.children[name] = Child(name, address, process, log_path)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = dict(self.children)
        while pending:
            for name, child in list(pending.items()):
                if child.process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {child.process.returncode} before serving; "
                        f"last lines of {child.log_path}:\n{child.log_tail()}"
                    )
                if check(child.address, timeout=1.0) == "SERVING":
                    del pending[name]
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"not SERVING after {timeout:.0f} s: {', '.join(pending)}")
            if pending:
                time.sleep(0.2)

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM every child (graceful drain), then SIGKILL what is left after `grace`."""
        for child in self.children.values():
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children.values():
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
