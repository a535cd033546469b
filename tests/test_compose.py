"""The compose files without a Docker engine: valid against the Compose Specification, and
every service's command, port and health check agrees with what `leap serve` accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from leap.commands import SERVICE_MODULES, service_spec
from leap.commands.serve import settings_parser
from leap.runtime.config import DEFAULT_PORTS, env_names, fields_of

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILES = sorted((ROOT / "compose").glob("compose*.yaml"))
SCHEMA = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_follows_the_compose_specification(path):
    jsonschema.validate(load(path), SCHEMA)


def test_schema_rejects_a_broken_file():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"services": {"x": {"ports": {"not": "a list"}}}}, SCHEMA)


MAIN = load(ROOT / "compose" / "compose.yaml")


def container_port(entry) -> int:
    """The container side of a short-syntax port entry, `[[IP:]HOST:]CONTAINER`."""
    return int(str(entry).rsplit(":", 1)[-1])


@pytest.mark.parametrize("name", list(SERVICE_MODULES))
def test_service_command_port_and_health_match_leap_serve(name):
    service = MAIN["services"][name]
    command = service["command"]
    assert command[:2] == ["serve", name]
    args = settings_parser(service_spec(name)).parse_args(command[2:])  # SystemExit on an unknown flag
    port = int(args.port)
    assert port == DEFAULT_PORTS[name]
    assert any(container_port(p) == port for p in service["ports"])
    assert service["healthcheck"]["test"] == ["CMD", "leap", "health", f"127.0.0.1:{port}"]


def readable_env(name: str) -> set[str]:
    """Every environment variable `leap serve NAME` reads (the loader's own naming rule)."""
    cls = service_spec(name).config_class
    return {variable for f in fields_of(cls) for variable in env_names(cls, name, f.name)}


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_environment_variable_is_a_setting_of_its_service(path):
    for name, service in load(path)["services"].items():
        if name not in SERVICE_MODULES:
            continue  # the one-shot bootstrap-model runs `leap bootstrap-model`, not a service
        unknown = set(service.get("environment", {})) - readable_env(name)
        assert not unknown, f"{path.name}: {name}: {sorted(unknown)} are not settings of leap serve {name}"


def test_every_service_but_the_core_waits_for_healthy_dependencies():
    for name in ("trainer", "distill"):
        deps = MAIN["services"][name]["depends_on"]
        assert {"policy", "sandbox", "reward"} <= set(deps)
        assert all(d["condition"] == "service_healthy" for d in deps.values())


def test_sandbox_replicas_need_no_fixed_host_port():
    """`--scale sandbox=N` starts N containers of one service: a fixed host port or container
    name would let only the first one start."""
    sandbox = MAIN["services"]["sandbox"]
    assert all(":" not in str(p) for p in sandbox["ports"]), "Docker must pick each replica's host port"
    assert "container_name" not in sandbox
    assert sandbox["deploy"]["replicas"] == "${LEAP_SANDBOX_REPLICAS:-1}"


def test_the_learners_reach_every_sandbox_replica_through_dns_round_robin():
    for name in ("trainer", "distill"):
        environment = MAIN["services"][name]["environment"]
        assert environment[f"LEAP_{name.upper()}_SANDBOX_ADDRESS"] == f"dns:///sandbox:{DEFAULT_PORTS['sandbox']}"
    assert MAIN["services"]["distill"]["environment"]["LEAP_DISTILL_STUDENT_ADDRESS"] == "policy:50051"


def test_gpu_override_only_changes_services_of_the_stack():
    gpu = load(ROOT / "compose" / "compose.gpu.yaml")
    assert set(gpu["services"]) <= set(MAIN["services"])
    reserved = {name for name, service in gpu["services"].items()
                if service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")}
    assert reserved == {"policy", "sandbox", "trainer", "distill"}


def header_commands(path: Path) -> list[str]:
    """The `docker compose ...` commands in a file's comments."""
    return [match.group(0) for line in path.read_text().splitlines() if line.lstrip().startswith("#")
            for match in [re.search(r"docker compose .*", line)] if match]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_instructions_in_the_files_name_real_files_and_declared_profiles(path):
    declared = {profile for f in COMPOSE_FILES for service in load(f)["services"].values()
                for profile in service.get("profiles", [])}
    commands = header_commands(path)
    assert commands, f"{path.name} says nowhere how to start it"
    for command in commands:
        files = re.findall(r"-f (\S+)", command)
        assert files and files[0] == "compose/compose.yaml", command
        assert all((ROOT / f).is_file() for f in files), command
        assert set(re.findall(r"--profile (\S+)", command)) <= declared, command
