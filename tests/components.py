"""Separately started components (scheduler, frontend, backends) as real processes, for tests that
kill one of them; and an open-loop load of raw KServe requests that records every request's status."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from common.pb import control, control_grpc, kserve, kserve_grpc
from nexus.launcher import Child


@dataclass
class Component:
    kind: str
    proc: subprocess.Popen
    address: str

    def kill(self) -> None:
        """``kill -9``: no goodbye to anyone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


def start(kind: str, *args: str, timeout_s: float = 120) -> Component:
    """Run ``nexus KIND ARGS`` through the project's launcher; return once it printed its ready line."""
    env = dict(os.environ, NEXUS_LOG=os.environ.get("NEXUS_LOG", "WARNING"))
    child = Child(kind, [kind, *args], env, start_new_session=True)
    try:
        address = child.wait_ready(timeout_s)
    except RuntimeError:
        child.proc.kill()
        child.proc.wait()
        raise
    return Component(kind, child.proc, address)


@dataclass
class Cluster:
    scheduler: Component
    frontend: Component
    backends: list[Component] = field(default_factory=list)

    def stop(self) -> None:
        for c in [self.frontend, *self.backends, self.scheduler]:
            c.stop()

    def serving(self, model: str) -> list[Component]:
        """The live backends that have ``model`` loaded (from their Stats)."""
        out = []
        for b in self.backends:
            if b.proc.poll() is not None:
                continue
            with grpc.insecure_channel(b.address) as ch:
                stats = control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=5)
            if any(s.model == model for s in stats.sessions):
                out.append(b)
        return out

    def executed(self, model: str) -> int:
        """Rows of ``model`` executed, summed over the live backends."""
        total = 0
        for b in self.backends:
            if b.proc.poll() is not None:
                continue
            with grpc.insecure_channel(b.address) as ch:
                stats = control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=5)
            total += sum(s.inference_count for s in stats.sessions if s.model == model)
        return total


def start_cluster(data_dir, backends: int, device: str, scheduler_args=(), backend_args=()) -> Cluster:
    sched = start("scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(data_dir), *scheduler_args)
    started = [sched]
    try:
        fe = start("frontend", "--scheduler", sched.address, "--listen", "127.0.0.1:0", "--report-interval-s", "0.5")
        started.append(fe)
        bes = []
        for _ in range(backends):
            bes.append(start("backend", "--scheduler", sched.address, "--device", device, *backend_args))
            started.append(bes[-1])
        return Cluster(sched, fe, bes)
    except BaseException:
        for c in started:
            c.kill()
        raise


def infer_request(model: str, features: int = 64, timeout_us: int = 0) -> kserve.ModelInferRequest:
    req = kserve.ModelInferRequest(model_name=model)
    req.inputs.add(name="input", datatype="FP32", shape=[1, features])
    req.raw_input_contents.append(np.zeros((1, features), np.float32).tobytes())
    if timeout_us:
        req.parameters["timeout"].int64_param = timeout_us
    return req


def wait_ready(frontend: str, model: str, timeout_s: float = 60, features: int = 64) -> None:
    with grpc.insecure_channel(frontend) as ch:
        stub = kserve_grpc.GRPCInferenceServiceStub(ch)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stub.ModelReady(kserve.ModelReadyRequest(name=model), timeout=5).ready:
                try:
                    stub.ModelInfer(infer_request(model, features), timeout=10)
                    return
                except grpc.RpcError:
                    pass
            time.sleep(0.2)
    raise AssertionError(f"{model} not ready in {timeout_s} s")


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


@dataclass
class LoadResult:
    sent: int
    codes: dict[str, int]                 # status name -> requests
    send_times: list[float]               # monotonic send time per request
    done_times: list[float]               # monotonic completion time per request
    statuses: list[str]

    @property
    def failed(self) -> int:
        return self.sent - self.codes.get("OK", 0)


class OpenLoop:
    """Requests at a steady rate from a thread; every request's status and times are kept."""

    def __init__(self, frontend: str, model: str, rate_rps: float, client_timeout_s: float = 10.0) -> None:
        self.channel = grpc.insecure_channel(frontend)
        self.stub = kserve_grpc.GRPCInferenceServiceStub(self.channel)
        self.model, self.rate, self.timeout = model, rate_rps, client_timeout_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.send_times: list[float] = []
        self.done_times: list[float] = []
        self.statuses: list[str | None] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "OpenLoop":
        self._thread.start()
        return self

    def in_flight(self) -> int:
        with self._lock:
            return sum(1 for s in self.statuses if s is None)

    def last_answered(self, n: int) -> list[tuple[str, float]]:
        """(status, send time) of the last ``n`` answered requests, in sending order."""
        with self._lock:
            done = [(s, t) for s, t in zip(self.statuses, self.send_times) if s is not None]
        return done[-n:]

    def _run(self) -> None:
        req = infer_request(self.model)
        t0 = time.monotonic()
        i = 0
        while not self._stop.is_set():
            at = t0 + i / self.rate
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with self._lock:
                k = len(self.statuses)
                self.statuses.append(None)
                self.send_times.append(time.monotonic())
                self.done_times.append(0.0)
            future = self.stub.ModelInfer.future(req, timeout=self.timeout)
            future.add_done_callback(lambda f, k=k: self._done(k, f))
            i += 1

    def _done(self, k: int, future) -> None:
        code = future.code()
        with self._lock:
            self.statuses[k] = code.name if code is not None else "UNKNOWN"
            self.done_times[k] = time.monotonic()

    def stop(self, drain_s: float = 15.0) -> LoadResult:
        self._stop.set()
        self._thread.join()
        deadline = time.monotonic() + drain_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.channel.close()
        with self._lock:
            statuses = [s or "NO_RESPONSE" for s in self.statuses]
        codes: dict[str, int] = {}
        for s in statuses:
            codes[s] = codes.get(s, 0) + 1
        return LoadResult(len(statuses), codes, list(self.send_times), list(self.done_times), statuses)
