"""``nexus frontend --workers 2``: two frontend processes behind one gRPC and one HTTP port.

Real processes: a scheduler, an emulated backend, and the frontend's supervisor with its two workers.
Clients on separate connections are spread over the workers by the kernel; each worker registers with
the scheduler as a frontend of its own; ModelStatistics, whichever worker answers, counts every
worker's requests; /metrics carries every worker's series; a killed worker is restarted on the same
ports.
"""

from __future__ import annotations

import os
import signal
import subprocess
import urllib.request

import grpc
import pytest

from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from harness.cluster import Cluster
from tests.components import infer_request, wait_for, wait_ready
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

DEVICE = "emulated:gtx1080ti"
FAST = Profile.linear(1.0, 5.0, 32, device_type="gtx1080ti")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("workers")
    c = Cluster(work, backends=1, device=DEVICE, scheduler={"spare_replicas": False},
                frontend={"report_interval_s": 0.5, "workers": 2}).start()
    model = work / "tiny.onnx"
    model.write_bytes(model_bytes(mlp_small()))
    prof = work / "tiny.json"
    prof.write_text(FAST.to_json())
    up = nexus_cli("models", "upload", str(model), "--name", "tiny", "--profile", str(prof), "--slo-ms", "2000",
                   "--scheduler", c.scheduler.address)
    assert up.returncode == 0, up.stderr
    wait_ready(c.frontend.address, "tiny")
    yield c
    c.stop()


def _workers(supervisor_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", "--worker-control-listen"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if _parent_of(int(p)) == supervisor_pid]


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _registered_frontends(cluster) -> int:
    with grpc.insecure_channel(cluster.scheduler.address) as ch:
        return control_grpc.SchedulerStub(ch).GetStatus(control.StatusRequest(), timeout=10).frontends


def _infer_on_new_connections(address: str, n: int) -> int:
    """``n`` requests, each on a connection of its own; how many answered OK."""
    ok = 0
    for _ in range(n):
        with grpc.insecure_channel(address) as ch:
            kserve_grpc.GRPCInferenceServiceStub(ch).ModelInfer(infer_request("tiny"), timeout=20)
            ok += 1
    return ok


def _stats(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        reply = kserve_grpc.GRPCInferenceServiceStub(ch).ModelStatistics(
            kserve.ModelStatisticsRequest(name="tiny"), timeout=20)
    return reply.model_stats[0].inference_stats.success.count


def test_two_workers_share_the_port_register_apart_and_count_together(cluster):
    workers = wait_for(lambda: len(w := _workers(cluster.frontend.pid)) == 2 and w, what="two workers")
    # each worker is a frontend of its own to the scheduler, on a port of its own
    wait_for(lambda: _registered_frontends(cluster) == 2, what="two frontends registered")
    before = {pid: _cpu_ticks(pid) for pid in workers}
    assert _infer_on_new_connections(cluster.frontend.address, 60) == 60
    busy = [pid for pid in workers if _cpu_ticks(pid) > before[pid]]
    assert len(busy) == 2, "the kernel gave every connection to one worker"
    # Whichever worker answers, the count is the whole frontend's: asked on fresh connections, every
    # answer is at least the 60 just served (each worker served only part of them).
    counts = [_stats(cluster.frontend.address) for _ in range(10)]
    assert min(counts) >= 60, counts
    text = urllib.request.urlopen(cluster.frontend.info["metrics"], timeout=10).read().decode()
    served = {}
    for line in text.splitlines():
        if line.startswith('nv_inference_request_success{') and 'model="tiny"' in line:
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            served[worker] = float(line.rsplit(" ", 1)[1])
    assert set(served) == {"0", "1"}, text[:2000]
    assert sum(served.values()) >= 60


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def test_a_killed_worker_is_restarted_on_the_same_ports(cluster):
    victim = _workers(cluster.frontend.pid)[0]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len(w := _workers(cluster.frontend.pid)) == 2 and victim not in w, what="the worker restarted")
    wait_for(lambda: _registered_frontends(cluster) >= 2, what="the new worker registered")
    wait_ready(cluster.frontend.address, "tiny")
    assert _infer_on_new_connections(cluster.frontend.address, 20) == 20


def test_worker_flags_are_validated():
    bad = nexus_cli("frontend", "--workers", "-1")
    assert bad.returncode == 2 and "--workers: expected 0 (one per core) or a positive count, got -1" in bad.stderr
    bad = nexus_cli("frontend", "--worker-siblings", "127.0.0.1:1")
    assert bad.returncode == 2 and "--worker-siblings: only a worker" in bad.stderr
    bad = nexus_cli("frontend", "--workers", "2", "--worker-control-listen", "127.0.0.1:0")
    assert bad.returncode == 2 and "a worker runs alone" in bad.stderr
