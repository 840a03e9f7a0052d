"""Reading deploy/kubernetes/ as Kubernetes would, for the manifest tests (no kubectl needed).

:func:`render` builds what ``kubectl apply -k DIR`` would send for the subset of kustomize the
manifests use (``resources`` and ``namespace``; any other key is an error, so that the rendering
here never silently differs from kustomize's). :func:`container_env` and :func:`expand` give a
container the environment and arguments the kubelet would: ConfigMap keys, downward-API fields and
``$(VAR)`` references expanded by Kubernetes' rules.
"""

from __future__ import annotations

import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
KUBE_DIR = ROOT / "deploy" / "kubernetes"
KUSTOMIZATION = "kustomization.yaml"
KNOWN_KEYS = {"apiVersion", "kind", "resources", "namespace"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "Job"}
# Kinds of CRDs (KEDA, the Prometheus Operator): no schema offline, so not validated.
CUSTOM_RESOURCES = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}


class RenderError(ValueError):
    pass


def load_documents(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifest_files() -> list[pathlib.Path]:
    """Every YAML file under deploy/kubernetes that holds Kubernetes objects."""
    return sorted(p for p in KUBE_DIR.rglob("*.yaml") if p.name != KUSTOMIZATION)


def kustomization_dirs() -> list[pathlib.Path]:
    return sorted(p.parent for p in KUBE_DIR.rglob(KUSTOMIZATION))


def render(directory: pathlib.Path) -> list[dict]:
    """The objects ``kubectl apply -k directory`` would create."""
    spec = yaml.safe_load((directory / KUSTOMIZATION).read_text())
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise RenderError(f"{directory / KUSTOMIZATION}: keys this renderer does not implement: {sorted(unknown)}")
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += render(path)
        elif path.is_file():
            if directory.resolve() not in path.parents:
                raise RenderError(f"{directory / KUSTOMIZATION}: {entry} is outside the kustomization's directory "
                                  "(kustomize refuses to load it)")
            objects += load_documents(path)
        else:
            raise RenderError(f"{directory / KUSTOMIZATION}: no such resource {entry!r}")
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = spec["namespace"]
    seen = set()
    for obj in objects:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{directory}: {key} defined twice")
        seen.add(key)
    return objects


def find(objects: list[dict], kind: str, name: str) -> dict:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise KeyError((kind, name))


def workloads(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def is_custom_resource(obj: dict) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in CUSTOM_RESOURCES


def scalers(objects: list[dict], workload: dict) -> list[dict]:
    """The HorizontalPodAutoscalers and KEDA ScaledObjects that scale ``workload``."""
    name, kind = workload["metadata"]["name"], workload["kind"]
    return [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
            and o["spec"]["scaleTargetRef"]["name"] == name
            and o["spec"]["scaleTargetRef"].get("kind", "Deployment") == kind]


def replicas(objects: list[dict], workload: dict) -> int:
    """The pods ``workload`` runs before any metric asks for more: its HPA's (or ScaledObject's)
    minimum when one scales it, else ``spec.replicas`` (default 1)."""
    for scaler in scalers(objects, workload):
        if scaler["kind"] == "ScaledObject":
            return scaler["spec"].get("minReplicaCount", 0)
        return scaler["spec"].get("minReplicas", 1)
    return workload["spec"].get("replicas", 1)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def containers(objects: list[dict]) -> list[tuple[dict, dict]]:
    """(workload, container) for every container of every workload."""
    return [(w, c) for w in workloads(objects) for c in pod_spec(w)["containers"] + pod_spec(w).get("initContainers", [])]


def config_maps(objects: list[dict]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in objects if o["kind"] == "ConfigMap"}


def container_env(container: dict, objects: list[dict], fields: dict[str, str],
                  operator_secrets: dict[str, dict[str, str]] | None = None) -> dict[str, str]:
    """The environment the kubelet gives ``container``: ``fields`` holds downward-API values
    (``status.podIP``...), ``operator_secrets`` the Secrets the operator creates beside the manifests
    (by name, then key). An optional Secret that does not exist leaves its variable unset, as
    Kubernetes does; a missing required one is an error."""
    maps = config_maps(objects)
    secrets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Secret"}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = maps[ref["name"]][ref["key"]]
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            if ref["name"] in secrets:
                raise RenderError(f"{var['name']}: Secrets in the manifests are not expected")
            given = (operator_secrets or {}).get(ref["name"], {})
            if ref["key"] in given:
                env[var["name"]] = given[ref["key"]]
            elif not ref.get("optional", False):
                raise RenderError(f"{var['name']}: Secret {ref['name']!r} is required but not in the manifests")
        else:
            raise RenderError(f"{var['name']}: unsupported valueFrom {sorted(source)}")
    return env


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, an undefined reference
    is left as written, ``$$`` is one ``$``."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REFERENCE.sub(sub, text)


def references(text: str) -> set[str]:
    return {m.group(1) for m in _REFERENCE.finditer(text) if m.group(1)}


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def image_name(variant: str) -> str:
    """The image the Dockerfile builds for ``variant``: <project name>:<version>-<variant>."""
    p = project()
    return f"{p['name']}:{p['version']}-{variant}"
