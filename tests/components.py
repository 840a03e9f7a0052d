"""Helpers of the tests that run clusters of separate component processes (the harness's
:class:`harness.cluster.Cluster`); one component alone is conftest's :class:`NexusProcess`. What is
here is only what tests assert with."""

from __future__ import annotations

import time

import grpc
import numpy as np

from common.pb import control, control_grpc, kserve
from harness import prometheus
from harness.cluster import Cluster, wait_model_served


def start_cluster(workdir, backends: int, device: str, *, scheduler: dict | None = None,
                  backend: dict | None = None) -> Cluster:
    """A scheduler, a frontend (workload reports every 0.5 s) and ``backends`` backends on ``device``,
    each its own process; ``scheduler`` and ``backend`` override configuration fields. Spare replicas
    are off unless ``scheduler`` turns them on: these clusters' tests count where sessions run, and
    spares keep every idle backend loading and warming (tests/e2e/test_spare_replicas.py tests them)."""
    scheduler = {"spare_replicas": False, **(scheduler or {})}
    return Cluster(workdir, backends=backends, device=device, scheduler=scheduler, backend=backend,
                   frontend={"report_interval_s": 0.5}).start()


def infer_request(model: str, features: int = 64, timeout_us: int = 0) -> kserve.ModelInferRequest:
    """One row of zeros for a model with one FP32 input of ``features``."""
    req = kserve.ModelInferRequest(model_name=model)
    req.inputs.add(name="input", datatype="FP32", shape=[1, features])
    req.raw_input_contents.append(np.zeros((1, features), np.float32).tobytes())
    if timeout_us:
        req.parameters["timeout"].int64_param = timeout_us
    return req


def wait_ready(frontend: str, model: str, timeout_s: float = 60) -> None:
    """Until ``model`` is ready at ``frontend`` and answers an inference."""
    wait_model_served(frontend, model, timeout_s)


def wait_for(predicate, timeout_s: float = 60, what: str = ""):
    """Poll ``predicate`` until it returns something true, and return that; AssertionError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (one exited but not yet reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def list_models_status(address: str) -> tuple[str, str, dict]:
    """(status code name, details, trailing metadata) of ListModels at a scheduler's ``address``: "OK"
    from a leader; a standby's refusal names the leader."""
    with grpc.insecure_channel(address) as channel:
        try:
            control_grpc.SchedulerStub(channel).ListModels(control.ListModelsRequest(), timeout=5)
            return "OK", "", {}
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", dict(exc.trailing_metadata() or ())


def wait_leads(address: str, timeout_s: float = 30.0) -> float:
    """Seconds until the scheduler at ``address`` answers as the leader; AssertionError after ``timeout_s``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if list_models_status(address)[0] == "OK":
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{address} did not lead within {timeout_s} s")


def scrape(url: str) -> tuple[dict[tuple[str, frozenset], float], dict[str, str]]:
    """({(sample, labels): value}, {family: type}) of a component's metrics endpoint, served as
    Prometheus text."""
    found = prometheus.scrape(url)
    assert found.content_type.startswith("text/plain; version=0.0.4"), found.content_type
    return found.samples, found.types
