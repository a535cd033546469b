"""A local stack for one experiment: every service a child process on a free loopback port,
its state (compile cache, reward history, runs, logs) inside one work directory, the policy
serving the given model, and the learners pointed at the others. Nothing is shared with a
stack the user may already run on the default ports."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

from leap.runtime.config import SERVICES
from leap.stack import LocalStack


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def experiment_stack(work: Path, model_dir: Path, services: Iterable[str] = SERVICES,
                     model_name: str = "policy", extra_env: dict[str, str] | None = None) -> LocalStack:
    """A LocalStack (not started) whose state lives under `work`; `extra_env` sets more of
    the services' settings (LEAP_<SERVICE>_<SETTING>)."""
    services = list(services)
    ports = {name: free_port() for name in SERVICES}
    address = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    env = dict(os.environ)
    env.update({f"LEAP_{name.upper()}_PORT": str(port) for name, port in ports.items()})
    env.update({
        "LEAP_DRAIN_SECONDS": "0",  # nobody balances load across these: stop at once
        "LEAP_POLICY_MODELS": f"{model_name}={model_dir}",
        "LEAP_SANDBOX_CACHE_DIR": str(work / "compile-cache"),
        "LEAP_REWARD_HISTORY_PATH": str(work / "reward" / "task_history.sqlite3"),
        "LEAP_TRAINER_RUNS_DIR": str(work / "trainer"),
        "LEAP_TRAINER_POLICY_ADDRESS": address["policy"],
        "LEAP_TRAINER_SANDBOX_ADDRESS": address["sandbox"],
        "LEAP_TRAINER_REWARD_ADDRESS": address["reward"],
        "LEAP_DISTILL_RUNS_DIR": str(work / "distill"),
        "LEAP_DISTILL_STUDENT_ADDRESS": address["policy"],
        "LEAP_DISTILL_SANDBOX_ADDRESS": address["sandbox"],
    })
    env.update(extra_env or {})
    return LocalStack(services=services, log_dir=work / "logs", env=env)
