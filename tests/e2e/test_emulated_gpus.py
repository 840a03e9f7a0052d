"""Emulated GPU types: the datasheet profiles of the sample models, the unknown-GPU errors, and a whole
emulated cluster (`nexus serve --backends 3 --device emulated:gtx1080ti`) serving every sample model
and query, looked at with `nexus status` (text, --json and --plot)."""

from __future__ import annotations

import json
import struct

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
from onnx import shape_inference

from common.emulated_gpus import (GPU_TYPES, MODEL_CLASSES, UnknownGpuError, class_profile, datasheet_profile,
                                  gpu_type, model_class_of, table_markdown)
from common.sample_models import SAMPLE_MODELS, build_sample_model, mlp_small, model_bytes
from common.sample_queries import SAMPLE_QUERIES
from tests.conftest import nexus_cli, start_serve

SAMPLE_CLASSES = {"resnet18_64": "resnet18-64", "vehicle_cls": "backbone-cls", "face_cls": "backbone-cls",
                  "detector": "detector", "mlp_small": "mlp"}


def _macs(model: onnx.ModelProto) -> float:
    """Multiply-accumulates per item of the Conv and Gemm nodes."""
    graph = shape_inference.infer_shapes(model).graph
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in [*graph.value_info, *graph.output, *graph.input]}
    weights = {i.name: list(i.dims) for i in graph.initializer}
    total = 0
    for node in graph.node:
        if node.op_type == "Conv":
            w, out = weights[node.input[1]], shapes[node.output[0]]
            total += int(np.prod(w)) * out[2] * out[3]
        elif node.op_type == "Gemm":
            total += int(np.prod(weights[node.input[1]]))
    return float(total)


def test_every_sample_model_has_a_class_whose_macs_match_the_graph():
    assert set(SAMPLE_CLASSES) == set(SAMPLE_MODELS)
    for name, cls in SAMPLE_CLASSES.items():
        model = build_sample_model(name)
        assert model_class_of(model_bytes(model)) == cls, name
        assert _macs(model) == pytest.approx(MODEL_CLASSES[cls].macs, rel=0.02), name


def test_profiles_are_valid_and_newer_gpus_are_faster():
    for cls in MODEL_CLASSES:
        previous = None
        for gpu in GPU_TYPES:
            p = class_profile(cls, gpu)
            assert p.device_type == gpu and p.max_batch == MODEL_CLASSES[cls].max_batch
            assert all(p.latency_ms(b) <= p.latency_ms(b + 1) for b in range(1, p.max_batch))
            assert p.latency_ms(p.max_batch) > p.latency_ms(1)
            if previous is not None:    # the list runs from the oldest GPU to the newest
                assert p.latency_ms(32) <= previous.latency_ms(32), (cls, gpu)
            previous = p
    table = table_markdown()
    assert all(f"`{g}`" in table for g in GPU_TYPES)


def test_a_model_that_is_not_a_sample_gets_no_datasheet_profile():
    other = mlp_small()
    other.producer_name = "someone-else"
    with pytest.raises(ValueError, match="--profile for device type 't4'"):
        datasheet_profile(model_bytes(other), "t4")
    with pytest.raises(ValueError, match="--profile"):
        datasheet_profile(b"not an onnx model", "t4")


def test_unknown_gpu_lists_the_known_ones():
    with pytest.raises(UnknownGpuError, match="unknown emulated GPU 'nosuchgpu'; known: gtx1080ti, t4, v100"):
        gpu_type("nosuchgpu")


@pytest.mark.parametrize("command", ["serve", "backend"])
def test_unknown_emulated_gpu_is_refused_at_start(command, tmp_path):
    extra = ["--data-dir", str(tmp_path)] if command == "serve" else []
    r = nexus_cli(command, "--device", "emulated:nosuchgpu", *extra, timeout_s=60)
    assert r.returncode == 2, r.stderr
    assert "unknown emulated GPU 'nosuchgpu'" in r.stderr
    assert "known: " + ", ".join(GPU_TYPES) in r.stderr
    assert not (tmp_path / "db").exists()       # nothing started


def test_status_without_a_scheduler_is_a_clear_error():
    r = nexus_cli("status", "--scheduler", "127.0.0.1:1", timeout_s=60)
    assert r.returncode == 2
    *pauses, error = r.stderr.strip().splitlines()
    assert error.startswith("nexus status: error: cannot reach the scheduler at 127.0.0.1:1"), r.stderr
    assert [p.split(";")[0] for p in pauses] == ["no scheduler took GetStatus (127.0.0.1:1)"] * 3, r.stderr


# ---- a whole emulated cluster ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def emulated_cluster(tmp_path_factory):
    c = start_serve(tmp_path_factory.mktemp("emulated_gpus"), "--backends", "3", "--device", "emulated:gtx1080ti")
    yield c
    c.stop()


def _infer_every_input(client, name: str, rows: int = 2):
    meta = client.get_model_metadata(name)
    inputs = []
    for i in meta.inputs:
        shape = [rows if d == -1 else int(d) for d in i.shape]
        x = grpcclient.InferInput(i.name, shape, i.datatype)
        x.set_data_from_numpy(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
        inputs.append(x)
    result = client.infer(name, inputs, client_timeout=30)
    return meta, {o.name: result.as_numpy(o.name) for o in meta.outputs}


@pytest.mark.slow
def test_every_sample_model_and_query_answers_on_emulated_gtx1080ti(emulated_cluster):
    client = grpcclient.InferenceServerClient(emulated_cluster.frontend)
    try:
        for name in [*SAMPLE_MODELS, *SAMPLE_QUERIES]:
            assert client.is_model_ready(name), name
            meta, outputs = _infer_every_input(client, name)
            assert set(outputs) == {o.name for o in meta.outputs}, name
            for o in meta.outputs:
                out = outputs[o.name]
                assert out.dtype == np.float32
                # Rows: the request's 2, or for a fanned-out stage the detections (0: the emulated detector
                # scores 0). The other dimensions are the declared ones.
                assert len(out.shape) == len(o.shape), (name, o.name, out.shape)
                assert all(d < 0 or d == n for d, n in zip(o.shape[1:], out.shape[1:])), (name, o.name, out.shape)
            if name in SAMPLE_MODELS:
                assert all(v.shape[0] == 2 for v in outputs.values()), name
    finally:
        client.close()
    listed = json.loads(nexus_cli("models", "list", "--scheduler", emulated_cluster.scheduler, "--json").stdout)
    assert {m["name"]: m["profiles"] for m in listed} == {n: ["gtx1080ti"] for n in SAMPLE_MODELS}


def _sessions() -> set[str]:
    stages = {f"{q}/{s['name']}" for q, d in SAMPLE_QUERIES.items() for s in d["stages"]}
    return set(SAMPLE_MODELS) | stages


@pytest.mark.slow
def test_nexus_status_shows_every_device_and_session(emulated_cluster, tmp_path):
    r = nexus_cli("status", "--scheduler", emulated_cluster.scheduler, "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert len(st["devices"]) == 3
    assert {d["device"] for d in st["devices"]} == {"emulated:gtx1080ti"}
    placed = [s for d in st["devices"] for s in d["sessions"]]
    assert {s["session"] for s in placed} == _sessions()
    assert 1 <= st["lower_bound"] <= st["planned_devices"] <= 3
    assert 1 <= st["lower_bound_throughput_only"] <= st["lower_bound"]
    assert st["devices_in_use"] >= 1 and st["unplaced"] == {}
    for d in st["devices"]:
        if d["sessions"]:
            assert d["duty_cycle_ms"] > 0
            # what the device executes per cycle: a prefix its sessions share runs once, so at most their sum
            assert d["occupancy"] == pytest.approx(d["exec_ms"] / d["duty_cycle_ms"], abs=1e-3)
            assert 0 < d["occupancy"] <= sum(s["share"] for s in d["sessions"]) + 1e-3
            assert d["occupancy"] <= 1.0
        for s in d["sessions"]:
            assert s["batch"] >= 1 and s["latency_ms"] > 0 and s["slo_ms"] > 0
            assert s["planned_rate_rps"] >= 1.0 and s["measured_rate_rps"] >= 0.0
    assert {q["name"] for q in st["queries"]} == set(SAMPLE_QUERIES)
    for q in st["queries"]:
        stages = {s["name"] for s in SAMPLE_QUERIES[q["name"]]["stages"]}
        assert set(q["budgets_ms"]) == stages and q["slo_ms"] == SAMPLE_QUERIES[q["name"]]["slo_ms"]

    plot = tmp_path / "plan.png"
    text = nexus_cli("status", "--scheduler", emulated_cluster.scheduler, "--plot", str(plot))
    assert text.returncode == 0, text.stderr
    for d in st["devices"]:
        assert d["node_id"] in text.stdout
    for session in _sessions():
        assert session in text.stdout
    assert f"lower bound {st['lower_bound']} (throughput alone: {st['lower_bound_throughput_only']})" in text.stdout
    [scaling] = st["scaling"]
    assert scaling["device_type"] == "gtx1080ti" and scaling["registered"] == 3 and scaling["reason"]
    assert f"scaling gtx1080ti: {scaling['desired']} desired · 3 registered" in text.stdout
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 800 and height > 300
    import matplotlib.image

    assert matplotlib.image.imread(str(plot)).shape[:2] == (height, width)


@pytest.mark.slow
def test_routing_table_carries_the_planned_figures(emulated_cluster):
    """The figures frontends get with their routes: batch and duty cycle per backend, planned and
    measured rates per session, devices planned and the lower bound."""
    from common import grpc_util
    from common.pb import control, control_grpc

    with grpc_util.channel(emulated_cluster.scheduler, emulated_cluster.creds) as channel:
        reply = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(), timeout=30)
    table = reply.routing
    assert table.planned_devices >= table.lower_bound >= 1
    assert {r.session or r.model.name for r in table.routes} == _sessions()
    for route in table.routes:
        assert route.planned_rate_rps >= 1.0 and route.measured_rate_rps >= 0.0
        assert route.backends, route
        for b in route.backends:
            assert b.batch >= 1 and b.duty_cycle_ms > 0 and b.weight > 0
    assert reply.frontends == 1 and reply.solver


@pytest.mark.slow
def test_status_plot_to_an_unwritable_path_is_an_error(emulated_cluster, tmp_path):
    r = nexus_cli("status", "--scheduler", emulated_cluster.scheduler, "--plot", str(tmp_path / "no" / "dir.png"))
    assert r.returncode == 2
    assert "cannot write" in r.stderr
