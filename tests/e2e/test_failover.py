"""Faults and admission with real processes: a scheduler, a frontend and three emulated backends,
each started on its own so that one can be killed with SIGKILL.

The scheduler runs with a node timeout of an hour: every failover seen here comes from the signals
that arrive at once (the scheduler's Attach stream, the frontend's Execute stream), never from
missed heartbeats. Counts are asserted, never times: a test waits for the event it needs (a
request queued, a session repaired) with a generous bound that only guards against a hang. How long
a repair takes is benchmarks/faults.py's figure.
"""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest

from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Cluster
from tests.components import infer_request, start_cluster, wait_for
from tests.conftest import nexus_cli
from tests.e2e.load_under_faults import (DEVICE, FAST, FAST_SLO_MS, kill_one_of_two_replicas_under_load,
                                         ok_in_a_row_since, steady_load, upload)

pytestmark = pytest.mark.slow

SLOW = Profile.linear(1.0, 599.0, 1, device_type="gtx1080ti")     # one request at a time, 600 ms each
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # No spare replicas: these tests kill or hang the only backend of a session, and see it repaired.
    c = start_cluster(tmp_path_factory.mktemp("failover"), 3, DEVICE,
                      scheduler={"node_timeout_s": 3600, "spare_replicas": False})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One backend with a short queue: a session cannot be spread, so its queue fills."""
    c = start_cluster(tmp_path_factory.mktemp("admission"), 1, DEVICE, backend={"max_queue": MAX_QUEUE})
    yield c
    c.stop()


def _queued(cluster: Cluster, model: str) -> int:
    """Requests of ``model`` waiting in the live backends' queues (not those running)."""
    return sum(s.queue_length for _, stats in cluster.backend_stats() for s in stats.sessions if s.model == model)


def _in_flight(metrics_url: str) -> int:
    """The frontend's ``nexus_requests_in_flight``: calls its handlers hold now."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("nexus_requests_in_flight "):
                return int(float(line.split()[1]))
    raise AssertionError("the frontend exports no nexus_requests_in_flight")


def _unload(cluster, name: str) -> None:
    with grpc.insecure_channel(cluster.scheduler.address) as ch:
        control_grpc.SchedulerStub(ch).UnloadModel(control.UnloadRequest(name=name), timeout=10)


# ---- admission ----------------------------------------------------------------------------------

def test_queue_full_cancellation_and_deadline(single, tmp_path):
    cluster = single
    upload(cluster, tmp_path, "slow", SLOW, 20000)
    try:
        with grpc.insecure_channel(cluster.frontend.address) as ch:
            stub = kserve_grpc.GRPCInferenceServiceStub(ch)
            # Full queue: one request runs, MAX_QUEUE wait, the rest are answered UNAVAILABLE at once.
            before = cluster.executed("slow")
            futures = [stub.ModelInfer.future(infer_request("slow"), timeout=60) for _ in range(MAX_QUEUE + 12)]
            codes = [f.code() for f in futures]
            assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE}, codes
            unavailable = [f for f in futures if f.code() == grpc.StatusCode.UNAVAILABLE]
            assert len(unavailable) >= 5, codes
            assert "full" in unavailable[0].details()
            assert cluster.executed("slow") - before == codes.count(grpc.StatusCode.OK)

            # Cancellation: requests queued behind a running one, cancelled by their client, leave the
            # queue and never run, and count as failures in the model's statistics.
            def failed() -> int:
                stats = stub.ModelStatistics(kserve.ModelStatisticsRequest(name="slow"), timeout=10)
                return stats.model_stats[0].inference_stats.fail.count
            before, failed_before = cluster.executed("slow"), failed()
            # Several queued ahead: the requests to cancel are sent while at least one waits, so
            # they queue behind it even on a slow machine (600 ms a request).
            first = [stub.ModelInfer.future(infer_request("slow"), timeout=60) for _ in range(4)]
            wait_for(lambda: _queued(cluster, "slow") >= 2, what="one request running, the others queued")
            cancelled = [stub.ModelInfer.future(infer_request("slow"), timeout=60) for _ in range(3)]
            # A call cancelled before the frontend's handler took it is no request of the model (as in
            # Triton): every one of the seven is seen taken, in flight or answered, before the cancel.
            metrics = cluster.frontend.info["metrics"]
            wait_for(lambda: _in_flight(metrics) + sum(f.done() for f in first) >= len(first) + len(cancelled),
                     what="the requests to cancel taken by the frontend")
            wait_for(lambda: _queued(cluster, "slow") >= 4, what="the requests to cancel queued behind a first one")
            for f in cancelled:
                f.cancel()
            assert all(f.result() is not None for f in first)
            # Sent last, a probe runs after anything still queued (earliest deadline first, one request
            # at a time): by its answer, a cancelled request that had stayed queued would have run.
            assert stub.ModelInfer(infer_request("slow"), timeout=60) is not None
            assert all(f.cancelled() for f in cancelled)
            assert cluster.executed("slow") - before == len(first) + 1
            # the frontend counts a cancellation when the server sees the call end, which a loaded
            # machine may report a moment after the client's cancel returned
            wait_for(lambda: failed() - failed_before == 3, timeout_s=10, what="the 3 cancellations counted")
            assert failed() - failed_before == 3

            # Deadline: a request whose "timeout" passes while it waits is answered DEADLINE_EXCEEDED
            # and never runs.
            before = cluster.executed("slow")
            first = [stub.ModelInfer.future(infer_request("slow"), timeout=60) for _ in range(3)]
            wait_for(lambda: _queued(cluster, "slow") >= 1, what="one request running, others queued")
            with pytest.raises(grpc.RpcError) as late:
                stub.ModelInfer(infer_request("slow", timeout_us=50_000), timeout=60)
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value
            assert all(f.result() is not None for f in first)
            assert stub.ModelInfer(infer_request("slow"), timeout=60) is not None     # the probe, as above
            assert cluster.executed("slow") - before == len(first) + 1

            # The only backend lost: a request waits for the repaired table, which has no backend left.
            cluster.backends[0].kill()
            with pytest.raises(grpc.RpcError) as gone:
                stub.ModelInfer(infer_request("slow", timeout_us=5_000_000), timeout=30)
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE, gone.value
            assert "not available" in gone.value.details()
    finally:
        single.stop()


# ---- failover -----------------------------------------------------------------------------------

def test_replica_counts_are_validated_and_stored_and_strangers_cannot_attach(cluster, tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    bad = nexus_cli("models", "upload", str(model), "--name", "m", "--min-replicas", "-1",
                    "--scheduler", cluster.scheduler.address)
    assert bad.returncode == 2 and "--min-replicas must not be negative" in bad.stderr
    huge = nexus_cli("models", "upload", str(model), "--name", "m", "--min-replicas", "65",
                     "--scheduler", cluster.scheduler.address)
    assert huge.returncode == 2 and "min_replicas must be between 0 and 64" in huge.stderr
    with grpc.insecure_channel(cluster.scheduler.address) as ch:
        stub = control_grpc.SchedulerStub(ch)
        with pytest.raises(grpc.RpcError) as unknown:
            stub.LoadModel(control.LoadRequest(name="m", min_replicas=2), timeout=10)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        stored = nexus_cli("models", "upload", str(model), "--name", "m", "--no-load",
                           "--scheduler", cluster.scheduler.address)
        assert stored.returncode == 0, stored.stderr
        with pytest.raises(grpc.RpcError) as too_many:
            stub.LoadModel(control.LoadRequest(name="m", min_replicas=65), timeout=10)
        assert too_many.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "min_replicas must be between 0 and 64" in too_many.value.details()
        stub.LoadModel(control.LoadRequest(name="m", min_replicas=3), timeout=10)
        [desc] = [m for m in stub.ListModels(control.ListModelsRequest(), timeout=10).models if m.name == "m"]
        assert desc.min_replicas == 3 and desc.loaded
        stub.UnloadModel(control.UnloadRequest(name="m"), timeout=10)
        with pytest.raises(grpc.RpcError) as stranger:
            next(iter(stub.Attach(control.AttachRequest(node_id="be-nobody"), timeout=10)))
        assert stranger.value.code() == grpc.StatusCode.NOT_FOUND
        assert "register first" in stranger.value.details()


def test_an_expected_rate_is_planned_for_before_any_request_and_the_harness_waits_for_the_plan(cluster, tmp_path):
    upload(cluster, tmp_path, "expected", FAST, FAST_SLO_MS, "--expected-rate-rps", "1000")
    listed = json.loads(nexus_cli("models", "list", "--scheduler", cluster.scheduler.address, "--json").stdout)
    assert [m["expected_rate_rps"] for m in listed if m["name"] == "expected"] == [1000.0]
    try:
        # One device carries at most 32 rows per 37 ms cycle, 865 rps: the plan spreads it over two
        # devices at once, and the harness returns once both serve it and every frontend routes so.
        status = cluster.wait_plan_spread(timeout_s=60)
        placed = [s for d in status.devices for s in d.sessions if s.session == "expected"]
        assert len(placed) >= 2 and sum(s.device_rate_rps for s in placed) >= 1000.0
        assert {s.planned_rate_rps for s in placed} == {1000.0}
        assert status.devices_in_use >= min(status.planned_devices, len(status.devices))
        cluster.frontend.pause()      # its metrics do not answer: the harness cannot see the table it holds
        try:
            with pytest.raises(RuntimeError, match="the plan did not spread within 1 s"):
                cluster.wait_plan_spread(timeout_s=1)
        finally:
            cluster.frontend.resume()
    finally:
        _unload(cluster, "expected")


def test_kill_9_of_a_replica_fails_at_most_the_requests_in_flight(cluster, tmp_path):
    upload(cluster, tmp_path, "twin", FAST, FAST_SLO_MS, "--min-replicas", "2")
    listed = json.loads(nexus_cli("models", "list", "--scheduler", cluster.scheduler.address, "--json").stdout)
    assert [m["min_replicas"] for m in listed if m["name"] == "twin"] == [2]
    kill_one_of_two_replicas_under_load(cluster, "twin")
    # The plan is repaired: the session is back on two backends (the third one took a replica).
    wait_for(lambda: len(cluster.serving("twin")) == 2, what="twin back on two backends")
    _unload(cluster, "twin")


def test_kill_9_of_the_only_backend_of_a_session_is_repaired_without_heartbeat_timeouts(cluster, tmp_path):
    upload(cluster, tmp_path, "solo", FAST, FAST_SLO_MS)
    [serving] = cluster.serving("solo")
    load = steady_load(cluster, "solo", 100)
    wait_for(lambda: ok_in_a_row_since(load, 0.0), what="the load answered")
    killed_at = time.monotonic()
    serving.kill()
    # Repaired: 25 requests in a row, all sent after the kill, answered OK. The node timeout is an
    # hour: only the Attach stream can have told the scheduler.
    wait_for(lambda: ok_in_a_row_since(load, killed_at), what="25 requests sent after the kill answered OK in a row")
    codes = load.stop().samples.status_counts()
    print("solo:", codes)
    assert "NO_RESPONSE" not in codes
    assert set(codes) <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, codes
    # One replica once the plan settles: a later move warms its new placement before the old one
    # drains, so for a moment two backends may hold the session (one CI run saw that).
    wait_for(lambda: len(cluster.serving("solo")) == 1, what="one backend serving solo")


@pytest.fixture
def pair(tmp_path_factory):
    """Two backends of its own: the module's cluster may have lost backends to the kill tests."""
    c = start_cluster(tmp_path_factory.mktemp("hang"), 2, DEVICE,
                      scheduler={"node_timeout_s": 3600, "spare_replicas": False})
    yield c
    c.stop()


def test_a_hung_backend_is_routed_around_by_keepalive_without_heartbeat_timeouts(pair, tmp_path):
    """SIGSTOP: the process lives and its sockets stay open, so no stream breaks by itself. The
    keepalive pings it no longer answers break the frontend's Execute stream and the scheduler's
    Attach stream; the session moves to a live backend. The node timeout is an hour. Without a
    timeout on every ping, the session came back only after about a minute, and without the
    distribution's handling of a node removed mid-push, never (the planner's loop ended): the
    bound below (40 s, against about 3 s here) catches both."""
    cluster = pair
    upload(cluster, tmp_path, "frozen", FAST, FAST_SLO_MS)
    [serving] = cluster.serving("frozen")
    others = [b for b in cluster.backends if b is not serving and b.proc.poll() is None]
    assert others
    load = steady_load(cluster, "frozen", 50)
    wait_for(lambda: ok_in_a_row_since(load, 0.0), what="the load answered")
    stopped_at = time.monotonic()
    serving.pause()
    try:
        # Served again: 25 requests in a row, all sent after the stop, answered OK.
        wait_for(lambda: ok_in_a_row_since(load, stopped_at), what="25 requests sent after the stop answered OK",
                 timeout_s=40)
        codes = load.stop().samples.status_counts()
        print("frozen:", codes)
        assert "NO_RESPONSE" not in codes
        assert set(codes) <= {"OK", "UNAVAILABLE", "DEADLINE_EXCEEDED"}, codes
        # A live backend took the session over while the hung one was still stopped.
        moved = []
        for b in others:
            with grpc.insecure_channel(b.address) as ch:
                stats = control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=5)
            moved += [b for s in stats.sessions if s.model == "frozen"]
        assert moved
    finally:
        serving.resume()
