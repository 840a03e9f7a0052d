"""Prefix batching, in process: group assignment at upload, planning groups, the engine and the backend
service running a shared prefix once per merged batch (real ONNX Runtime, no processes)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from backend.engine import Engine

from backend.sessions import Session, SharedPrefix

from backend.work import Work
from common.batch_decision import EarliestFirst, SlidingWindowEarlyDrop
from common.runtimes import load_runtime
from backend.server import BackendService
from backend.wire import backend_stats
from common.config import BackendConfig, BatchStart
from common.onnx_prefix import find_shared_prefix
from common.pb import control
from globalsched.planning.plan import SessionSpec
from common.profile import Profile
from common.sample_models import backbone_variant, mlp_small, model_bytes
from common.exec_status import ExecStatus
from globalsched.planning import prefix_groups as pg
from globalsched.planning.algorithms.prefix import check_prefix_groups, prefix_models
from globalsched.planning.cluster_values import SessionInput
from globalsched.state.modeldb import ModelDatabase
from globalsched.planning.placement import BackendSlot
from globalsched.planning.planner import PlannerSettings, PlannerState, place_sessions

MB = 1024 * 1024


@pytest.fixture(scope="module")
def variants() -> dict[str, bytes]:
    return {f"v{i}": model_bytes(backbone_variant(i)) for i in range(3)}


@pytest.fixture(scope="module")
def mlp() -> bytes:
    return model_bytes(mlp_small())


def whole(data: bytes, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def stem_sharing_pair() -> tuple[bytes, bytes]:
    """Two MLPs sharing only a small first layer (64x64 weights, 16 KB), then different layers."""
    rng = np.random.default_rng(11)
    stem_w = rng.standard_normal((64, 64)).astype(np.float32)
    out = []
    for seed in (1, 2):
        r = np.random.default_rng(seed)
        inits = [numpy_helper.from_array(stem_w, "stem_w"),
                 numpy_helper.from_array(r.standard_normal((64, 512)).astype(np.float32), "w1"),
                 numpy_helper.from_array(r.standard_normal((512, 512)).astype(np.float32), "w2")]
        nodes = [helper.make_node("MatMul", ["input", "stem_w"], ["h0"]),
                 helper.make_node("Relu", ["h0"], ["r0"]),
                 helper.make_node("MatMul", ["r0", "w1"], ["h1"]),
                 helper.make_node("Relu", ["h1"], ["r1"]),
                 helper.make_node("MatMul", ["r1", "w2"], ["y"])]
        graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["b", 64])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 512])], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        out.append(model.SerializeToString())
    return out[0], out[1]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---- group assignment at upload ----------------------------------------------------------------------

def test_assign_prefix_group_groups_variants_and_stores_a_json_signature(variants, mlp):
    group0, sig0 = pg.assign_prefix_group(variants["v0"], {})
    assert group0 == ""                       # alone: nothing to share with yet
    obj = json.loads(sig0)
    assert obj["cuts"] and obj["weight_bytes"] > 4 * MB
    assert pg.signature_ids(sig0) == obj["cuts"]
    existing = {"v0": (_sha(variants["v0"]), "", sig0), "mlp": (_sha(mlp), "", pg.assign_prefix_group(mlp, {})[1])}
    group1, sig1 = pg.assign_prefix_group(variants["v1"], existing)
    assert group1 and group1 in pg.signature_ids(sig0) and group1 in pg.signature_ids(sig1)
    assert pg.joining_members(group1, existing) == ["v0"]
    # The group is the deepest shared cut: the whole backbone, up to the pooled features.
    split = find_shared_prefix({"v0": variants["v0"], "v1": variants["v1"]})
    assert group1 == split.prefix_id
    existing = {"v0": (_sha(variants["v0"]), group1, sig0), "v1": (_sha(variants["v1"]), group1, sig1)}
    group2, _ = pg.assign_prefix_group(variants["v2"], existing)
    assert group2 == group1
    assert pg.assign_prefix_group(mlp, existing)[0] == ""


def test_a_trivial_shared_stem_does_not_group_models():
    a, b = stem_sharing_pair()
    assert find_shared_prefix({"a": a, "b": b}) is not None     # they do share a (tiny) prefix
    _, sig_a = pg.assign_prefix_group(a, {})
    group, _ = pg.assign_prefix_group(b, {"a": (_sha(a), "", sig_a)})
    assert group == ""
    assert pg.assign_prefix_group(b"not a model", {}) == ("", "")


def test_model_database_puts_separately_uploaded_variants_in_one_group(tmp_path, variants, mlp):
    db = ModelDatabase(tmp_path / "db")
    try:
        db.add_model("v0", [variants["v0"]], prefix_fn=pg.assign_prefix_group)
        db.add_model("mlp", [mlp], prefix_fn=pg.assign_prefix_group)
        assert db.model("v0").prefix_group == ""
        db.add_model("v1", [variants["v1"]], prefix_fn=pg.assign_prefix_group)
        group = db.model("v1").prefix_group
        assert group and db.model("v0").prefix_group == group       # the stored one was moved in
        db.add_model("v2", [variants["v2"]], prefix_fn=pg.assign_prefix_group)
        assert {m.name: m.prefix_group for m in db.models()} == {"mlp": "", "v0": group, "v1": group, "v2": group}
        assert group in pg.signature_ids(db.prefix_signature("v2"))
        assert 0.95 < db.prefix_share("v0") < 1 and db.prefix_share("mlp") is None
    finally:
        db.close()
    reopened = ModelDatabase(tmp_path / "db")     # durable
    try:
        assert reopened.model("v0").prefix_group == group
    finally:
        reopened.close()


# ---- planning --------------------------------------------------------------------------------------

def _profile(alpha: float, beta: float, max_batch: int = 32, mem: float = 500.0) -> Profile:
    return Profile.linear(alpha, beta, max_batch, memory_base_mb=mem, memory_per_item_mb=2.0, device_type="gpu")


def test_derived_prefix_profile_keeps_the_planner_contract():
    members = [_profile(1.0, 8.0), _profile(1.2, 7.0, max_batch=16), _profile(0.9, 9.0, mem=700)]
    specs = [SessionSpec(f"m{i}", f"m{i}", 200.0, 100.0, p, "g") for i, p in enumerate(members)]
    specs.append(SessionSpec("alone", "alone", 200.0, 100.0, members[0], "solo-group"))
    out, groups = pg.planning_groups(specs)
    assert [g.name for g in groups] == ["g"]
    assert out[-1].prefix_group is None               # a group of one shares nothing
    prefix = groups[0].profile
    assert prefix.max_batch >= 16 + 32 + 32 - 1
    for p in members:
        for b in range(1, p.max_batch + 1):
            assert prefix.latency_ms(b) <= p.latency_ms(b) and prefix.memory_mb(b) <= p.memory_mb(b)
    # The planner's own check accepts it.
    from globalsched.planning.algorithms.batch_sizing import prepare
    from globalsched.planning.algorithms.config import PlannerConfig
    models = [prepare(s, None, PlannerConfig()) for s in out[:3]]
    check_prefix_groups({"g": models}, prefix_models(groups))


def test_cluster_plan_places_a_prefix_group_together_and_needs_fewer_devices():
    # Whole models l(b) = 20 + 0.5*b ms: alone, each batch pays the 20 ms that the shared prefix
    # pays once for a merged batch, so three models fill a GPU's cycle without sharing, six with it.
    profile = Profile.linear(0.5, 20.0, 64, memory_base_mb=1000, memory_per_item_mb=5, device_type="gpu")
    slots = [BackendSlot(f"be-{i}", "gpu", 16000) for i in range(8)]

    def plan(group: str, n: int = 6, rate: float = 40.0):
        sessions = [SessionInput(f"m{i}", 100.0, rate, {"gpu": profile}, group) for i in range(n)]
        # no spare replicas: the idle backends would hold copies of members (tests/unit/test_plan_device_type.py)
        return place_sessions(sessions, slots, PlannerState(), 0.0, settings=PlannerSettings(spare_replicas=False))[0]

    grouped, plain = plan("g"), plan("")
    homes = {n for m in (f"m{i}" for i in range(6)) for n, _ in grouped.backends_of(m)}
    assert len(homes) == 1, homes                      # every member on one backend
    # The device's execution counts the shared prefix once: within its duty cycle, where the members'
    # whole-model latencies add up to more (issue 20: `nexus status` showed such devices over 100%).
    [home] = [b for b in grouped.placements["gpu"].backends if b.sessions]
    whole = sum(profile.latency_ms(s.batch) for s in home.sessions)
    assert home.exec_ms <= home.duty_cycle_ms + 1e-6 < whole
    assert grouped.num_devices_planned == 1 < plain.num_devices_planned == 2
    # Knowing the groups never costs devices (the plan without them is kept when it is better).
    for n, rate in ((3, 10.0), (6, 10.0), (10, 40.0), (10, 150.0)):
        assert plan("g", n, rate).num_devices_planned <= plan("", n, rate).num_devices_planned


def test_prefix_share_comes_from_the_stored_signature(variants):
    _, sig = pg.assign_prefix_group(variants["v0"], {})
    split = find_shared_prefix({"v0": variants["v0"], "v1": variants["v1"]})
    share = pg.prefix_share(sig, split.prefix_id)
    assert share == pytest.approx(split.prefix_weight_bytes / (split.prefix_weight_bytes
                                                                 + split.suffix_weight_bytes["v0"]))
    assert 0.95 < share < 1.0
    assert pg.prefix_share(sig, "no-such-prefix") is None and pg.prefix_share("", "x") is None
    assert pg.group_share(["a", "b"], {"a": share, "b": 0.99}) == pg.MAX_SHARE
    assert pg.group_share(["a", "b"], {"a": 0.1}) == pg.MIN_SHARE
    assert pg.group_share(["a"], None) == pg.DEFAULT_SHARE


# ---- the engine ------------------------------------------------------------------------------------

def _shared(variants: dict[str, bytes], names, slo_ms=5000.0, planned=1):
    split = find_shared_prefix({n: variants[n] for n in names})
    prefix = load_runtime("onnxruntime", split.prefix, "cpu")
    sessions = {}
    for n in names:
        full = load_runtime("onnxruntime", variants[n], "cpu")
        suffix = load_runtime("onnxruntime", split.suffixes[n], "cpu")
        sessions[n] = Session(n, suffix, slo_ms, planned, None, inputs=full.inputs, outputs=full.outputs)
        full.close()
    group = SharedPrefix("g", prefix, split.cut_tensor, list(sessions.values()), split.prefix_id)
    return sessions, group, split


def _submit_all(engine: Engine, requests) -> dict[int, object]:
    """Queue every request while the executor waits, so they are batched together; wait for all."""
    results: dict[int, object] = {}
    done = threading.Event()

    def cb(i):
        def f(outcome):
            results[i] = outcome
            if len(results) == len(requests):
                done.set()
        return f

    with engine.paused():                       # the executor cannot pick anything until all are queued
        now = engine.clock()
        for i, (model, x) in enumerate(requests):
            engine.submit(Work(model, [x], x.shape[0], now + 60.0, now, cb(i)))
    assert done.wait(120)
    return results


def test_engine_runs_the_prefix_once_on_the_merged_batch_and_matches_whole_models(variants):
    names = ["v0", "v1", "v2"]
    sessions, group, split = _shared(variants, names)
    plain = Session("mlp", load_runtime("onnxruntime", model_bytes(mlp_small()), "cpu"), 5000.0, 1, None)
    engine = Engine(EarliestFirst())
    try:
        engine.set_sessions({**sessions, "mlp": plain}, [group])
        rng = np.random.default_rng(5)
        requests = []
        for k in range(4):
            for n in names:
                requests.append((n, rng.standard_normal((1 + k % 2, 3, 64, 64)).astype(np.float32)))
        requests.append(("mlp", rng.standard_normal((2, 64)).astype(np.float32)))
        results = _submit_all(engine, requests)
    finally:
        engine.stop()
    for i, (model, x) in enumerate(requests):
        outcome = results[i]
        assert outcome.status == ExecStatus.OK, outcome.message
        data = variants[model] if model != "mlp" else model_bytes(mlp_small())
        np.testing.assert_allclose(outcome.outputs[0], whole(data, x), rtol=1e-5, atol=1e-6)
    rows = sum(x.shape[0] for m, x in requests if m != "mlp")
    assert group.stats.inference_count == rows == 18
    assert group.stats.execution_count == 1              # one merged batch through the prefix
    assert group.stats.batch_histogram == {18: 1}
    for n in names:
        st = sessions[n].stats
        assert st.inference_count == 6 and st.execution_count == 1 and st.batch_histogram == {18: 1}
    assert plain.stats.batch_histogram == {2: 1}
    # One reply per model and batch is marked first: frontends count each model's executions by it.
    firsts = [model for i, (model, _) in enumerate(requests) if results[i].first_in_batch]
    assert sorted(firsts) == sorted([*names, "mlp"])


def test_prefix_memory_is_counted_once(variants):
    names = ["v0", "v1", "v2"]
    sessions, group, split = _shared(variants, names)
    engine = Engine(EarliestFirst())
    try:
        engine.set_sessions(sessions, [group])
        stats = backend_stats(engine)
    finally:
        engine.stop()
    by_model = {s.model: s for s in stats.sessions}
    first = min(names)
    prefix_bytes = group.memory_mb * MB
    assert abs(by_model[first].memory_bytes - (sessions[first].runtime.memory_mb() * MB + prefix_bytes)) <= 2
    for n in names:
        assert by_model[n].prefix_group == "g"
        assert by_model[n].shared_memory_bytes == int(prefix_bytes)
        if n != first:
            assert by_model[n].memory_bytes < prefix_bytes / 10     # only the suffix
    total = sum(s.memory_bytes for s in stats.sessions)
    assert stats.memory_bytes == total
    one_whole = len(variants["v0"])
    heads = sum(split.suffix_weight_bytes.values())
    assert total <= 1.2 * one_whole + heads
    assert total < sum(len(variants[n]) for n in names) / 2
    (gs,) = stats.prefix_groups
    assert gs.group == "g" and list(gs.sessions) == names and gs.memory_bytes == int(prefix_bytes)


def test_group_early_drop_and_max_batch_follow_the_profiles(variants):
    profile = Profile.linear(2.0, 10.0, 16, device_type="cpu")       # 2*l(b) <= 60 ms: b <= 10
    sessions, group, _ = _shared(variants, ["v0", "v1"])
    tight = {n: Session(n, s.runtime, 60.0, 2, profile, inputs=s.inputs, outputs=s.outputs)
             for n, s in sessions.items()}
    group = SharedPrefix("g", group.runtime, group.cut_tensor, list(tight.values()))
    assert group.max_batch == 10 and group.slo_ms == 60.0
    assert group.latency_ms(4) == profile.latency_ms(4)
    engine = Engine(SlidingWindowEarlyDrop())
    try:
        engine.set_sessions(tight, [group])
        x = np.zeros((1, 3, 64, 64), np.float32)
        outcomes = []
        with engine.paused():
            now = engine.clock()
            engine.submit(Work("v0", [x], 1, now + 0.001, now, outcomes.append))   # cannot make it
            for i in range(12):
                engine.submit(Work(f"v{i % 2}", [x], 1, now + 30.0, now, outcomes.append))
        deadline = engine.clock() + 60
        while len(outcomes) < 13 and engine.clock() < deadline:
            threading.Event().wait(0.01)
    finally:
        engine.stop()
    assert sorted(o.status for o in outcomes).count(ExecStatus.DEADLINE) == 1
    assert tight["v0"].stats.dropped == 1
    assert max(group.stats.batch_histogram) <= 10
    assert group.stats.inference_count == 12


# ---- the backend service ------------------------------------------------------------------------------

def _desc(name: str, data: bytes, group: str = "") -> control.ModelDesc:
    from common.model_io import onnx_io
    inputs, outputs = onnx_io(data)
    return control.ModelDesc(
        name=name, sha256=_sha(data), runtime="onnxruntime", prefix_group=group,
        inputs=[control.TensorDesc(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in inputs],
        outputs=[control.TensorDesc(name=t.name, datatype=t.datatype, shape=list(t.shape)) for t in outputs])


class _Service(BackendService):
    def __init__(self, blobs: dict[str, bytes], **config) -> None:
        super().__init__(BackendConfig(**config), Engine(EarliestFirst()))
        self.blobs = blobs
        self.fetches = 0

    async def _fetch(self, sha256: str) -> bytes:
        self.fetches += 1
        return self.blobs[sha256]


def _table(epoch: int, models: dict[str, tuple[bytes, str]]) -> control.ModelTable:
    return control.ModelTable(epoch=epoch, sessions=[
        control.SessionEntry(model=_desc(n, d, g), slo_ms=5000.0, batch=2) for n, (d, g) in models.items()])


def _exec(service, model: str, x: np.ndarray, request_id: int = 1) -> control.ExecResult:
    item = control.ExecItem(request_id=request_id, model=model, budget_us=60_000_000, inputs=[x.tobytes()],
                            rows=x.shape[0])
    return asyncio.run(service.ExecuteOne(item, None))


def _out(result: control.ExecResult) -> np.ndarray:
    assert result.status == control.EXEC_OK, result.message
    return np.frombuffer(result.outputs[0], np.float32).reshape(tuple(result.output_shapes[0].shape))


def test_backend_service_builds_groups_from_its_table_and_falls_back_to_whole_models(variants, mlp):
    blobs = {_sha(d): d for d in [*variants.values(), mlp]}
    service = _Service(blobs)
    g = "group-1"
    x = np.random.default_rng(9).standard_normal((2, 3, 64, 64)).astype(np.float32)
    try:
        reply = asyncio.run(service.UpdateModelTable(
            _table(1, {"v0": (variants["v0"], g), "v1": (variants["v1"], g), "v2": (variants["v2"], g),
                       "mlp": (mlp, "")}), None))
        assert sorted(reply.loaded) == ["mlp", "v0", "v1", "v2"] and not reply.failed
        (group,) = service.engine.groups
        assert group.name == g and [m.name for m in group.members] == ["v0", "v1", "v2"]
        for n in ("v0", "v1", "v2"):
            np.testing.assert_allclose(_out(_exec(service, n, x)), whole(variants[n], x), rtol=1e-5, atol=1e-6)
        stats = service.stats()
        assert {s.model: s.prefix_group for s in stats.sessions} == {"mlp": "", "v0": g, "v1": g, "v2": g}
        assert stats.prefix_groups[0].inference_count == 6
        fetches = service.fetches
        # The same table again: nothing is fetched or split again.
        asyncio.run(service.UpdateModelTable(
            _table(2, {"v0": (variants["v0"], g), "v1": (variants["v1"], g), "v2": (variants["v2"], g),
                       "mlp": (mlp, "")}), None))
        assert service.fetches == fetches
        assert service.engine.groups[0].stats.inference_count == 6       # counters carry over
        # One member left: the group dissolves and v0 runs whole.
        asyncio.run(service.UpdateModelTable(_table(3, {"v0": (variants["v0"], g)}), None))
        assert service.engine.groups == [] and service.tables.prefixes == {}
        np.testing.assert_allclose(_out(_exec(service, "v0", x)), whole(variants["v0"], x), rtol=1e-5, atol=1e-6)
        # Models that share nothing but claim a group also run whole.
        reply = asyncio.run(service.UpdateModelTable(_table(4, {"v0": (variants["v0"], "x"), "mlp": (mlp, "x")}),
                                                     None))
        assert sorted(reply.loaded) == ["mlp", "v0"] and service.engine.groups == []
        np.testing.assert_allclose(_out(_exec(service, "v0", x)), whole(variants["v0"], x), rtol=1e-5, atol=1e-6)
    finally:
        service.engine.stop()


def test_backend_splits_each_member_once_at_the_group_prefix(variants):
    """With the scheduler's group id (a prefix id that is a cut of every member) each model is split
    on its own: a member joining later costs one download and one split."""
    group = find_shared_prefix(variants).prefix_id
    blobs = {_sha(d): d for d in variants.values()}
    service = _Service(blobs)
    x = np.random.default_rng(1).standard_normal((1, 3, 64, 64)).astype(np.float32)
    try:
        asyncio.run(service.UpdateModelTable(
            _table(1, {"v0": (variants["v0"], group), "v1": (variants["v1"], group)}), None))
        assert service.fetches == 2
        prefix = service.engine.groups[0].runtime
        asyncio.run(service.UpdateModelTable(
            _table(2, {"v0": (variants["v0"], group), "v1": (variants["v1"], group),
                       "v2": (variants["v2"], group)}), None))
        assert service.fetches == 3                                  # only v2 was fetched and split
        (shared,) = service.engine.groups
        assert shared.runtime is prefix and shared.prefix_id == group and len(shared.members) == 3
        for n in variants:
            np.testing.assert_allclose(_out(_exec(service, n, x)), whole(variants[n], x), rtol=1e-5, atol=1e-6)
    finally:
        service.engine.stop()


def test_prefix_batching_can_be_turned_off(variants):
    blobs = {_sha(d): d for d in variants.values()}
    service = _Service(blobs, prefix_batching=False)
    try:
        asyncio.run(service.UpdateModelTable(
            _table(1, {"v0": (variants["v0"], "g"), "v1": (variants["v1"], "g")}), None))
        assert service.engine.groups == []
        assert all(s.group is None for s in service.engine.sessions.values())
    finally:
        service.engine.stop()


@pytest.mark.parametrize("mode, waits_s", [(BatchStart.EAGER, 0.0), (BatchStart.DUTY_CYCLE, 0.08)])
def test_batch_start_decides_whether_the_engine_waits_for_the_duty_cycle(mlp, mode, waits_s):
    service = _Service({_sha(mlp): mlp}, batch_start=mode)
    try:
        table = _table(1, {"mlp": (mlp, "")})
        table.duty_cycle_ms = 80.0
        reply = asyncio.run(service.UpdateModelTable(table, None))
        assert reply.loaded == ["mlp"]
        assert service.engine.duty_cycle_s == pytest.approx(waits_s)
    finally:
        service.engine.stop()


def test_unknown_batch_start_is_refused():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "nexus", "backend", "--batch-start", "later"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--batch-start: invalid choice: 'later'" in done.stderr, done.stderr
