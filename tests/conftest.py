"""Shared fixtures: real local clusters (``nexus serve``, through the development harness,
harness/cluster.py) on free loopback ports. :func:`serve_models` is the one serving cluster with given
models; ``tests/components.py`` starts components one by one."""

from __future__ import annotations

import atexit
import functools
import os
import pathlib
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Sequence

import pytest

from common.profile import Profile
from harness.cluster import Node, ServeCluster
from nexus.launcher import nexus_command

# scheduler address -> the cluster token `nexus serve` made: nexus_cli sends it, as an operator would
_CLUSTER_TOKENS: dict[str, str] = {}


# The flags that choose the backends; without one of them the tests' clusters run one backend for the
# machine (`--cpu-layout machine`), as their assertions count on: `nexus serve`'s own default (auto,
# which may switch to one backend per core while a test runs) is tested in tests/e2e/test_cpu_layout.py.
BACKEND_FLAGS = ("--cpu-layout", "--backends", "--threads", "--device", "--device-type")


def start_serve(data_dir, *extra: str, timeout_s: float = 240, stderr=None) -> ServeCluster:
    """Run ``nexus serve`` (the benchmark library's harness) on free ports, with one backend for the
    machine unless ``extra`` chooses the backends; return once it printed its ready line. Admin calls
    of :func:`nexus_cli` against it carry its cluster token."""
    if not any(arg.split("=", 1)[0] in BACKEND_FLAGS for arg in extra):
        extra = ("--cpu-layout", "machine", *extra)
    c = ServeCluster(data_dir, *extra, timeout_s=timeout_s, stderr=stderr)
    if c.token:
        _CLUSTER_TOKENS[c.scheduler] = c.token
    return c


@dataclass(frozen=True)
class ServedModel:
    """A model file to serve: uploaded with ``nexus models upload PATH --name NAME --slo-ms SLO_MS``, its
    ``profile`` (written to a file beside it) when given, and ``extra`` arguments of the upload."""
    path: pathlib.Path
    name: str
    slo_ms: float
    profile: Profile | None = None
    extra: tuple[str, ...] = ()


def serve_models(workdir: pathlib.Path, models: Sequence[ServedModel], *serve_args: str, stderr=None,
                 timeout_s: float = 120) -> ServeCluster:
    """The one serving cluster with given models: ``nexus serve --no-samples SERVE_ARGS`` in
    ``workdir/data``, each model uploaded as a user would (``nexus models upload``), returned once every
    one is ready at the frontend. The caller stops it."""
    cluster = start_serve(workdir / "data", "--no-samples", *serve_args, stderr=stderr)
    try:
        for m in models:
            args = ["models", "upload", str(m.path), "--name", m.name, "--slo-ms", f"{m.slo_ms:g}", *m.extra]
            if m.profile is not None:
                profile_path = workdir / f"{m.name}.profile.json"
                profile_path.write_text(m.profile.to_json())
                args += ["--profile", str(profile_path)]
            up = nexus_cli(*args, "--scheduler", cluster.scheduler)
            assert up.returncode == 0, up.stderr
        cluster.wait_models_ready([m.name for m in models], timeout_s)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One local cluster (scheduler, frontend, one CPU backend) shared by the tests of a worker."""
    c = start_serve(tmp_path_factory.mktemp("cluster"))
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
    """The folder :func:`nexus_cli` runs in, one per test process, removed when the process exits."""
    path = tempfile.mkdtemp(prefix="nexus-cli-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def nexus_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run the ``nexus`` command as a user would; against a cluster started by :func:`start_serve`,
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


@pytest.fixture(scope="session")
def mlp_small_runtime():
    """The sample MLP in ONNX Runtime on the CPU: a real model for tests that drive an engine directly."""
    from common.runtimes import load_runtime
    from common.sample_models import mlp_small, model_bytes

    rt = load_runtime("onnxruntime", model_bytes(mlp_small()), "cpu")
    yield rt
    rt.close()
