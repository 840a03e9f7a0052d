"""Shared fixtures: real local clusters (``nexus serve``, through the benchmark library's harness,
harness/cluster.py) on free loopback ports."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import tempfile

import pytest

from harness.cluster import Node, ServeCluster
from nexus.launcher import nexus_command

# scheduler address -> the cluster token `nexus serve` made: nexus_cli sends it, as an operator would
_CLUSTER_TOKENS: dict[str, str] = {}


def start_cluster(data_dir, *extra: str, timeout_s: float = 240, stderr=None) -> ServeCluster:
    """Run ``nexus serve`` (the benchmark library's harness) on free ports; return once it printed its
    ready line. Admin calls of :func:`nexus_cli` against it carry its cluster token."""
    c = ServeCluster(data_dir, *extra, timeout_s=timeout_s, stderr=stderr)
    if c.token:
        _CLUSTER_TOKENS[c.scheduler] = c.token
    return c


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


class NexusProcess(Node):
    """``nexus ARGV`` (the benchmark library's :class:`Node`) with its log (stderr) in a file at INFO;
    the address from its ready line."""

    def __init__(self, log_path: pathlib.Path, *argv: str, env: dict | None = None) -> None:
        super().__init__(argv[0], argv, env={"NEXUS_LOG": "INFO", **(env or {})}, log_path=log_path)
        try:
            self.wait_ready(60)
        except RuntimeError as exc:
            self.stop()
            raise AssertionError(str(exc)) from None

    def stop(self, timeout_s: float = 30.0) -> int:
        return super().stop(timeout_s)


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


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for this worker (harness/postgres.py); skipped, with the reason, where none
    can start. Its passfile is in this process's environment, as an operator's would be."""
    from harness.postgres import PostgresServer

    try:
        server = PostgresServer()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")
    old = os.environ.get("PGPASSFILE")
    os.environ["PGPASSFILE"] = str(server.passfile)
    yield server
    if old is None:
        os.environ.pop("PGPASSFILE", None)
    else:
        os.environ["PGPASSFILE"] = old
    server.stop()


@pytest.fixture
def pg_url(postgres):
    """The URL of a new, empty PostgreSQL database."""
    return postgres.database()
