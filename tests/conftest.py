"""Shared fixtures: real local clusters started as separate processes on free loopback ports."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

from nexus.launcher import Child, nexus_command
from nexus.process import READY_PREFIX  # noqa: F401  (tests import it from here)

# scheduler address -> the cluster token `nexus serve` made: nexus_cli sends it, as an operator would
_CLUSTER_TOKENS: dict[str, str] = {}


class RunningCluster:
    def __init__(self, child: Child, frontend: str, scheduler: str, data_dir) -> None:
        self.child = child
        self.proc = child.proc
        self.frontend = frontend
        self.scheduler = scheduler
        self.data_dir = data_dir
        self.info = child.info         # key=value words of the ready line (metrics=URL, http=HOST:PORT)
        self.http = self.info.get("http", "")    # KServe v2 HTTP/REST HOST:PORT
        token_file = pathlib.Path(data_dir) / "token"
        self.token = token_file.read_text().strip() if token_file.exists() else ""
        if self.token:
            _CLUSTER_TOKENS[scheduler] = self.token

    @property
    def creds(self):
        """Credentials for admin calls from the test process (the cluster token)."""
        from common.security import Credentials
        return Credentials(token=self.token or None)

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


class NexusProcess:
    """``nexus ARGV`` (through nexus.launcher) with its log (stderr) in a file; the address from its ready line."""

    def __init__(self, log_path: pathlib.Path, *argv: str, env: dict | None = None) -> None:
        self.log_path = log_path
        self.log = log_path.open("w")
        self.child = Child(argv[0], argv, {**os.environ, "NEXUS_LOG": "INFO", **(env or {})}, stderr=self.log)
        try:
            self.address = self.child.wait_ready(60)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}: {self.logs()}") from None
        self.proc = self.child.proc

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.child.stop(timeout_s=30)
        self.log.close()


@functools.cache
def _empty_dir() -> str:
    return tempfile.mkdtemp(prefix="nexus-cli-")


def nexus_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run the ``nexus`` command as a user would; against a cluster started by :func:`start_cluster`,
    with its token in ``$NEXUS_TOKEN``, as its operator would. It runs in an empty folder, so that a
    ``.nexus-data/token`` of the checkout (a local ``nexus serve``'s) is never picked up."""
    env = None
    if "--scheduler" in args and "--token-file" not in args:
        token = _CLUSTER_TOKENS.get(args[args.index("--scheduler") + 1])
        env = dict(os.environ, NEXUS_TOKEN=token) if token else None
    return subprocess.run([*nexus_command(), *args], capture_output=True, text=True, timeout=timeout_s, env=env,
                          cwd=_empty_dir())
