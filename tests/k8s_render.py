"""Render k8s/ overlays without kubectl: the subset of kustomize the manifests use
(resources, namespace, labels, images, JSON 6902 patches with a kind and name target).
tests/test_k8s.py checks that this rendering equals `kubectl kustomize` wherever kubectl is
installed, so the checks that read it hold for what kubectl applies."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonpatch
import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "labels", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "PriorityClass", "CustomResourceDefinition", "RuntimeClass"}


def pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        return doc["spec"]["template"]["spec"]
    return None


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml uses {sorted(unknown)}, which this renderer does not know")
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    docs = copy.deepcopy(docs)
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = kustomization["namespace"]
    for entry in kustomization.get("labels", []):
        if set(entry) - {"pairs"}:
            raise ValueError(f"labels: only plain pairs are rendered here, not {sorted(set(entry) - {'pairs'})}")
        for doc in docs:
            doc["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for image in kustomization.get("images", []):
        for doc in docs:
            spec = pod_spec(doc)
            for container in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}".rstrip(":")
    for patch in kustomization.get("patches", []):
        operations = yaml.safe_load((directory / patch["path"]).read_text())
        target = patch["target"]
        hits = [i for i, doc in enumerate(docs)
                if doc["kind"] == target["kind"] and doc["metadata"]["name"] == target["name"]]
        if not hits:
            raise ValueError(f"patch {patch['path']}: no {target['kind']} {target['name']}")
        for i in hits:
            docs[i] = jsonpatch.apply_patch(docs[i], operations)  # a failed `test` raises
    return docs
