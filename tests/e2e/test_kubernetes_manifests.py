"""deploy/kubernetes/ and the Dockerfile: strict schema validation offline, and the rules every
container follows (probes, non-root, resources, the image the Dockerfile builds).

The slow test that runs the manifests' commands as processes is tests/e2e/test_kubernetes_commands.py.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from common.config import (BackendConfig, FrontendConfig, SchedulerConfig, add_arguments, from_args,
                           split_host_port)
from common.metrics_http import METRICS_PATH
from tests.kube_manifests import (CUSTOM_RESOURCES, KUBE_DIR, ROOT, RenderError, config_maps, container_env,
                                  containers, expand, find, image_name, is_custom_resource, kustomization_dirs,
                                  load_documents, manifest_files, pod_spec, references, render, scalers,
                                  workloads)

# The Kubernetes release whose schema the manifests must satisfy (gRPC probes are GA from 1.27).
KUBERNETES_VERSION = "1.33.0"
DEFAULT = KUBE_DIR                       # kubectl apply -k deploy/kubernetes: no GPU needed
GPU = KUBE_DIR / "gpu"                   # kubectl apply -k deploy/kubernetes/gpu
KEDA = KUBE_DIR / "keda" / "emulated"    # the default with a KEDA ScaledObject instead of the HPA
KEDA_GPU = KUBE_DIR / "keda" / "gpu"
ADAPTER = KUBE_DIR / "prometheus-adapter"
SERVICE_MONITOR = KUBE_DIR / "servicemonitor"
ELASTIC = [pytest.param(d, id=str(d.relative_to(KUBE_DIR))) for d in (DEFAULT, GPU, KEDA, KEDA_GPU, KUBE_DIR / "ha")]
DESIRED_DEVICES = "nexus_desired_devices"
COMPONENT_CONFIGS = {"scheduler": SchedulerConfig, "frontend": FrontendConfig, "backend": BackendConfig}
SAMPLE_FIELDS = {"status.podIP": "10.244.1.7", "metadata.name": "pod-0", "metadata.namespace": "nexus"}
PRESTOP_S = 5
# What the operator creates beside the manifests (deploy/kubernetes/scheduler/postgresql/scheduler.yaml)
OPERATOR_SECRETS = {"nexus-database": {"url": "postgresql://nexus@db.example:5432/nexus", "password": "pw"}}
HA = KUBE_DIR / "ha"                     # kubectl apply -k deploy/kubernetes/ha: two schedulers on PostgreSQL


def _documents():
    """Every object but the custom resources (KEDA, the Prometheus Operator: no schema offline)."""
    return [pytest.param(doc, id=f"{path.relative_to(KUBE_DIR)}:{doc['kind']}/{doc['metadata']['name']}")
            for path in manifest_files() for doc in load_documents(path) if not is_custom_resource(doc)]


def _rendered():
    return [pytest.param(d, id=str(d.relative_to(ROOT))) for d in kustomization_dirs()]


@pytest.mark.parametrize("doc", _documents())
def test_every_manifest_validates_strictly(doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("directory", _rendered())
def test_every_kustomization_renders_to_valid_objects(directory):
    objects = render(directory)
    assert objects
    for obj in objects:
        if not is_custom_resource(obj):
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_only_the_known_custom_resources_escape_validation():
    """A misspelt apiVersion is not taken for a CRD: only KEDA's ScaledObject and the operator's
    ServiceMonitor go unvalidated, and each is where its README says."""
    custom = {(path.relative_to(KUBE_DIR).as_posix(), doc["kind"]) for path in manifest_files()
              for doc in load_documents(path) if is_custom_resource(doc)}
    assert custom == {("keda/emulated/scaledobject.yaml", "ScaledObject"), ("keda/gpu/scaledobject.yaml", "ScaledObject"),
                      ("servicemonitor/servicemonitor.yaml", "ServiceMonitor")}
    assert {kind for _, kind in CUSTOM_RESOURCES} == {kind for _, kind in custom}
    typo = {"apiVersion": "monitoring.coreos.com/v1beta1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
            "spec": {}}
    assert not is_custom_resource(typo)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(typo, KUBERNETES_VERSION, strict=True)


def test_strict_validation_rejects_an_unknown_field():
    """The validation above can fail: a misspelt probe field is an error in strict mode."""
    doc = copy.deepcopy(find(render(DEFAULT), "Deployment", "nexus-frontend"))
    probe = pod_spec(doc)["containers"][0]["readinessProbe"]
    probe["grpc"]["serviceName"] = probe["grpc"].pop("service")
    with pytest.raises(kubernetes_validate.ValidationError, match="serviceName"):
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [a.yaml]\npatches: []\n")
    with pytest.raises(RenderError, match="patches"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(RenderError, match="no such resource"):
        render(tmp_path)


@pytest.mark.parametrize("directory", [DEFAULT, GPU, HA], ids=["default", "gpu", "ha"])
def test_every_container_has_grpc_probes_resources_and_a_non_root_context(directory):
    objects = render(directory)
    assert len(containers(objects)) >= 3
    for workload, c in containers(objects):
        where = f"{workload['metadata']['name']}/{c['name']}"
        ports = {p["containerPort"] for p in c["ports"]}
        assert c["livenessProbe"]["grpc"]["service"] == "liveness", where
        assert c["readinessProbe"]["grpc"]["service"] == "", where
        assert c["startupProbe"]["grpc"]["service"] == "liveness", where
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert c[probe]["grpc"]["port"] in ports, (where, probe)

        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        assert {"cpu", "memory"} <= set(requests), where
        assert "memory" in limits, where

        pod, sc = pod_spec(workload)["securityContext"], c["securityContext"]
        assert sc["runAsNonRoot"] is True and pod["runAsNonRoot"] is True, where
        assert pod["runAsUser"] > 0 and pod.get("runAsGroup", 1) > 0, where
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", where
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"], where
        assert sc["readOnlyRootFilesystem"] is True, where
        volumes = {v["name"]: v for v in pod_spec(workload).get("volumes", [])}
        tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{where}: a read-only root needs a writable /tmp"
        assert pod_spec(workload)["automountServiceAccountToken"] is False, where


def test_the_image_user_is_the_manifests_user():
    dockerfile = (ROOT / "Dockerfile").read_text()
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile, re.M)
    assert user, "the Dockerfile sets a numeric USER (runAsNonRoot needs one)"
    for workload in workloads(render(DEFAULT) + render(GPU)):
        pod = pod_spec(workload)["securityContext"]
        assert (pod["runAsUser"], pod["runAsGroup"]) == (int(user.group(1)), int(user.group(2)))


def test_images_are_the_ones_the_dockerfile_builds():
    dockerfile = (ROOT / "Dockerfile").read_text()
    for variant in ("cpu", "cuda"):
        assert f"-t {image_name(variant)} " in dockerfile, f"the Dockerfile's build line for {variant}"
    default = {c["image"] for _, c in containers(render(DEFAULT))}
    assert default == {image_name("cpu")}, "a cluster without GPUs runs the cpu image only"
    gpu = {w["metadata"]["name"]: c["image"] for w, c in containers(render(GPU))}
    assert gpu.pop("nexus-backend-gpu") == image_name("cuda")
    assert set(gpu.values()) == {image_name("cpu")}


def test_gpu_backends_take_one_gpu_each_and_the_default_needs_none():
    backend = find(render(GPU), "Deployment", "nexus-backend-gpu")
    (c,) = pod_spec(backend)["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["args"][c["args"].index("--device") + 1] == "cuda:0"
    for _, other in containers(render(DEFAULT)):
        assert "nvidia.com/gpu" not in str(other["resources"])
    emulated = find(render(DEFAULT), "Deployment", "nexus-backend-emulated")
    (c,) = pod_spec(emulated)["containers"]
    device = c["args"][c["args"].index("--device") + 1]
    assert expand(device, container_env(c, render(DEFAULT), SAMPLE_FIELDS)).startswith("emulated:")


def pod_spec_labels(workload: dict) -> dict:
    return {k: v for k, v in workload["spec"]["template"]["metadata"]["labels"].items()
            if k in workload["spec"]["selector"]["matchLabels"]}


def test_the_scheduler_is_one_statefulset_replica_with_its_database_on_a_claim():
    objects = render(DEFAULT)
    (scheduler,) = [w for w in workloads(objects) if "scheduler" in w["metadata"]["name"]]
    assert scheduler["kind"] == "StatefulSet"
    assert scheduler["spec"]["replicas"] == 1
    (claim,) = scheduler["spec"]["volumeClaimTemplates"]
    (c,) = pod_spec(scheduler)["containers"]
    data_dir = c["args"][c["args"].index("--data-dir") + 1]
    assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in c["volumeMounts"]
    assert find(objects, "Service", scheduler["spec"]["serviceName"])["spec"]["clusterIP"] == "None"
    # frontends and backends dial the scheduler's ClusterIP Service, on the port it listens on
    service = find(objects, "Service", "nexus-scheduler")
    address = config_maps(objects)["nexus-config"]["NEXUS_SCHEDULER_ADDRESS"]
    assert address == f"nexus-scheduler:{service['spec']['ports'][0]['port']}"


def test_the_ha_scheduler_is_a_leader_and_a_standby_on_postgresql():
    objects = render(HA)
    (scheduler,) = [w for w in workloads(objects) if "scheduler" in w["metadata"]["name"]]
    assert scheduler["kind"] == "Deployment" and scheduler["spec"]["replicas"] == 2
    # only the leader is ready: a rollout keeps it and replaces one pod at a time
    assert scheduler["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 1}
    (c,) = pod_spec(scheduler)["containers"]
    assert c["readinessProbe"]["grpc"] == {"port": 8100, "service": ""}
    config = _config(c, objects)
    assert config.database == OPERATOR_SECRETS["nexus-database"]["url"]
    assert config.advertise == f"{SAMPLE_FIELDS['status.podIP']}:8100"
    env = container_env(c, objects, SAMPLE_FIELDS, OPERATOR_SECRETS)
    assert env["PGPASSWORD"] == "pw" and "pw" not in " ".join(c["args"])      # never on the command line
    assert "volumeClaimTemplates" not in scheduler["spec"]                     # the database holds the state
    anti = pod_spec(scheduler)["affinity"]["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] == \
        "kubernetes.io/hostname"
    # nodes dial the Service, which sends them to the ready pod: the leader
    service = find(objects, "Service", "nexus-scheduler")
    assert service["spec"]["selector"] == pod_spec_labels(scheduler) and "publishNotReadyAddresses" not in service["spec"]
    with pytest.raises(RenderError, match="Secret 'nexus-database' is required"):
        container_env(c, objects, SAMPLE_FIELDS)                                # without the operator's Secret


@pytest.mark.parametrize("directory", [DEFAULT, GPU, HA], ids=["default", "gpu", "ha"])
def test_services_select_pods_and_name_their_ports(directory):
    objects = render(directory)
    services = [o for o in objects if o["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"nexus-scheduler", "nexus-frontend"}
    for service in services:
        selected = [w for w in workloads(objects)
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, service["metadata"]["name"]
        names = {p["name"] for w in selected for c in pod_spec(w)["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, (service["metadata"]["name"], port)
    frontend = find(objects, "Service", "nexus-frontend")
    assert {(p["name"], p["port"]) for p in frontend["spec"]["ports"]} == {("grpc", 8001), ("http", 8000)}


def _config(container: dict, objects: list[dict]):
    """The component's configuration from the container's args, expanded as the kubelet would and
    parsed and validated as `nexus scheduler|frontend|backend` does."""
    env = container_env(container, objects, SAMPLE_FIELDS, OPERATOR_SECRETS)
    component, *flags = [expand(a, env) for a in container["args"]]
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser, COMPONENT_CONFIGS[component])
    return from_args(COMPONENT_CONFIGS[component], parser.parse_args(flags))


@pytest.mark.parametrize("directory", [DEFAULT, GPU, HA], ids=["default", "gpu", "ha"])
def test_container_args_are_valid_component_flags(directory):
    """Every $(VAR) comes from the container's env, and the expanded args parse and validate as the
    component's config (the same parser as `nexus scheduler|frontend|backend`)."""
    objects = render(directory)
    for workload, c in containers(objects):
        where = f"{workload['metadata']['name']}/{c['name']}"
        assert c["command"] == ["nexus"], where
        env = container_env(c, objects, SAMPLE_FIELDS, OPERATOR_SECRETS)
        for arg in c["args"]:
            assert references(arg) <= set(env), (where, arg)
        component = c["args"][0]
        config = _config(c, objects)
        assert config.listen.startswith("0.0.0.0:"), where
        if component != "scheduler":
            assert config.advertise == f"{SAMPLE_FIELDS['status.podIP']}:{config.listen.rsplit(':', 1)[1]}", where
            assert config.scheduler == "nexus-scheduler:8100", where


@pytest.mark.parametrize("directory", [DEFAULT, GPU], ids=["default", "gpu"])
def test_pods_get_time_to_drain_before_they_are_killed(directory):
    """terminationGracePeriodSeconds covers the preStop pause and the component's --drain-grace-s."""
    objects = render(directory)
    for workload, c in containers(objects):
        if "--drain-grace-s" not in c["args"]:
            continue
        env = container_env(c, objects, SAMPLE_FIELDS)
        grace = float(expand(c["args"][c["args"].index("--drain-grace-s") + 1], env))
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop == ["sleep", str(PRESTOP_S)]
        assert pod_spec(workload)["terminationGracePeriodSeconds"] >= PRESTOP_S + grace + 5, workload["metadata"]["name"]


def test_frontends_keep_serving_through_voluntary_disruptions():
    objects = render(DEFAULT)
    pdb = find(objects, "PodDisruptionBudget", "nexus-frontend")
    frontend = find(objects, "Deployment", "nexus-frontend")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= frontend["spec"]["template"]["metadata"]["labels"].items()
    assert frontend["spec"]["replicas"] > pdb["spec"]["maxUnavailable"]


def test_env_references_unknown_configmap_keys_fail(tmp_path):
    """A container naming a key the ConfigMap lacks is caught (the kubelet would refuse to start it)."""
    objects = render(DEFAULT)
    c = copy.deepcopy(pod_spec(find(objects, "Deployment", "nexus-frontend"))["containers"][0])
    c["env"].append({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "nexus-config", "key": "NO_SUCH_KEY"}}})
    with pytest.raises(KeyError, match="NO_SUCH_KEY"):
        container_env(c, objects, SAMPLE_FIELDS)
    c["env"][-1] = {"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "token"}}}
    with pytest.raises(RenderError, match="required"):
        container_env(c, objects, SAMPLE_FIELDS)


def test_expansion_follows_kubernetes_rules():
    env = {"A": "1", "POD_IP": "10.0.0.2"}
    assert expand("$(POD_IP):8001", env) == "10.0.0.2:8001"
    assert expand("$(MISSING)-$(A)", env) == "$(MISSING)-1"
    assert expand("$$(A)", env) == "$(A)"


def _scheduler(objects: list[dict]) -> tuple[dict, dict, SchedulerConfig]:
    (scheduler,) = [w for w in workloads(objects) if w["metadata"]["name"] == "nexus-scheduler"]
    (c,) = pod_spec(scheduler)["containers"]
    return scheduler, c, _config(c, objects)


def _follows(scaler: dict) -> tuple[dict[str, str], int, int, dict]:
    """What an autoscaler follows: (the labels its nexus_desired_devices series must carry besides
    the namespace, minimum, maximum, HPA behaviour), read from an HPA or a KEDA ScaledObject, each
    set up so that the replica count is ceil(gauge / 1)."""
    spec = scaler["spec"]
    if scaler["kind"] == "HorizontalPodAutoscaler":
        (metric,) = spec["metrics"]
        assert metric["type"] == "External"
        assert metric["external"]["metric"]["name"] == DESIRED_DEVICES
        assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
        selector = metric["external"]["metric"]["selector"]
        assert set(selector) == {"matchLabels"}
        return selector["matchLabels"], spec["minReplicas"], spec["maxReplicas"], spec["behavior"]
    (trigger,) = spec["triggers"]
    assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
    metadata = trigger["metadata"]
    assert metadata["threshold"] == "1" and metadata["ignoreNullValues"] == "false"
    query = re.fullmatch(rf"max\({DESIRED_DEVICES}\{{(.*)\}}\)", metadata["query"])
    assert query, metadata["query"]
    labels = dict(re.findall(r'(\w+)="([^"]*)"', query.group(1)))
    assert labels.pop("namespace") == scaler["metadata"]["namespace"], "the query reads its own namespace"
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    return labels, spec["minReplicaCount"], spec["maxReplicaCount"], behavior


def _check_backends_follow_the_scheduler(objects: list[dict]) -> int:
    """Each backend Deployment has one autoscaler, on nexus_desired_devices of the device type its
    pods register, within the scheduler's --min/--max-devices for that type, and with a behaviour
    that repeats the scheduler's cool-down and one step per cool-down, and never delays a scale-up."""
    _, _, scheduler = _scheduler(objects)
    cooldown_s = scheduler.scale_down_cooldown_s
    backends = [w for w in workloads(objects) if w["metadata"]["labels"]["app.kubernetes.io/component"] == "backend"]
    for deployment in backends:
        name = deployment["metadata"]["name"]
        assert "replicas" not in deployment["spec"], f"{name}: the autoscaler owns the count; apply would reset it"
        found = scalers(objects, deployment)
        assert len(found) == 1, f"{name}: exactly one autoscaler (two fight over the count), got {len(found)}"
        (c,) = pod_spec(deployment)["containers"]
        device_type = _config(c, objects).resolved_device_type
        selector, low, high, behavior = _follows(found[0])
        assert selector == {"device_type": device_type}, f"{name} registers {device_type!r}, scaled on {selector}"
        assert (low, high) == scheduler.device_bounds.of(device_type), \
            f"{name}: replicas {low}..{high}, --min/--max-devices {scheduler.device_bounds.of(device_type)}"
        down, up = behavior["scaleDown"], behavior["scaleUp"]
        assert down["stabilizationWindowSeconds"] == cooldown_s, f"{name}: scale-down window != --scale-down-cooldown-s"
        assert down["policies"] == [{"type": "Percent", "value": 100, "periodSeconds": cooldown_s}], \
            f"{name}: scale down by the scheduler's step, however many pods, once per --scale-down-cooldown-s"
        assert up["stabilizationWindowSeconds"] == 0, f"{name}: scale up at once"
        assert up.get("selectPolicy", "Max") == "Max"
        assert max(p["value"] for p in up["policies"] if p["type"] == "Pods") >= high - low, \
            f"{name}: a scale-up from the minimum to the maximum in one step"
        assert down["tolerance"] == up["tolerance"] == 0, f"{name}: follow a change of one device"
    return len(backends)


@pytest.mark.parametrize("directory", ELASTIC)
def test_backends_scale_on_the_scheduler_decision_for_their_device_type(directory):
    assert _check_backends_follow_the_scheduler(render(directory)) == 1


def test_the_scaling_check_catches_drift_from_the_scheduler_flags():
    """The check above fails when the ConfigMap and an autoscaler disagree."""
    for key, value, message in [("NEXUS_SCALE_DOWN_COOLDOWN_S", "120", "window"),
                                ("NEXUS_MAX_DEVICES", "gtx1080ti=4,*=8", "--min/--max-devices"),
                                ("NEXUS_MIN_DEVICES", "0", "--min/--max-devices"),
                                ("NEXUS_EMULATED_GPU", "t4", "registers 't4'")]:
        objects = render(DEFAULT)
        find(objects, "ConfigMap", "nexus-config")["data"][key] = value
        with pytest.raises(AssertionError, match=re.escape(message)):
            _check_backends_follow_the_scheduler(objects)
    objects = render(DEFAULT) + render(KEDA)[-1:]
    assert objects[-1]["kind"] == "ScaledObject"
    with pytest.raises(AssertionError, match="exactly one autoscaler"):
        _check_backends_follow_the_scheduler(objects)


@pytest.mark.parametrize("directory", [DEFAULT, GPU], ids=["default", "gpu"])
def test_prometheus_scrapes_the_scheduler_metrics_port(directory):
    """The pod's prometheus.io/* annotations, its container port and the Service's `metrics` port all
    name the port the scheduler serves /metrics on (--metrics-listen, on every interface)."""
    objects = render(directory)
    scheduler, c, config = _scheduler(objects)
    host, port = split_host_port(config.metrics_listen)
    assert host == "0.0.0.0"
    annotations = scheduler["spec"]["template"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], int(annotations["prometheus.io/port"]),
            annotations["prometheus.io/path"]) == ("true", port, METRICS_PATH)
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in c["ports"]
    service = find(objects, "Service", "nexus-scheduler")
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} >= {("metrics", port, "metrics")}
    (monitor,) = render(SERVICE_MONITOR)
    assert monitor["metadata"]["namespace"] == service["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("metrics", METRICS_PATH)]


def test_the_adapter_rule_serves_the_gauge_the_hpas_name_per_namespace():
    """prometheus-adapter's ConfigMap (mounted by its chart with rules.existing) holds one external
    rule: nexus_desired_devices under that name, with the HPA's namespace added to the query, one
    series per device type (max, so that a duplicate scrape does not add up)."""
    (rules,) = render(ADAPTER)
    config = yaml.safe_load(rules["data"]["config.yaml"])
    assert set(config) == {"externalRules"}
    (rule,) = config["externalRules"]
    names = {m["external"]["metric"]["name"] for d in (DEFAULT, GPU) for s in render(d)
             if s["kind"] == "HorizontalPodAutoscaler" for m in s["spec"]["metrics"]}
    assert names == {rule["name"]["as"]} and re.fullmatch(rule["name"]["matches"], DESIRED_DEVICES)
    assert rule["seriesQuery"].startswith(DESIRED_DEVICES + "{") and 'device_type!=""' in rule["seriesQuery"]
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}
    assert re.fullmatch(r"max by \(device_type\) \(<<\.Series>>\{<<\.LabelMatchers>>\}\)", rule["metricsQuery"])
    # docs/deployment.md's install command mounts this ConfigMap, in the namespace it is rendered into.
    readme = (ROOT / "docs" / "deployment.md").read_text()
    install = re.search(r"helm install prometheus-adapter prometheus-community/prometheus-adapter[^`]*", readme)
    assert install, "docs/deployment.md: how to install prometheus-adapter"
    assert f"-n {rules['metadata']['namespace']}" in install.group(0)
    assert f"rules.existing={rules['metadata']['name']}" in install.group(0)


# The image's Python requirements (deploy/docker/requirements.py, run by the Dockerfile).
REQUIREMENTS = [sys.executable, str(ROOT / "deploy" / "docker" / "requirements.py")]


def _requirements(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*REQUIREMENTS, *args], capture_output=True, text=True, timeout=60)


def test_image_variants_carry_exactly_one_onnx_runtime():
    cpu = _requirements("cpu").stdout.split()
    cuda = _requirements("cuda").stdout.split()
    assert [r for r in cpu if r.startswith("onnxruntime")] == [r for r in cpu if re.match(r"onnxruntime[<>=]", r)]
    assert not any(r.startswith("onnxruntime-gpu") for r in cpu)
    assert [r for r in cuda if r.startswith("onnxruntime")] == [r for r in cuda if r.startswith("onnxruntime-gpu[")]
    assert not any(r.startswith("torch") for r in cpu + cuda), "torch only when asked for"
    assert "torch==2.13.0" in _requirements("cpu", "--torch").stdout.split()
    # everything else is the project's own runtime dependency list
    assert [r for r in cpu if not r.startswith("onnxruntime")] == [r for r in cuda if not r.startswith("onnxruntime")]


def test_the_variant_check_names_the_wrong_runtime():
    """The check passes for the runtime installed here and fails for the other, naming what it found."""
    installed = {d.metadata["Name"].lower() for d in importlib.metadata.distributions()} & {"onnxruntime",
                                                                                           "onnxruntime-gpu"}
    assert len(installed) == 1, installed
    here, other = ("cpu", "cuda") if installed == {"onnxruntime"} else ("cuda", "cpu")
    assert _requirements("--check", here).returncode == 0
    wrong = _requirements("--check", other)
    assert wrong.returncode == 1
    assert f"installed: {sorted(installed)}" in wrong.stderr
    bad = _requirements("rocm")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


@pytest.mark.parametrize("directory", [DEFAULT, GPU, HA], ids=["default", "gpu", "ha"])
def test_backends_declare_their_framed_execute_port(directory):
    """Frontends reach a backend's framed execute channel on the pod's IP at its fixed --exec-port
    (common/exec_frames.py); the pod declares it beside the gRPC port."""
    backends = [(w, c) for w, c in containers(render(directory)) if c.get("args", [None])[0] == "backend"]
    assert backends
    for workload, c in backends:
        args = c["args"]
        port = int(args[args.index("--exec-port") + 1])
        assert port > 0, workload["metadata"]["name"]
        assert {"name": "exec", "containerPort": port, "protocol": "TCP"} in c["ports"]
