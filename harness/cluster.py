"""The one cluster harness of the benchmarks and the tests: real processes on loopback.

:class:`Cluster` starts a scheduler, frontends and backends as separate processes, each through
:func:`nexus.launcher.launch` as ``nexus serve`` starts them, so that a benchmark or a test can kill,
pause or restart one of them. :class:`ServeCluster` runs ``nexus serve`` itself: one process that
supervises the same three. Both wait until they are ready, upload models, and leave no process
behind: ``stop()`` ends every process they started (SIGTERM, then SIGKILL after a grace), and the
processes die with this one if it dies first (``nexus.process.die_with_parent``).

Every node is a :class:`Node`: a :class:`nexus.launcher.Child` in its own session, with its log
(stderr) in a file, that can be killed (``kill -9``), paused (``kill -STOP``) and restarted on the
address its peers know.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import time
import urllib.parse
from typing import Callable, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.late_requests import LateRequests
from common.config import BackendConfig, FrontendConfig, SchedulerConfig
from common.pb import control, control_grpc, kserve, kserve_grpc
from common.security import Credentials
from harness.meters import descendants
from harness.prometheus import scrape
from nexus.launcher import Child, component_argv, pin_listen
from nexus.scheduler_client import upload_model
from nexus.serve_cmd import wait_models_ready


class Node(Child):
    """One ``nexus ARGV...`` process (see :class:`nexus.launcher.Child`) in a session of its own.

    ``log_path``: its stderr is appended to this file (else ``stderr``, else inherited).
    ``env`` is added to this process's environment, with ``NEXUS_LOG`` at ``log_level`` (default:
    ``$NEXUS_LOG``, else WARNING) unless ``env`` sets it.
    """

    def __init__(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike | None = None, stderr=None, log_level: str | None = None,
                 command: Sequence[str] | None = None, cwd=None) -> None:
        self.log_path = pathlib.Path(log_path) if log_path else None
        self._log = None
        full_env = {**os.environ, "NEXUS_LOG": log_level or os.environ.get("NEXUS_LOG", "WARNING"), **(env or {})}
        super().__init__(name, argv, full_env, command=command, stderr=stderr, cwd=cwd, start_new_session=True)

    def start(self) -> None:
        if self.log_path is not None and (self._log is None or self._log.closed):
            self._log = open(self.log_path, "a")
            self.stderr = self._log
        super().start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        try:
            return super().wait_ready(timeout_s)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}{self._log_tail()}") from None

    def wait_serving(self, timeout_s: float = 120.0) -> None:
        """Until its gRPC health check (service "") says SERVING."""
        deadline = time.monotonic() + timeout_s
        while not serving(self.address):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} at {self.address} not SERVING within {timeout_s:.0f} s")
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}{self._log_tail()}")
            time.sleep(0.1)

    def kill(self) -> None:
        """``kill -9``: no goodbye to anyone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        """``kill -STOP``: the process stays and its sockets stay open, but it answers nothing."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def stop(self, timeout_s: float = 20.0) -> int:
        """SIGTERM (it drains), SIGKILL after ``timeout_s``; its log is closed. The exit status."""
        if self.proc.poll() is None:
            self.resume()                     # a paused process cannot drain
        status = super().stop(timeout_s)
        if self._log is not None:
            self._log.close()
        return status

    def logs(self) -> str:
        if self._log is not None and not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def _log_tail(self) -> str:
        tail = self.logs()[-3000:]
        return f"; its log ends:\n{tail}" if tail else ""


def serving(address: str) -> bool:
    """Whether the gRPC health check (service "") at ``address`` says SERVING."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


@dataclasses.dataclass(frozen=True)
class Upload:
    """A model to upload: its file, name and, optionally, profile (a file), SLO, the rate it is
    planned for until one is measured and what becomes of its late requests (None: the default)."""

    path: pathlib.Path
    name: str
    profile_path: str | None = None
    slo_ms: float = 0.0
    min_replicas: int = 0
    load: bool = True
    expected_rate_rps: float = 0.0
    late_requests: LateRequests | None = None


class Cluster:
    """A scheduler, ``frontends`` frontends and ``backends`` backends on ``device``, each its own process.

    ``scheduler``, ``backend`` and ``frontend`` override fields of the components' configurations
    (``common/config.py``; for example ``{"node_timeout_s": 3600}``, ``{"max_queue": 8}``); every
    listening port is free (port 0). ``env``: more environment for every node, or a function of the
    node's kind (``scheduler``, ``backend``, ``frontend``) giving it. ``command`` replaces the
    ``nexus`` command (for example under ``taskset`` or cProfile), or is a function of the node's kind
    giving it; ``cwd`` is where the nodes run. Logs go to
    ``workdir/<name>.log``, the model database to ``workdir/db``.

    ``start(models)`` starts the scheduler, uploads ``models``, then starts the backends and the
    frontends and waits until each is ready (and, with ``wait_serving``, until each says SERVING), and
    until the models are ready on every frontend. A restarted scheduler or frontend comes back on its
    addresses (a frontend's HTTP and metrics ports too). Use as a context manager, or call :meth:`stop`.
    """

    def __init__(self, workdir: str | os.PathLike, *, backends: int = 1, frontends: int = 1, device: str = "cpu",
                 scheduler: Mapping | None = None, backend: Mapping | None = None, frontend: Mapping | None = None,
                 env: Mapping[str, str] | Callable[[str], Mapping[str, str]] | None = None,
                 command: Sequence[str] | Callable[[str], Sequence[str]] | None = None, cwd=None,
                 log_level: str | None = None) -> None:
        self.workdir = pathlib.Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.n_backends, self.n_frontends, self.device = backends, frontends, device
        self.overrides = {"scheduler": dict(scheduler or {}), "backend": dict(backend or {}),
                          "frontend": dict(frontend or {})}
        self.env = env
        self.command, self.cwd, self.log_level = command, cwd, log_level
        self.scheduler: Node | None = None
        self.backends: list[Node] = []
        self.frontends: list[Node] = []

    # ---- starting -------------------------------------------------------------------------------

    def _launch(self, config, kind: str, name: str) -> Node:
        extra = self.env(kind) if callable(self.env) else self.env
        command = self.command(kind) if callable(self.command) else self.command
        node = Node(name, component_argv(config), env=extra, log_path=self.workdir / f"{name}.log",
                    log_level=self.log_level, command=command, cwd=self.cwd)
        node.config = config
        return node

    def _config(self, kind: str, cls, **base):
        return cls(**{**base, **self.overrides[kind]})

    def start(self, models: Sequence[Upload] = (), *, timeout_s: float = 240.0, wait_serving: bool = False) -> "Cluster":
        try:
            self.scheduler = self._launch(self._config("scheduler", SchedulerConfig, listen="127.0.0.1:0",
                                                       data_dir=self.workdir / "db"), "scheduler", "scheduler")
            self._ready(self.scheduler, timeout_s)
            for m in models:
                self.upload(m, wait=False)
            address = self.scheduler.address
            self.backends = [self._launch(self._config("backend", BackendConfig, scheduler=address,
                                                       listen="127.0.0.1:0", device=self.device),
                                          "backend", f"backend-{i}") for i in range(self.n_backends)]
            self.frontends = [self._launch(self._config("frontend", FrontendConfig, scheduler=address,
                                                        listen="127.0.0.1:0", http_listen="127.0.0.1:0",
                                                        metrics_listen="127.0.0.1:0"), "frontend", f"frontend-{i}")
                              for i in range(self.n_frontends)]
            for node in [*self.backends, *self.frontends]:
                self._ready(node, timeout_s)
                if wait_serving:
                    node.wait_serving(timeout_s)
            if models:
                self.wait_models_ready([m.name for m in models], timeout_s)
        except BaseException:
            self.stop(timeout_s=5)
            raise
        return self

    @staticmethod
    def _ready(node: Node, timeout_s: float) -> None:
        node.wait_ready(timeout_s)
        if not isinstance(node.config, BackendConfig):
            # Restarted, it comes back where its peers and clients know it (it started on port 0).
            bound = {}
            if isinstance(node.config, FrontendConfig):
                bound["http_listen"] = node.info.get("http", "")
                bound["metrics_listen"] = urllib.parse.urlsplit(node.info.get("metrics", "")).netloc
            node.config = pin_listen(node, node.config, **bound)

    # ---- nodes ----------------------------------------------------------------------------------

    @property
    def frontend(self) -> Node:
        return self.frontends[0]

    @property
    def nodes(self) -> list[Node]:
        return [n for n in [*self.frontends, *self.backends, self.scheduler] if n is not None]

    def restart(self, node: Node, timeout_s: float = 60.0) -> int:
        """SIGTERM ``node`` (it drains), start it again, wait until it is ready and SERVING; its exit status."""
        status = node.stop(timeout_s=timeout_s)
        node.start()
        node.wait_ready(timeout_s)
        node.wait_serving(timeout_s)
        return status

    def stop(self, timeout_s: float = 20.0) -> None:
        """Stop every node (frontends first, the scheduler last)."""
        for node in self.nodes:
            node.stop(timeout_s=timeout_s)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- models ---------------------------------------------------------------------------------

    def upload(self, model: Upload, *, wait: bool = True, timeout_s: float = 120.0) -> None:
        """Upload ``model`` to the scheduler; with ``wait``, until every frontend answers an inference of it."""
        upload_model(self.scheduler.address, model.path, model.name, profile_path=model.profile_path,
                     slo_ms=model.slo_ms, min_replicas=model.min_replicas, load=model.load,
                     expected_rate_rps=model.expected_rate_rps, late_requests=model.late_requests)
        if wait and model.load:
            for f in self.frontends:
                wait_model_served(f.address, model.name, timeout_s)

    def wait_models_ready(self, names: list[str], timeout_s: float = 120.0) -> None:
        for f in self.frontends:
            pending = wait_models_ready(f.address, names, timeout_s)
            if pending:
                raise RuntimeError(f"models not ready on {f.name} ({f.address}) within {timeout_s:.0f} s: {pending}")

    def wait_plan_spread(self, timeout_s: float = 120.0):
        """Until the scheduler's plan in force runs on every device it needs (as many backends in use
        as it plans devices, or every backend there is), and every frontend holds that plan's routing
        table (its ``nexus_routing_epoch``). Models are served once the first backend is up, with the
        plan folded onto it; a load started then would measure the sessions' moves to the backends
        that register a moment later. Returns the scheduler's status (``nexus.status_model``)."""
        from nexus.scheduler_client import fetch_status

        deadline = time.monotonic() + timeout_s
        while True:
            st = fetch_status(self.scheduler.address)
            spread = st.devices_in_use >= min(st.planned_devices, len(st.devices))
            if spread and all(routing_epoch(f.info.get("metrics", "")) >= st.epoch for f in self.frontends):
                return st
            if time.monotonic() > deadline:
                raise RuntimeError(f"the plan did not spread within {timeout_s:.0f} s: {st.devices_in_use} backends "
                                   f"in use of {len(st.devices)}, {st.planned_devices} planned (epoch {st.epoch})")
            time.sleep(0.5)

    def serving(self, model: str) -> list[Node]:
        """The live backends that have ``model`` loaded (from their Stats)."""
        return [b for b, stats in self.backend_stats() if any(s.model == model for s in stats.sessions)]

    def executed(self, model: str) -> int:
        """Rows of ``model`` executed, summed over the live backends."""
        return sum(s.inference_count for _, stats in self.backend_stats() for s in stats.sessions if s.model == model)

    def backend_stats(self):
        for b in self.backends:
            if b.proc.poll() is not None:
                continue
            with grpc.insecure_channel(b.address) as ch:
                yield b, control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=5)

    def live_profiles(self, models: Sequence[str]) -> dict:
        """The profiles the scheduler holds now, by model and device type (read-only SQLite, while it runs)."""
        return live_profiles(self.workdir / "db", models)

    def profiles(self, models: Sequence[str]) -> dict:
        """The profiles the scheduler holds, by model (reads the model database; call after stop())."""
        from globalsched.state.modeldb import ModelDatabase

        db = ModelDatabase(self.workdir / "db")
        try:
            return {m: db.profiles(m) for m in models}
        finally:
            db.close()


def live_profiles(db_dir: pathlib.Path, models: Sequence[str]) -> dict:
    """The profiles a running scheduler whose model database is in ``db_dir`` holds, by model and
    device type (read-only SQLite)."""
    import sqlite3

    from common.profile import Profile

    db = sqlite3.connect(f"file:{pathlib.Path(db_dir) / 'nexus.db'}?mode=ro", uri=True)
    try:
        out: dict = {m: {} for m in models}
        for model, device_type, text in db.execute("SELECT model, device_type, profile_json FROM profiles"):
            if model in out:
                out[model][device_type] = Profile.from_json(text)
        return out
    finally:
        db.close()


def routing_epoch(metrics_url: str) -> int:
    """The plan epoch of the routing table a frontend holds, from its ``/metrics`` (-1 when unknown)."""
    if not metrics_url:
        return -1
    try:
        return int(scrape(metrics_url, timeout_s=5).value("nexus_routing_epoch", default=-1))
    except OSError:
        return -1


def wait_model_served(frontend: str, model: str, timeout_s: float = 60.0) -> None:
    """Until ``model`` is ready at ``frontend`` and answers an inference (random inputs from its metadata)."""
    from nexus.bench.loadgen import build_request

    with grpc.insecure_channel(frontend) as ch:
        stub = kserve_grpc.GRPCInferenceServiceStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if stub.ModelReady(kserve.ModelReadyRequest(name=model), timeout=5).ready:
                    metadata = stub.ModelMetadata(kserve.ModelMetadataRequest(name=model), timeout=5)
                    stub.ModelInfer(build_request(metadata, model=model), timeout=10)
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"{model} not served at {frontend} within {timeout_s:.0f} s")


class ServeCluster(Node):
    """``nexus serve DATA_DIR EXTRA...`` on free loopback ports: a scheduler, a frontend and backends under
    one supervising process. Returns once it printed its ready line; ``frontend``, ``scheduler`` and
    ``http`` are the addresses, ``info`` the ready line's ``key=value`` words, ``token`` the cluster
    token it made."""

    def __init__(self, data_dir: str | os.PathLike, *extra: str, timeout_s: float = 240.0, **node) -> None:
        self.data_dir = pathlib.Path(data_dir)
        super().__init__("nexus serve", ["serve", "--frontend-port", "0", "--scheduler-port", "0", "--metrics-port",
                                         "0", "--http-port", "0", "--data-dir", str(data_dir), *extra], **node)
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.frontend, self.scheduler = self.ready_fields[2:4]
        self.http = self.info.get("http", "")       # KServe v2 HTTP/REST HOST:PORT
        token_file = self.data_dir / "token"
        self.token = token_file.read_text().strip() if token_file.exists() else ""

    @property
    def creds(self) -> Credentials:
        """Credentials for admin calls from this process (the cluster token)."""
        return Credentials(token=self.token or None)

    def stop(self, timeout_s: float = 30.0) -> int:
        return super().stop(timeout_s)

    def upload(self, model: Upload, *, wait: bool = True, timeout_s: float = 120.0) -> None:
        upload_model(self.scheduler, model.path, model.name, profile_path=model.profile_path, slo_ms=model.slo_ms,
                     min_replicas=model.min_replicas, load=model.load, expected_rate_rps=model.expected_rate_rps,
                     creds=self.creds, late_requests=model.late_requests)
        if wait and model.load:
            self.wait_models_ready([model.name], timeout_s)

    def wait_models_ready(self, names: list[str], timeout_s: float = 120.0) -> None:
        pending = wait_models_ready(self.frontend, names, timeout_s, self.creds)
        if pending:
            raise RuntimeError(f"models not ready at {self.frontend} within {timeout_s:.0f} s: {pending}")

    def components(self) -> dict[str, int]:
        """The pids of the components it runs, by kind (``scheduler``, ``frontend``, ``backend``; the
        first of a kind)."""
        out: dict[str, int] = {}
        for pid in descendants(self.pid):
            words = f" {cmdline(pid)} "
            for kind in ("scheduler", "backend", "frontend"):
                if f" {kind} " in words:
                    out.setdefault(kind, pid)
        return out


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""

