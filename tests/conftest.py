"""Fixtures every test may use: free loopback ports, services as real `leap serve`
processes, and services on a background thread of this process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prebuild import (prebuilt, pytest_collection_finish, pytest_collection_modifyitems,  # noqa: F401
                             pytest_runtest_protocol, pytest_sessionfinish)  # (the hooks build beside the tests)

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


@contextlib.contextmanager
def leap_serve(service: str, *args: str, port: int | None = None, timeout: float = 120.0,
               env: dict[str, str] | None = None, log_path: Path | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Run `leap serve SERVICE --port P ARGS...` as a real process; yield (address, process).
    Its output (JSON logs) goes to `log_path`, or to a temporary file shown if it fails to
    start: never to a pipe nobody reads, which would block a chatty service once full."""
    from leap.commands.health import check

    port = port or free_port()
    address = f"127.0.0.1:{port}"
    log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-m", "leap", "serve", service, "--port", str(port), *args],
        cwd=ROOT, env=env or subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while check(address, timeout=1.0) != "SERVING":
            if process.poll() is not None:
                log.seek(0)
                err = log.read().decode(errors="replace")
                raise RuntimeError(f"leap serve {service} exited with {process.returncode}:\n{err[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"leap serve {service} not SERVING after {timeout} s")
            time.sleep(0.1)
        yield address, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    """Poll `predicate` until it returns something true, and return that; fail after
    `timeout` seconds (a bound on waiting, not a speed assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def port() -> int:
    return free_port()


BOOTSTRAP_CACHE = ROOT / ".leap-cache" / "bootstrap"


def task_suite() -> list:
    """The built-in task suite (FULL view), or the small one of tests/tiny_suite.py where
    the built-in one is not there yet."""
    try:
        from leap.tasks import load_suite
    except ImportError:
        from tests.tiny_suite import tiny_suite

        return tiny_suite()
    return list(load_suite())


def build_tiny_model() -> Path:
    """The bootstrapped tiny model (leap.bootstrap, default config) of the task suite: a
    Hugging Face model directory that both policy backends load. Built once per cache key
    under .leap-cache/bootstrap/ and shared by every test of the session (and later runs);
    treat it as read-only (copy it to change it). LEAP_TINY_MODEL_DIR names a model
    directory to use instead (one built earlier, or elsewhere). Built before the first test
    that uses it, in a child process beside the tests that do not need it
    (tests/prebuild.py), so no test's timeout covers the build."""
    from leap.bootstrap import bootstrap_model

    if os.environ.get("LEAP_TINY_MODEL_DIR"):
        return Path(os.environ["LEAP_TINY_MODEL_DIR"]).resolve()
    return bootstrap_model(tasks=task_suite(), cache_dir=BOOTSTRAP_CACHE, progress=True)


tiny_model_dir = prebuilt("tiny_model_dir", build_tiny_model)
