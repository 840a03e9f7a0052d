"""The manifests' commands work together: each container of deploy/kubernetes (the default, no-GPU
kustomization) runs as a process with the command, arguments and environment Kubernetes would give
it, in a network namespace of its own, and a client infers through the frontend Service's port.
Prometheus's part is played too: the scheduler pod's metrics, scraped from another namespace at the
address its prometheus.io/* annotations give, hold the nexus_desired_devices series that the backend
HorizontalPodAutoscaler selects, and the HPA's arithmetic on it gives the backends running.

Each pod gets a namespace with one address on a bridge (which lives in a namespace of its own, so
nothing touches the host's network). The kubelet's part is played here: ``$(VAR)`` references are
expanded from the ConfigMap and the downward API (``status.podIP`` is the namespace's address), a
Service name in an argument resolves to the selected pod's address and target port (cluster DNS),
a volume mount is a fresh directory, and readiness is the container's gRPC readinessProbe, asked
from the client's namespace. Needs root for ``ip netns``; skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.launcher import Child
from tests.kube_manifests import (KUBE_DIR, ROOT, container_env, expand, find, pod_spec, render, replicas,
                                  scalers)

pytestmark = pytest.mark.slow

# The workloads started, in order; each replica (spec.replicas, or its HPA's minReplicas) is a pod.
WORKLOADS = [("StatefulSet", "nexus-scheduler"), ("Deployment", "nexus-frontend"),
             ("Deployment", "nexus-backend-emulated")]
READY_TIMEOUT_S = 180
EMULATED_GPU = "gtx1080ti"
PROFILE = Profile.linear(1.0, 5.0, 16, memory_base_mb=300, memory_per_item_mb=4, device_type=EMULATED_GPU)
SUBNET = "10.213.0"


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns)"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"nxk-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class Network:
    """A bridge in a namespace of its own, and one namespace per pod (and the client) on it."""

    def __init__(self, names: list[str]) -> None:
        tag = uuid.uuid4().hex[:6]
        self.bridge = f"nxk-{tag}-br"
        self.namespaces: dict[str, str] = {}
        self.addresses: dict[str, str] = {}
        self._ip("netns", "add", self.bridge)
        try:
            self._ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            self._ip("-n", self.bridge, "link", "set", "br0", "up")
            for i, name in enumerate(names):
                ns = f"nxk-{tag}-{i}"
                self._ip("netns", "add", ns)
                self.namespaces[name] = ns
                self._ip("-n", ns, "link", "set", "lo", "up")
                veth = f"v{tag}{i}"
                self._ip("-n", self.bridge, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._ip("-n", self.bridge, "link", "set", veth, "master", "br0", "up")
                self.addresses[name] = f"{SUBNET}.{i + 2}"
                self._ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
                self._ip("-n", ns, "link", "set", "eth0", "up")
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def argv(self, name: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[name], *argv]

    def close(self) -> None:
        for ns in [*self.namespaces.values(), self.bridge]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _pods(objects: list[dict]) -> list[tuple[str, dict]]:
    """(pod name, workload) for every replica of WORKLOADS, named as their controllers name them."""
    return [(f"{name}-{i}", find(objects, kind, name)) for kind, name in WORKLOADS
            for i in range(replicas(objects, find(objects, kind, name)))]


def _service_resolver(objects: list[dict], pods: list[tuple[str, dict]], pod_ips: dict[str, str]):
    """Cluster DNS for arguments: ``<service>[.<ns>[.svc...]]:<port>`` becomes the address of the
    first pod the Service selects and the container port its targetPort names."""
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}

    def target(service: dict, port: int) -> str:
        (spec_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
        for pod_name, workload in pods:
            ip = pod_ips[pod_name]
            labels = workload["spec"]["template"]["metadata"]["labels"]
            if service["spec"]["selector"].items() <= labels.items():
                for c in pod_spec(workload)["containers"]:
                    for p in c["ports"]:
                        if spec_port["targetPort"] in (p["name"], p["containerPort"]):
                            return f"{ip}:{p['containerPort']}"
        raise LookupError(f"service {service['metadata']['name']}:{port} selects no running pod")

    def resolve(arg: str) -> str:
        m = re.fullmatch(r"([a-z0-9-]+)(?:\.[a-z0-9.-]+)?:(\d+)", arg)
        if m and m.group(1) in services:
            return target(services[m.group(1)], int(m.group(2)))
        return arg
    return resolve


def _pod_command(pod: str, workload: dict, objects: list[dict], pod_ip: str, resolve, volumes: pathlib.Path):
    (c,) = pod_spec(workload)["containers"]
    assert c["command"] == ["nexus"], "the image's nexus command"
    env = container_env(c, objects, {"status.podIP": pod_ip})
    args = [resolve(expand(a, env)) for a in c["args"]]
    mounts = {}
    for mount in c.get("volumeMounts", []):
        mounts[mount["mountPath"]] = volumes / pod / mount["name"]
        mounts[mount["mountPath"]].mkdir(parents=True, exist_ok=True)
    args = [_in_volume(a, mounts) for a in args]
    # The image's own environment (Dockerfile ENV) plus what reaches this tree's code.
    env.update(PATH=os.environ["PATH"], PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1",
               HOME=str(volumes), MPLCONFIGDIR=str(volumes / "matplotlib"))
    return args, env, c


def _in_volume(arg: str, mounts: dict[str, pathlib.Path]) -> str:
    """A path under a volume's mountPath, moved to the directory standing for that volume."""
    for path in sorted(mounts, key=len, reverse=True):
        if arg == path or arg.startswith(path.rstrip("/") + "/"):
            return str(mounts[path]) + arg[len(path):]
    return arg


@pytest.fixture
def network():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    net = Network([pod for pod, _ in _pods(render(KUBE_DIR))] + ["client"])
    yield net
    net.close()


def test_manifest_commands_serve_a_model_together(network, tmp_path):
    objects = render(KUBE_DIR)
    pods = _pods(objects)
    assert sum(1 for _, w in pods if w["metadata"]["name"] == "nexus-backend-emulated") >= 2, \
        "two backends on the same port in different pods are the case to prove"
    resolve = _service_resolver(objects, pods, network.addresses)
    procs: list[tuple[str, Child, pathlib.Path]] = []
    client_env = dict(os.environ, PYTHONPATH=str(ROOT), NEXUS_LOG="WARNING")

    def client(*argv: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(network.argv("client", [sys.executable, *argv]), capture_output=True, text=True,
                              env=client_env, timeout=timeout_s, cwd=ROOT)

    def logs() -> str:
        return "\n".join(f"--- {name} (exit {c.proc.poll()}):\n{log.read_text()[-3000:]}" for name, c, log in procs)

    try:
        for pod, workload in pods:
            argv, env, container = _pod_command(pod, workload, objects, network.addresses[pod], resolve, tmp_path)
            log = tmp_path / f"{pod}.log"
            with log.open("w") as out:     # the image's `nexus`, started by the project's one launcher
                procs.append((pod, Child(pod, argv, env, command=[sys.executable, "-m", "nexus"],
                                         wrap=network.argv(pod, []), stderr=out, start_new_session=True), log))
            if workload["kind"] == "StatefulSet":
                # The scheduler is what the others register with: wait for it as a StatefulSet
                # rollout would, before starting the rest.
                _wait_ready(client, container, network.addresses[pod], logs)
        # Every pod ready: a backend only once the scheduler reached it at its advertised address
        # with its model table, a frontend once it holds a routing table and reaches the backends.
        for pod, workload in pods:
            (container,) = pod_spec(workload)["containers"]
            _wait_ready(client, container, network.addresses[pod], logs)

        model, profile = tmp_path / "mlp.onnx", tmp_path / "profile.json"
        model.write_bytes(model_bytes(mlp_small()))
        profile.write_text(PROFILE.to_json())
        scheduler = resolve(find(objects, "ConfigMap", "nexus-config")["data"]["NEXUS_SCHEDULER_ADDRESS"])
        up = client("-m", "nexus", "models", "upload", str(model), "--name", "k8s_mlp", "--profile", str(profile),
                     "--slo-ms", "200", "--scheduler", scheduler)
        assert up.returncode == 0, up.stderr + logs()

        service = resolve("nexus-frontend:8001")           # the frontend Service's gRPC port
        frontends = [f"{network.addresses[pod]}:8001" for pod, w in pods if w["metadata"]["name"] == "nexus-frontend"]
        assert service in frontends and len(frontends) >= 2
        for frontend in frontends:                         # whichever pod the Service picks
            done = client("-m", "tests.kube_client", "infer", frontend, "k8s_mlp", "3", "64")
            assert done.returncode == 0, done.stderr + logs()
            # emulated GPUs answer zeros of the declared shape: the request went the whole way
            assert json.loads(done.stdout) == {"shape": [3, 10], "dtype": "float32"}
        _check_the_hpa_reads_the_scheduler(objects, pods, network.addresses, client, logs)
        for name, child, _ in procs:
            assert child.running(), f"{name} exited\n{logs()}"
    finally:
        for _, child, _ in procs:
            child.signal(signal.SIGTERM)
        for _, child, _ in procs:
            child.stop(timeout_s=40)


def _wait_ready(client, container: dict, pod_ip: str, logs) -> None:
    """The container's readinessProbe (gRPC health, its service and port), from the client's namespace."""
    probe = container["readinessProbe"]["grpc"]
    done = client("-m", "tests.kube_client", "ready", f"{pod_ip}:{probe['port']}", probe.get("service", ""),
                  str(READY_TIMEOUT_S), timeout_s=READY_TIMEOUT_S + 30)
    assert done.returncode == 0, done.stderr + logs()


def _check_the_hpa_reads_the_scheduler(objects, pods, addresses, client, logs) -> None:
    """Scrape the scheduler pod from the client's namespace as Prometheus's annotation-based job
    does (pod IP, prometheus.io/port and /path), then do what prometheus-adapter and the HPA do: take
    the series the HPA's selector names, sum them, and divide by the AverageValue target."""
    (scheduler_pod, scheduler), = [(p, w) for p, w in pods if w["kind"] == "StatefulSet"]
    annotations = scheduler["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    url = f"http://{addresses[scheduler_pod]}:{annotations['prometheus.io/port']}{annotations['prometheus.io/path']}"
    backend = find(objects, "Deployment", "nexus-backend-emulated")
    (hpa,) = scalers(objects, backend)
    (metric,) = hpa["spec"]["metrics"]
    name, selector = metric["external"]["metric"]["name"], metric["external"]["metric"]["selector"]["matchLabels"]
    running = sum(1 for _, w in pods if w is backend)
    done = client("-m", "tests.kube_client", "scrape", url, name, "30", timeout_s=60)
    assert done.returncode == 0, done.stderr + logs()
    samples = json.loads(done.stdout)
    chosen = [value for sample, labels, value in samples if sample == name and selector.items() <= labels.items()]
    assert len(chosen) == 1, (selector, samples)
    registered = [v for s, labels, v in samples if s == "nexus_registered_devices" and selector.items() <= labels.items()]
    assert registered == [running]
    wanted = math.ceil(sum(chosen) / float(metric["external"]["target"]["averageValue"]))
    # The scheduler wants what runs (its --min-devices, the HPA's minReplicas): the HPA holds still.
    assert hpa["spec"]["minReplicas"] <= wanted == running <= hpa["spec"]["maxReplicas"], (wanted, running)
