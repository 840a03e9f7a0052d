"""Warm-up: ``model_warmup`` in config.pbtxt is read, checked and carried to the backends; a backend
runs a session's warm-up batches before it answers the table push that placed it (so frontends are
routed to it only once it is warm), without stalling the sessions it already serves, and never
counts them as serving."""

from __future__ import annotations

import json
import pathlib
import time
import urllib.request

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from backend.engine import Engine, WarmupBatch

from backend.sessions import Session

from backend.work import Work
from backend.warmup_runner import Warmer
from common.batch_decision import SlidingWindowEarlyDrop
from nexus.model_repository import RepositoryError, read_model
from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.runtimes.base import RuntimeKind
from common.tensors import TensorSpec
from common.exec_status import ExecStatus
from common.warmup_spec import (
    WarmupData, WarmupError, WarmupInput, WarmupSample, check_samples, default_samples, feeds, from_json, from_pb,
    to_json, to_pb,
)
from harness.background_load import BackgroundLoad
from nexus.scheduler_client import AdminCallError, upload_model
from tests.components import start_cluster, wait_ready
from tests.conftest import NexusProcess, nexus_cli
from harness.ports import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING

MLP_CONFIG = """
max_batch_size: 16
model_warmup [
  {
    name: "ones"
    batch_size: 4
    inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 64 ] input_data_file: "ones.bin" } }
    count: 3
  },
  {
    name: "zeros"
    batch_size: 1
    inputs { key: "input" value: { data_type: TYPE_FP32 dims: [ 64 ] zero_data: true } }
  }
]
"""


def _mlp_repo(root: pathlib.Path, config: str, files: dict[str, bytes] | None = None) -> pathlib.Path:
    d = root / "mlp"
    (d / "1").mkdir(parents=True, exist_ok=True)
    (d / "1" / "model.onnx").write_bytes(model_bytes(mlp_small()))
    (d / "config.pbtxt").write_text(config)
    for name, data in (files or {}).items():
        (d / "warmup").mkdir(exist_ok=True)
        (d / "warmup" / name).write_bytes(data)
    return d


def _refused(model_dir: pathlib.Path) -> str:
    with pytest.raises(RepositoryError) as info:
        read_model(model_dir)
    return str(info.value)


ONES = np.ones(64, np.float32).tobytes()


def test_model_warmup_is_read_from_config_pbtxt(tmp_path):
    m = read_model(_mlp_repo(tmp_path, MLP_CONFIG, {"ones.bin": ONES}))
    assert m.warnings == ()
    ones, zeros = m.warmup
    assert (ones.name, ones.batch_size, ones.runs, zeros.name, zeros.batch_size, zeros.runs) == ("ones", 4, 3,
                                                                                                  "zeros", 1, 1)
    assert ones.inputs == (WarmupInput("input", "FP32", (64,), WarmupData.FILE, ONES, "ones.bin"),)
    assert zeros.inputs[0].data is WarmupData.ZERO
    batch = feeds(ones, np.random.default_rng(0))["input"]
    assert batch.shape == (4, 64) and batch.dtype == np.float32 and (batch == 1).all()
    assert (feeds(zeros, np.random.default_rng(0))["input"] == 0).all()
    # Through the wire and the model database unchanged; a message without data is refused naming the input.
    assert from_pb(to_pb(m.warmup)) == m.warmup
    assert from_json(to_json(m.warmup)) == m.warmup
    message = to_pb(m.warmup)[1]
    message.inputs[0].ClearField("data")
    with pytest.raises(WarmupError, match=r'model_warmup\[0\].inputs\["input"\]: one of zero_data, random_data or '
                                          r"input_data_file is required"):
        from_pb([message])


@pytest.mark.parametrize("replace, error", [
    (("batch_size: 4", "batch_size: 0"), "model_warmup[0] ('ones').batch_size must be >= 1, got 0"),
    (("batch_size: 4", "batch_size: 32"), "model_warmup[0] ('ones').batch_size 32 exceeds max_batch_size 16"),
    (("count: 3", "count: 5000"), "model_warmup[0] ('ones').count 5000 exceeds 1000"),
    (("dims: [ 64 ] zero_data", "dims: [ 32 ] zero_data"),
     'model_warmup[1] (\'zeros\').inputs["input"].dims [32] do not fit the model\'s [64]'),
    (("TYPE_FP32 dims: [ 64 ] zero", "TYPE_FP16 dims: [ 64 ] zero"),
     'model_warmup[1] (\'zeros\').inputs["input"].data_type TYPE_FP16 contradicts the model\'s TYPE_FP32'),
    (('key: "input" value: { data_type: TYPE_FP32 dims: [ 64 ] zero', 'key: "x" value: { data_type: TYPE_FP32 '
                                                                       'dims: [ 64 ] zero'),
     'model_warmup[1] (\'zeros\').inputs: no entry for the model\'s input(s) \'input\''),
    ((" zero_data: true", ""),
     'model_warmup[1] (\'zeros\').inputs["input"]: one of zero_data, random_data or input_data_file is required'),
    (("data_type: TYPE_FP32 dims: [ 64 ] zero", "dims: [ 64 ] zero"),
     'model_warmup[1] (\'zeros\').inputs["input"].data_type is required'),
    (('"ones.bin"', '"../1/model.onnx"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'../1/model.onnx\' is not a file in'),
    (('"ones.bin"', '"/etc/passwd"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'/etc/passwd\' is not a file in'),
    (('"ones.bin"', '"missing.bin"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'missing.bin\': cannot read'),
    (('"ones.bin"', '"short.bin"'),
     'model_warmup[0] (\'ones\').inputs["input"].input_data_file \'short.bin\' holds 12 bytes; one row of dims '
     '[64] FP32 takes 256'),
    (("count: 3", "count: 3 colour: 2"), "8:14: unsupported setting 'colour': not a ModelWarmup setting"),
])
def test_a_bad_model_warmup_is_refused_naming_the_field(tmp_path, replace, error):
    d = _mlp_repo(tmp_path, MLP_CONFIG.replace(*replace), {"ones.bin": ONES, "short.bin": b"x" * 12})
    message = _refused(d)
    assert message.startswith(str(d / "config.pbtxt") + ":"), message
    assert error in message, message


def test_a_data_file_reached_through_a_symlink_out_of_the_model_is_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(ONES)
    d = _mlp_repo(tmp_path / "repo", MLP_CONFIG, {"placeholder": b""})
    (d / "warmup" / "ones.bin").symlink_to(outside)
    assert "input_data_file 'ones.bin' is not a file in" in _refused(d)


def test_samples_are_checked_against_the_model_inputs():
    inputs = (TensorSpec("image", "FP32", (3, -1, -1)), TensorSpec("ids", "INT64", (4,)))
    image = WarmupInput("image", "FP32", (3, 8, 8), WarmupData.RANDOM)
    ids = WarmupInput("ids", "INT64", (4,), WarmupData.RANDOM)
    check_samples([WarmupSample("ok", 2, (image, ids))], inputs)
    with pytest.raises(WarmupError, match=r'inputs\["image"\].dims \[3, 8, -1\] do not fit'):
        check_samples([WarmupSample("", 2, (WarmupInput("image", "FP32", (3, 8, -1), WarmupData.ZERO), ids))], inputs)
    with pytest.raises(WarmupError, match=r'model_warmup\[0\].inputs\["ids"\] is given twice'):
        check_samples([WarmupSample("", 1, (image, ids, ids))], inputs)
    with pytest.raises(WarmupError, match=r"inputs\[\"extra\"\]: the model has no input of that name"):
        check_samples([WarmupSample("", 1, (image, ids, WarmupInput("extra", "FP32", (1,), WarmupData.ZERO)))], inputs)
    batch = feeds(WarmupSample("ok", 2, (image, ids)), np.random.default_rng(1))
    assert batch["image"].shape == (2, 3, 8, 8) and 0 <= batch["image"].min() and batch["image"].max() < 1
    assert batch["ids"].dtype == np.int64 and set(np.unique(batch["ids"])) <= {0, 1}


def test_the_default_warm_up_runs_batch_1_and_the_planned_batch_as_often_as_the_runtime_needs():
    inputs = (TensorSpec("x", "FP32", (4, -1)),)
    samples = default_samples(inputs, 6, RuntimeKind.TORCH)           # TorchScript optimises on its 2nd call
    assert [(s.batch_size, s.runs) for s in samples] == [(1, 2), (6, 2)]
    check_samples(samples, inputs)
    assert feeds(samples[1], np.random.default_rng(0))["x"].shape == (6, 4, 1)
    assert [s.batch_size for s in default_samples(inputs, 1, RuntimeKind.TORCH)] == [1]
    for kind in (RuntimeKind.ONNXRUNTIME, RuntimeKind.EMULATED):      # warm after one run at a shape
        assert [(s.batch_size, s.runs) for s in default_samples(inputs, 6, kind)] == [(1, 1), (6, 1)]



def test_the_model_database_keeps_warm_up_samples_and_refuses_bad_ones(tmp_path):
    from globalsched.rpc.convert import model_desc, model_route
    from globalsched.state.modeldb import ModelDatabase, ServingSettings, UploadError

    db = ModelDatabase(tmp_path)
    data = model_bytes(mlp_small())
    samples = (WarmupSample("ones", 2, (WarmupInput("input", "FP32", (64,), WarmupData.FILE, ONES, "ones.bin"),), 3),)
    db.add_model("mlp", [data], warmup=samples)
    assert db.model("mlp").warmup == samples and [m.warmup for m in db.models()] == [samples]
    desc = model_desc(db.model("mlp"), {}, True)
    assert from_pb(desc.warmup) == samples
    assert not model_route(desc, 50.0, "mlp").model.warmup        # frontends never get the samples
    bad = (WarmupSample("", 1, (WarmupInput("input", "FP32", (32,), WarmupData.ZERO),)),)
    with pytest.raises(UploadError, match=r"warm-up: model_warmup\[0\].inputs\[\"input\"\].dims \[32\] do not fit"):
        db.add_model("other", [data], warmup=bad)
    assert db.model("other") is None
    with pytest.raises(UploadError, match=r"model_warmup\[0\] \('ones'\).batch_size 2 exceeds max_batch_size 1"):
        db.add_model("capped", [data], warmup=samples, serving=ServingSettings(batch_cap=1))
    db.add_model("mlp", [data])                                   # a new version has its own samples
    assert db.model("mlp:2").warmup == () and db.model("mlp").warmup == samples
    db.add_model("mlp", [data], version=1)                        # a new upload of a version replaces them
    assert db.model("mlp").warmup == ()
    db.close()

# ---- the engine: warm-up between serving batches, never counted as serving ---------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class TimedRuntime:
    """A model whose batch takes ``batch_s`` on the fake clock (identity on one FP32 input)."""

    kind = RuntimeKind.TORCH
    inputs = (TensorSpec("input", "FP32", (4,)),)
    outputs = (TensorSpec("output", "FP32", (4,)),)

    def __init__(self, clock: FakeClock, batch_s: float) -> None:
        self.clock, self.batch_s, self.rows = clock, batch_s, []

    def run(self, feeds):
        self.clock.t += self.batch_s
        self.rows.append(len(feeds["input"]))
        return {"output": feeds["input"]}

    def memory_mb(self) -> float:
        return 0.0


def _serving_engine(batch_s: float = 0.01):
    clock = FakeClock()
    engine = Engine(SlidingWindowEarlyDrop(), clock, start=False)
    runtime = TimedRuntime(clock, batch_s)
    engine.set_sessions({"a": Session("a", runtime, 1000.0, 1, None)})
    return engine, clock


def _request(engine, clock, outcomes: list) -> None:
    engine.submit(Work("a", [np.ones((1, 4), np.float32)], 1, clock() + 10.0, clock(), outcomes.append))


def _timed_batches(clock: FakeClock, n: int, seconds: float, log: list) -> list[WarmupBatch]:
    def run(i: int) -> None:
        clock.t += seconds
        log.append(i)
    return [WarmupBatch(f"batch {i}", lambda i=i: run(i)) for i in range(n)]


def test_warm_up_runs_between_serving_batches_and_takes_at_most_half_a_busy_device():
    engine, clock = _serving_engine(batch_s=0.01)
    outcomes, warm_log = [], []
    future = engine.warm_up(_timed_batches(clock, 4, 0.03, warm_log), budget_s=60)
    serving_turns, warm_time = 0, 0.0
    start = clock()
    while not future.done():
        _request(engine, clock, outcomes)       # saturated: a request always waits
        before = clock()
        decision, warmed = engine.turn()
        assert decision.queue is not None       # the serving batch ran on every turn: never stalled
        serving_turns += 1
        warm_time += 0.03 if warmed else 0.0
        assert clock() - before == pytest.approx(0.01 + (0.03 if warmed else 0.0))
        assert serving_turns < 100
    assert warm_log == [0, 1, 2, 3]
    assert warm_time <= 0.5 * (clock() - start) + 0.03      # at most half the device, give or take one batch
    result = future.result()
    assert (result.batches, result.error, result.skipped) == (4, "", 0)
    assert result.ns == pytest.approx(4 * 0.03e9, rel=1e-6)
    # Only the serving batches count: in the session's statistics and in the device's utilisation.
    stats = engine.sessions["a"].stats
    assert stats.execution_count == stats.success_count == serving_turns == len(outcomes)
    assert all(o.status == ExecStatus.OK for o in outcomes)
    assert stats.warmup_count == 0
    assert engine._busy.total_s == pytest.approx(serving_turns * 0.01)


def test_an_idle_device_runs_warm_up_at_once():
    engine, clock = _serving_engine()
    log = []
    future = engine.warm_up(_timed_batches(clock, 2, 0.05, log), budget_s=60)
    assert engine.warming == 1
    for _ in range(2):
        decision, warmed = engine.turn()
        assert decision.queue is None and warmed
    assert future.result().batches == 2 and engine.warming == 0


def test_a_deferred_warm_up_waits_for_an_idle_device_and_for_the_jobs_that_hold_an_answer():
    engine, clock = _serving_engine(batch_s=0.01)
    outcomes, log = [], []
    later = engine.warm_up(_timed_batches(clock, 2, 0.03, log), budget_s=60, deferred=True)
    for _ in range(5):                          # saturated: a deferred batch never takes a serving turn
        _request(engine, clock, outcomes)
        decision, warmed = engine.turn()
        assert decision.queue is not None and not warmed
    assert log == [] and not later.done()
    now = engine.warm_up([WarmupBatch("now", lambda: log.append("now"))], budget_s=60)
    _request(engine, clock, outcomes)
    decision, warmed = engine.turn()            # a job that holds an answer goes first, in a serving turn
    assert decision.queue is not None and warmed and log == ["now"] and now.done()
    _request(engine, clock, outcomes)
    assert engine.turn()[1] is False            # the deferred one still waits while requests do
    for _ in range(2):
        decision, warmed = engine.turn()        # idle now: it runs
        assert decision.queue is None and warmed
    assert log == ["now", 0, 1] and later.result().batches == 2 and engine.warming == 0
    assert len(outcomes) == 7 and all(o.status == ExecStatus.OK for o in outcomes)


def test_a_failing_warm_up_batch_stops_its_job_and_says_which():
    engine, clock = _serving_engine()

    def boom():
        raise ValueError("bad shape")
    log = []
    future = engine.warm_up([*_timed_batches(clock, 1, 0.01, log), WarmupBatch("sample 'x' (batch 4)", boom),
                             *_timed_batches(clock, 1, 0.01, log)], budget_s=60)
    while not future.done():
        engine.turn()
    result = future.result()
    assert result.error == "sample 'x' (batch 4): ValueError: bad shape" and result.batches == 2 and log == [0]


def test_warm_up_past_its_budget_is_skipped_and_a_stopping_engine_answers_every_job():
    engine, clock = _serving_engine()
    log = []
    future = engine.warm_up(_timed_batches(clock, 5, 1.0, log), budget_s=2.5)
    while not future.done():
        engine.turn()
    assert (future.result().batches, future.result().skipped) == (3, 2)
    pending = engine.warm_up(_timed_batches(clock, 2, 0.01, log), budget_s=60)
    engine.stop()
    assert pending.result().skipped == 2


def _labels(plan) -> list[str]:
    return [b.label for b in plan.batches]


def test_the_warmer_holds_the_answer_for_the_planned_batch_and_defers_the_rest():
    clock = FakeClock()
    runtime = TimedRuntime(clock, 0.0)               # TorchScript: two runs at each size
    warmer = Warmer()
    session = Session("a", runtime, 1000.0, 4, None)
    now, later = warmer.plan(session, ())
    assert (now.deferred, later.deferred) == (False, True)
    assert _labels(now) == ["a: warm-up sample 'default batch 4' (batch 4)"] * 2
    assert _labels(later) == ["a: warm-up sample 'default batch 1' (batch 1)"] * 2
    for b in (*now.batches, *later.batches):
        b.run()
    assert runtime.rows == [4, 4, 1, 1]
    warmer.done(now)
    warmer.started(later)
    assert warmer.plan(session, ()) == ()                                     # batch 1 is under way
    warmer.done(later, ok=False)                                              # ... and was skipped: again
    assert [(p.deferred, p.sizes) for p in warmer.plan(session, ())] == [(True, frozenset({1}))]
    warmer.started(later)
    warmer.done(later)
    assert warmer.plan(session, ()) == ()                                     # the same runtime, already warm
    # A new planned batch of a runtime that serves here already: deferred, its requests ran many sizes.
    [bigger] = warmer.plan(Session("a", runtime, 1000.0, 8, None), (), serving=True)
    assert bigger.deferred and _labels(bigger) == ["a: warm-up sample 'default batch 8' (batch 8)"] * 2
    [fresh] = warmer.plan(Session("a", runtime, 1000.0, 8, None), ())
    assert not fresh.deferred and fresh.sizes == frozenset({8})
    own = (WarmupSample("one", 3, (WarmupInput("input", "FP32", (4,), WarmupData.ZERO),), count=2),)
    [configured] = warmer.plan(session, own, serving=True)                   # the model's own: always first
    assert configured.configured and not configured.deferred and len(configured.batches) == 2
    warmer.done(configured)
    assert warmer.plan(session, own) == ()
    warmer.forget(runtime)
    assert warmer.plan(session, own) != ()                                    # a closed runtime is forgotten
    runtime.closed = True
    warmer.done(fresh)                                                        # ended after its runtime closed
    assert warmer.plan(session, own) != () and len(warmer.plan(session, ())) == 2


# ---- real processes ----------------------------------------------------------------------------------

def _infer(frontend: str, model: str, features: int = 64) -> np.ndarray:
    x = grpcclient.InferInput("input", [1, features], "FP32")
    x.set_data_from_numpy(np.ones((1, features), np.float32))
    client = grpcclient.InferenceServerClient(frontend)
    try:
        return client.infer(model, [x], client_timeout=30).as_numpy("logits")
    finally:
        client.close()


def _backend_stats(address: str) -> control.BackendStats:
    with grpc.insecure_channel(address) as ch:
        return control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=10)


def _session(stats: control.BackendStats, name: str) -> control.SessionStats | None:
    return next((s for s in stats.sessions if s.model == name), None)


def _model_ready(frontend: str, name: str) -> bool:
    with grpc.insecure_channel(frontend) as ch:
        return kserve_grpc.GRPCInferenceServiceStub(ch).ModelReady(kserve.ModelReadyRequest(name=name),
                                                                     timeout=10).ready


def _first_ready(frontend: str, names: list[str], backend: str, timeout_s: float = 120) -> dict:
    """Each model's session on ``backend`` as Stats shows it right after the frontend first says the model
    is ready (a frontend is routed to a backend only after the backend answered its table push)."""
    seen: dict[str, control.SessionStats | None] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < len(names):
        assert time.monotonic() < deadline, f"not ready within {timeout_s} s: {set(names) - set(seen)}"
        for name in names:
            if name not in seen and _model_ready(frontend, name):
                seen[name] = _session(_backend_stats(backend), name)
        time.sleep(0.05)
    return seen


@pytest.mark.slow
def test_config_warm_up_runs_on_the_backend_before_the_model_is_routed(tmp_path):
    repo = tmp_path / "repo"
    _mlp_repo(repo, MLP_CONFIG, {"ones.bin": ONES})                              # its own warm-up: 3 + 1 batches
    (repo / "plain" / "1").mkdir(parents=True)                                   # none: the default warm-up
    (repo / "plain" / "1" / "model.onnx").write_bytes(model_bytes(mlp_small(hidden=32)))
    cluster = start_cluster(tmp_path / "data", 1, "cpu", backend={"metrics_port": free_port()})
    try:
        r = nexus_cli("models", "import", str(repo), "--scheduler", cluster.scheduler.address)
        assert r.returncode == 0, r.stderr
        backend = cluster.backends[0].address
        first = _first_ready(cluster.frontend.address, ["mlp", "plain"], backend)
        mlp, plain = first["mlp"], first["plain"]
        # Warm before the first request could reach it, and none of it counted as serving.
        assert mlp is not None and mlp.warmup_count == 4 and mlp.warmup_ns > 0
        assert (mlp.execution_count, mlp.inference_count, mlp.success_count, mlp.compute_ns) == (0, 0, 0, 0)
        assert plain is not None and plain.warmup_count in (1, 2) and plain.execution_count == 0   # ORT: 1 per size
        listed = {m["name"]: m for m in json.loads(nexus_cli("models", "list", "--scheduler",
                                                             cluster.scheduler.address, "--json").stdout)}
        assert listed["mlp"]["warmup"] == [
            {"name": "ones", "batch_size": 4, "count": 3, "inputs": {"input": "ones.bin"}},
            {"name": "zeros", "batch_size": 1, "count": 1, "inputs": {"input": "zero_data"}}]
        assert listed["plain"]["warmup"] == []
        assert _infer(cluster.frontend.address, "mlp").shape == (1, 10)
        after = _session(_backend_stats(backend), "mlp")
        assert (after.execution_count, after.success_count, after.warmup_count) == (1, 1, 4)
        metrics_port = cluster.backends[0].proc.args[cluster.backends[0].proc.args.index("--metrics-port") + 1]
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'nexus_backend_warmup_batches_total{model="mlp"} 4.0' in text
        assert "nexus_backend_warming_sessions 0.0" in text
    finally:
        cluster.stop()


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def _upload(tmp_path, scheduler: str, name: str, hidden: int, latency_ms: float, warmup_count: int = 0,
            warmup_batch: int = 1) -> None:
    """An MLP on emulated t4s whose batches take ``latency_ms``; ``warmup_count`` batches of its own warm-up."""
    path = tmp_path / f"{name}.onnx"
    path.write_bytes(model_bytes(mlp_small(hidden=hidden)))
    profile = tmp_path / f"{name}.json"
    profile.write_text(Profile.linear(0.01, latency_ms, 16, device_type="t4").to_json())
    samples = (WarmupSample("zeros", warmup_batch, (WarmupInput("input", "FP32", (64,), WarmupData.ZERO),),
                            warmup_count),) if warmup_count else ()
    upload_model(scheduler, path, name, profile_path=str(profile), slo_ms=max(20 * latency_ms, 200), warmup=samples)


@pytest.mark.slow
def test_readiness_and_traffic_wait_for_warm_up_and_serving_sessions_never_stall(tmp_path):
    """Emulated t4s, whose batches take what the profile says: warm-up lasts a known time here. Every
    session keeps two replicas when two backends exist, so a second backend is given them all."""
    sched = NexusProcess(tmp_path / "scheduler.log", "scheduler", "--listen", "127.0.0.1:0",
                         "--data-dir", str(tmp_path / "data"), "--min-replicas", "2")
    fe = NexusProcess(tmp_path / "frontend.log", "frontend", "--scheduler", sched.address, "--listen", "127.0.0.1:0",
                      "--report-interval-s", "0.5")
    backends = []
    try:
        # A backend's first table brings a session with 30 warm-up batches of 40 ms: not ready until they ran.
        _upload(tmp_path, sched.address, "slow", 48, 40.0, warmup_count=30)
        backends.append(NexusProcess(tmp_path / f"backend-{len(backends)}.log", "backend",
                                     "--scheduler", sched.address, "--device", "emulated:t4"))
        first = backends[0].address
        seen_warming = False
        deadline = time.monotonic() + 60
        while _health(first) != SERVING:
            stats = _backend_stats(first)
            seen_warming |= stats.warming == ["slow"] and _session(stats, "slow") is None
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert seen_warming, "never saw the first table's warm-up running while the backend was not ready"
        assert _session(_backend_stats(first), "slow").warmup_count == 30

        # A serving session keeps being served while another one warms up on the same backend.
        _upload(tmp_path, sched.address, "fast", 32, 1.0)
        wait_ready(fe.address, "fast")
        load = BackgroundLoad(fe.address, "fast", 40.0, slo_ms=200.0, cv=0.0).start()   # steady, 10 s deadline
        _upload(tmp_path, sched.address, "late", 40, 40.0, warmup_count=30)
        during = []
        deadline = time.monotonic() + 60
        while not _model_ready(fe.address, "late"):
            stats = _backend_stats(first)
            if "late" in stats.warming:
                during.append(_session(stats, "fast").success_count)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert len(during) >= 5 and during[-1] > during[0], during    # 30 x 40 ms of warm-up; "fast" went on
        assert _session(_backend_stats(first), "late").warmup_count == 30

        # A warm-up the upload can tell is wrong is refused naming the field; one that fails on the device
        # (batch 32, past the profile's 16) fails the model's load with the reason.
        bad = tmp_path / "bad.onnx"
        bad.write_bytes(model_bytes(mlp_small(hidden=24)))
        with pytest.raises(AdminCallError, match=r"model_warmup\[0\] \('x'\).batch_size must be >= 1, got 0"):
            upload_model(sched.address, bad, "bad", warmup=(WarmupSample("x", 0, (
                WarmupInput("input", "FP32", (64,), WarmupData.ZERO),)),))
        _upload(tmp_path, sched.address, "toobig", 24, 1.0, warmup_count=1, warmup_batch=32)
        deadline = time.monotonic() + 60
        while True:
            with pytest.raises(InferenceServerException) as info:
                _infer(fe.address, "toobig")
            if "warm-up failed" in str(info.value):
                break
            assert time.monotonic() < deadline, str(info.value)
            time.sleep(0.2)
        assert "batch size 32 exceeds the profile's largest batch 16" in str(info.value)

        # A move: a second backend joins, the first leaves; the sessions warm up there before traffic moves.
        backends.append(NexusProcess(tmp_path / f"backend-{len(backends)}.log", "backend",
                                     "--scheduler", sched.address, "--device", "emulated:t4"))
        second = backends[1].address
        deadline = time.monotonic() + 60
        while not _backend_stats(second).sessions:      # registered and given the replicas
            assert time.monotonic() < deadline
            time.sleep(0.1)
        backends[0].stop()
        codes = load.stop().samples.status_counts()
        assert set(codes) == {"OK"}, codes
        stats = _backend_stats(second)
        for name, count in (("fast", 2), ("slow", 30), ("late", 30)):
            assert _session(stats, name) is not None and _session(stats, name).warmup_count >= count, (name, stats)
        assert _session(stats, "fast").success_count > 0
    finally:
        for c in [fe, *backends, sched]:
            c.stop()
