"""Shared fixtures: real local clusters started as separate processes on free loopback ports."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

READY_PREFIX = "NEXUS-READY"


class RunningCluster:
    def __init__(self, proc: subprocess.Popen, frontend: str, scheduler: str, data_dir,
                 info: dict[str, str] | None = None) -> None:
        self.proc = proc
        self.frontend = frontend
        self.scheduler = scheduler
        self.data_dir = data_dir
        self.info = info or {}         # key=value words of the ready line (metrics=URL, http=HOST:PORT)
        self.http = self.info.get("http", "")    # KServe v2 HTTP/REST HOST:PORT

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_cluster(data_dir, *extra: str, timeout_s: float = 240) -> RunningCluster:
    """Run ``nexus serve`` on free ports; return once it printed its ready line."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NEXUS_LOG=os.environ.get("NEXUS_LOG", "WARNING"))
    proc = subprocess.Popen([sys.executable, "-m", "nexus", "serve", "--frontend-port", "0", "--scheduler-port", "0",
                             "--metrics-port", "0", "--http-port", "0", "--data-dir", str(data_dir), *extra],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                raise RuntimeError(f"nexus serve exited with {proc.returncode}: {''.join(seen)}") from None
            continue
        seen.append(line)
        if line.startswith(READY_PREFIX):
            words = line.split()
            info = dict(w.split("=", 1) for w in words[4:] if "=" in w)
            return RunningCluster(proc, words[2], words[3], data_dir, info)
    proc.kill()
    raise RuntimeError(f"nexus serve not ready in {timeout_s} s: {''.join(seen)}")


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
    return subprocess.run([sys.executable, "-m", "nexus", *args], capture_output=True, text=True, timeout=timeout_s)
