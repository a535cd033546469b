"""The Kubernetes manifests (k8s/), offline: every object of both variants validates against
the schemas of a current Kubernetes release (kubernetes-validate, strict: unknown fields
fail), the rendering equals `kubectl kustomize` where kubectl is installed, and the
deployment rules hold: a headless sandbox Service behind the trainer's dns:/// target, an
autoscaler, gRPC health probes, NetworkPolicies that let only the learners reach the
sandbox, the token from a Secret, persistent runs, GPUs in the GPU variant."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from leap.commands import SERVICE_MODULES, service_spec
from leap.commands.serve import settings_parser
from leap.runtime.config import DEFAULT_PORTS, env_names, fields_of
from tests.k8s_render import pod_spec, render

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "k8s"
OVERLAYS = ("cpu", "gpu")
KUBERNETES = "1.37.0"  # the newest release kubernetes-validate carries schemas of
GPU_SERVICES = {"policy", "sandbox", "trainer", "distill"}


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    return tuple(render(K8S / "overlays" / overlay))


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in rendered(overlay) if d["kind"] == kind}


def container(overlay: str, name: str) -> dict:
    (only,) = pod_spec(objects(overlay, "Deployment")[name])["containers"]
    return only


# ----------------------------------------------------------------- schemas and rendering


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_a_current_kubernetes_release(overlay):
    assert kubernetes_validate.latest_version() == KUBERNETES
    for doc in rendered(overlay):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_the_schemas_reject_a_misspelt_field():
    doc = next(d for d in rendered("cpu") if d["kind"] == "Deployment")
    broken = yaml.safe_load(yaml.safe_dump(doc))
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"grpc": {"port": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed: the rendering is not compared")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_rendering_equals_kubectl_kustomize(overlay):
    done = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr

    def key(doc):
        return doc["kind"], doc["metadata"]["name"]

    assert sorted((d for d in yaml.safe_load_all(done.stdout) if d), key=key) == sorted(rendered(overlay), key=key)


def test_a_gpu_patch_that_no_longer_names_its_entry_fails_to_render(tmp_path):
    shutil.copytree(K8S, tmp_path / "k8s")
    policy = tmp_path / "k8s" / "base" / "policy.yaml"
    policy.write_text(policy.read_text().replace("LEAP_POLICY_BACKEND", "LEAP_POLICY_MAX_PROMPTS"))
    with pytest.raises(Exception, match="test|Test"):
        render(tmp_path / "k8s" / "overlays" / "gpu")


# ----------------------------------------------------------------- what each service gets


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("name", list(SERVICE_MODULES))
def test_each_service_runs_leap_serve_with_its_settings_and_grpc_probes(overlay, name):
    main = container(overlay, name)
    assert main["args"][:2] == ["serve", name]
    args = settings_parser(service_spec(name)).parse_args(main["args"][2:])
    port = int(args.port)
    assert port == DEFAULT_PORTS[name]
    assert main["ports"] == [{"name": "grpc", "containerPort": port}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": port}, probe
    cls = service_spec(name).config_class
    readable = {v for f in fields_of(cls) for v in env_names(cls, name, f.name)}
    leap_vars = {e["name"] for e in main["env"] if e["name"].startswith("LEAP_")}
    assert leap_vars <= readable, sorted(leap_vars - readable)
    (service,) = [s for s in objects(overlay, "Service").values() if s["spec"]["selector"] == {"app.kubernetes.io/name": name}]
    assert service["spec"]["ports"] == [{"name": "grpc", "port": port, "targetPort": "grpc", "appProtocol": "grpc"}]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_token_comes_from_a_secret_in_every_pod(overlay):
    for name, deployment in objects(overlay, "Deployment").items():
        env = {e["name"]: e for e in pod_spec(deployment)["containers"][0]["env"]}
        assert env["LEAP_AUTH_TOKEN"] == {"name": "LEAP_AUTH_TOKEN",
                                          "valueFrom": {"secretKeyRef": {"name": "leap-auth-token", "key": "token"}}}, name
        assert not any("ALLOW_UNAUTHENTICATED" in e for e in env), name
    assert not objects(overlay, "Secret"), "the token is created by you, never shipped"


def test_the_sandbox_is_headless_and_the_learners_resolve_every_pod_of_it():
    service = objects("cpu", "Service")["sandbox"]
    assert service["spec"]["clusterIP"] == "None"
    for name, setting in (("trainer", "LEAP_TRAINER_SANDBOX_ADDRESS"), ("distill", "LEAP_DISTILL_SANDBOX_ADDRESS")):
        env = container("cpu", name)["env"]
        names = [e["name"] for e in env]
        value = next(e["value"] for e in env if e["name"] == setting)
        assert value == "dns:///sandbox.$(POD_NAMESPACE).svc.cluster.local:50052"
        # $(VAR) expands only variables defined before it in the list
        assert names.index("POD_NAMESPACE") < names.index(setting)
        assert env[names.index("POD_NAMESPACE")]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    others = {e["name"]: e.get("value") for e in container("cpu", "trainer")["env"]}
    assert others["LEAP_TRAINER_POLICY_ADDRESS"] == "policy.$(POD_NAMESPACE).svc.cluster.local:50051"
    assert others["LEAP_TRAINER_REWARD_ADDRESS"] == "reward.$(POD_NAMESPACE).svc.cluster.local:50053"


def test_the_sandbox_scales_on_cpu_from_one_replica():
    hpa = objects("cpu", "HorizontalPodAutoscaler")["sandbox"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sandbox"}
    assert hpa["spec"]["minReplicas"] == 1 < hpa["spec"]["maxReplicas"]
    assert container("cpu", "sandbox")["resources"]["requests"]["cpu"], "utilization needs a CPU request"
    workers = next(e for e in container("cpu", "sandbox")["env"] if e["name"] == "LEAP_SANDBOX_WORKERS")
    assert workers["valueFrom"]["resourceFieldRef"] == {"containerName": "sandbox", "resource": "limits.cpu"}


def pods_selected(selector: dict, overlay: str = "cpu") -> set[str]:
    """Names of the Deployments whose pods `selector` (a LabelSelector) matches."""
    chosen = set()
    for name, deployment in objects(overlay, "Deployment").items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
        for expression in selector.get("matchExpressions", []):
            assert expression["operator"] == "In"
            ok = ok and labels.get(expression["key"]) in expression["values"]
        if ok:
            chosen.add(name)
    return chosen


def callers(policy: dict) -> set[str]:
    return {name for rule in policy["spec"].get("ingress", []) for peer in rule.get("from", [])
            for name in pods_selected(peer["podSelector"])}


def test_network_policies_let_only_the_learners_reach_the_sandbox_and_the_sandbox_reach_nothing():
    policies = objects("cpu", "NetworkPolicy")
    guarding = {name: pods_selected(p["spec"]["podSelector"]) for name, p in policies.items()}
    assert guarding["sandbox"] == {"sandbox"}
    sandbox = policies["sandbox"]["spec"]
    assert set(sandbox["policyTypes"]) == {"Ingress", "Egress"} and sandbox["egress"] == []
    assert all("namespaceSelector" not in peer and "ipBlock" not in peer
               for rule in sandbox["ingress"] for peer in rule["from"])
    assert callers(policies["sandbox"]) == {"trainer", "distill"}
    assert [r["ports"] for r in sandbox["ingress"]] == [[{"port": 50052, "protocol": "TCP"}]]
    assert guarding["policy"] == {"policy"} and callers(policies["policy"]) == {"trainer", "distill"}
    assert guarding["reward"] == {"reward"} and callers(policies["reward"]) == {"trainer"}
    assert set().union(*guarding.values()) == set(SERVICE_MODULES), "every service is covered by a policy"


def test_runs_and_models_live_on_persistent_volumes():
    claims = objects("cpu", "PersistentVolumeClaim")
    assert {"models", "runs", "reward-history"} <= set(claims)
    for name in ("trainer", "distill"):
        deployment = objects("cpu", "Deployment")[name]
        volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
        mounts = {m["mountPath"]: m for m in container("cpu", name)["volumeMounts"]}
        assert volumes[mounts["/runs"]["name"]]["persistentVolumeClaim"] == {"claimName": "runs"}
        assert not mounts["/runs"].get("readOnly")
        runs_dir = next(e["value"] for e in container("cpu", name)["env"] if e["name"] == f"LEAP_{name.upper()}_RUNS_DIR")
        assert runs_dir.startswith("/runs/"), runs_dir
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}, "never two processes on one run directory"


def test_only_the_sandbox_runs_as_root_with_what_bubblewrap_needs_and_no_pod_gets_api_credentials():
    for name, deployment in objects("cpu", "Deployment").items():
        spec = pod_spec(deployment)
        assert spec["automountServiceAccountToken"] is False, name
        for c in spec["containers"] + spec.get("initContainers", []):
            security = c["securityContext"]
            assert not security.get("privileged"), name
            if name == "sandbox":
                assert security["runAsUser"] == 0 and security["capabilities"] == {"add": ["SYS_ADMIN", "NET_ADMIN"]}
                assert security["appArmorProfile"] == {"type": "Unconfined"}
                assert security["seccompProfile"] == {"type": "Unconfined"}  # pivot_root; candidates get the sandbox's own
            else:
                assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 10001
                assert security["allowPrivilegeEscalation"] is False and security["capabilities"] == {"drop": ["ALL"]}
    namespace = objects("cpu", "Namespace")["leap"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_the_model_is_built_once_into_its_volume_by_the_policy_init_container():
    for overlay, directory, toolchain in (("cpu", "/models/tiny", None), ("gpu", "/models/tiny-cuda", "cuda")):
        spec = pod_spec(objects(overlay, "Deployment")["policy"])
        (init,) = spec["initContainers"]
        assert init["args"][:2] == ["bootstrap-model", directory]
        assert (init["args"][init["args"].index("--toolchains") + 1] if "--toolchains" in init["args"] else None) == toolchain
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["LEAP_POLICY_MODELS"] == f"policy={directory}"
        assert {m["name"] for m in init["volumeMounts"]} == {"models"}


# ----------------------------------------------------------------- GPU


def test_each_gpu_pod_gets_one_gpu_and_everything_runs_the_gpu_image():
    for overlay in OVERLAYS:
        for name, deployment in objects(overlay, "Deployment").items():
            spec = pod_spec(deployment)
            limits = spec["containers"][0]["resources"].get("limits", {})
            wanted = 1 if overlay == "gpu" and name in GPU_SERVICES else None
            assert limits.get("nvidia.com/gpu") == wanted, (overlay, name)
            for c in spec["containers"] + spec.get("initContainers", []):
                assert c["image"] == f"leap:{overlay}", (overlay, name, c["name"])
    env = {e["name"]: e.get("value") for e in container("gpu", "policy")["env"]}
    assert env["LEAP_POLICY_BACKEND"] == "vllm" and env["LEAP_POLICY_DEVICE"] == "cuda"


def test_the_readme_shows_the_commands():
    readme = (ROOT / "README.md").read_text()
    for overlay in OVERLAYS:
        assert f"kubectl apply -k k8s/overlays/{overlay}" in readme
    assert re.search(r"kubectl .*create secret generic leap-auth-token .*token=", readme)
