"""Shared fixtures: real local clusters started as separate processes on free loopback ports."""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

READY_PREFIX = "NEXUS-READY"
# scheduler address -> the cluster token `nexus serve` made: nexus_cli sends it, as an operator would
_CLUSTER_TOKENS: dict[str, str] = {}


class RunningCluster:
    def __init__(self, proc: subprocess.Popen, frontend: str, scheduler: str, data_dir,
                 info: dict[str, str] | None = None) -> None:
        self.proc = proc
        self.frontend = frontend
        self.scheduler = scheduler
        self.data_dir = data_dir
        self.info = info or {}         # key=value words of the ready line (metrics=URL, http=HOST:PORT)
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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def stop_process(proc: subprocess.Popen, timeout_s: float = 30) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def start_cluster(data_dir, *extra: str, timeout_s: float = 240, stderr=None) -> RunningCluster:
    """Run ``nexus serve`` on free ports; return once it printed its ready line. ``stderr``: where the
    logs of serve and its components go (default: the test's)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NEXUS_LOG=os.environ.get("NEXUS_LOG", "WARNING"))
    proc = subprocess.Popen([sys.executable, "-m", "nexus", "serve", "--frontend-port", "0", "--scheduler-port", "0",
                             "--metrics-port", "0", "--http-port", "0", "--data-dir", str(data_dir), *extra],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True, stderr=stderr)
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


class NexusProcess:
    """``nexus ARGV`` with its log (stderr) in a file; the address from its ready line."""

    def __init__(self, log_path: pathlib.Path, *argv: str, env: dict | None = None) -> None:
        self.log_path = log_path
        self.log = log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "nexus", *argv], stdout=subprocess.PIPE,
                                     stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "NEXUS_LOG": "INFO", **(env or {})})
        line = self.proc.stdout.readline()
        assert line.startswith(READY_PREFIX), (line, self.logs())
        self.address = line.split()[2]

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def nexus_cli(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Run the ``nexus`` command as a user would; against a cluster started by :func:`start_cluster`,
    with its token in ``$NEXUS_TOKEN``, as its operator would."""
    env = None
    if "--scheduler" in args and "--token-file" not in args:
        token = _CLUSTER_TOKENS.get(args[args.index("--scheduler") + 1])
        env = dict(os.environ, NEXUS_TOKEN=token) if token else None
    return subprocess.run([sys.executable, "-m", "nexus", *args], capture_output=True, text=True, timeout=timeout_s,
                          env=env)
