"""Shared fixtures: real local clusters started as separate processes on free loopback ports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nexus.launcher import Child, nexus_command
from nexus.process import READY_PREFIX  # noqa: F401  (tests import it from here)


class RunningCluster:
    def __init__(self, child: Child, frontend: str, scheduler: str, data_dir) -> None:
        self.child = child
        self.proc = child.proc
        self.frontend = frontend
        self.scheduler = scheduler
        self.data_dir = data_dir
        self.info = child.info         # key=value words of the ready line (metrics=URL, http=HOST:PORT)
        self.http = self.info.get("http", "")    # KServe v2 HTTP/REST HOST:PORT

    def stop(self) -> int:
        return self.child.stop(timeout_s=30)


def start_cluster(data_dir, *extra: str, timeout_s: float = 240, stderr=None) -> RunningCluster:
    """Run ``nexus serve`` (through nexus.launcher) on free ports; return once it printed its ready line."""
    env = dict(os.environ, NEXUS_LOG=os.environ.get("NEXUS_LOG", "WARNING"))
    child = Child("nexus serve", ["serve", "--frontend-port", "0", "--scheduler-port", "0", "--metrics-port", "0",
                                  "--http-port", "0", "--data-dir", str(data_dir), *extra], env, stderr=stderr,
                  start_new_session=True)
    try:
        child.wait_ready(timeout_s)
    except RuntimeError:
        child.stop()
        raise
    frontend, scheduler = child.ready_fields[2:4]
    return RunningCluster(child, frontend, scheduler, data_dir)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One local cluster (scheduler, frontend, one CPU backend) shared by the tests of a worker."""
    c = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


@pytest.fixture(scope="session")
def direct(tmp_path_factory):
    """ONNX Runtime sessions run directly on the sample model files, by model name: the reference outputs."""
    import onnxruntime as ort

    from common.sample_models import write_sample_models
    paths = write_sample_models(tmp_path_factory.mktemp("direct"))
    return {name: ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]) for name, p in paths.items()}


def nexus_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run the ``nexus`` command as a user would."""
    return subprocess.run([*nexus_command(), *args], capture_output=True, text=True, timeout=timeout_s)
