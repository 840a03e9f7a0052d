"""`nexus serve` stops every process it started, on SIGTERM and on SIGINT (Ctrl-C), however it was
started; it restarts no child on the way down, logs no warning for a normal stop, and confirms it."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from common.pb import kserve, kserve_grpc
from nexus.launcher import Child, nexus_command
from nexus.process import PARENT_PID_ENV
from tests.components import alive
from tests.conftest import start_serve

pytestmark = pytest.mark.slow


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = set(), [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.add(child)
            stack.append(child)
    return out


def _wait_serving(frontend: str) -> None:
    """Until the frontend holds its first routing table (KServe ServerReady): a table push still in
    flight when the frontend leaves is cut short, which the scheduler reports as a warning."""
    with grpc.insecure_channel(frontend) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        deadline = time.monotonic() + 60
        while not stub.ServerReady(kserve.ServerReadyRequest(), timeout=10).ready:
            assert time.monotonic() < deadline, "the frontend got no routing table within 60 s"
            time.sleep(0.1)


def _stopped_quietly(log: str) -> None:
    """A normal stop: no warning or error from any process, no restart, and a confirmed last line."""
    lines = log.splitlines()
    noise = [line for line in lines if any(w in line for w in ("WARNING", "ERROR", "warning", "error", "restart"))]
    assert not noise, log
    assert lines and lines[-1].startswith("nexus serve: stopped: every process exited cleanly"), log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_leaves_no_process_behind(tmp_path, sig):
    log = tmp_path / "serve.log"
    with open(log, "w") as err:        # the children log warnings and errors (NEXUS_LOG=WARNING)
        cluster = start_serve(tmp_path / "data", "--backends", "2", "--no-samples", stderr=err)
    children = _descendants(cluster.proc.pid)
    assert len(children) >= 4, children      # scheduler, frontend, two backends
    _wait_serving(cluster.frontend)
    cluster.proc.send_signal(sig)
    assert cluster.proc.wait(timeout=60) == 0
    left = [pid for pid in children if alive(pid)]
    assert not left, f"processes left behind: {left}"
    _stopped_quietly(log.read_text())


def test_serve_started_as_a_background_job_stops_on_sigint_to_its_group(tmp_path):
    """A script's `setsid nexus serve ... &` may inherit SIGINT ignored (a shell without job control
    ignores it in background jobs, though not every bash does; the job's `trap "" INT` makes the
    premise hold everywhere). SIGINT to its process group still stops it, in order, and no
    child is restarted as if it had crashed. Started as a user would, with no NEXUS_LOG, the start
    shows only `nexus serve`'s own lines: the components' INFO chatter stays out of sight."""
    pid_file, log = tmp_path / "serve.pid", tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "NEXUS_LOG"}
    job = Child("background job", ["serve", "--backends", "1", "--no-samples", "--frontend-port", "0",
                                   "--scheduler-port", "0", "--metrics-port", "0", "--http-port", "0",
                                   "--data-dir", str(tmp_path / "data")], env,
                command=["bash", "-c", f'trap "" INT; unset {PARENT_PID_ENV}; setsid "$@" 2>{log} & echo $! >{pid_file}; wait $!',
                         "bash", *nexus_command()])
    serve = 0
    try:
        job.wait_ready(240)
        serve = int(pid_file.read_text())
        started = log.read_text()
        assert started.splitlines() and all(line.startswith("nexus serve: ") for line in started.splitlines()), started
        children = _descendants(serve)
        assert len(children) >= 3, children
        _wait_serving(job.ready_fields[2])
        os.killpg(serve, signal.SIGINT)
        assert job.proc.wait(timeout=60) == 0
        left = [pid for pid in children if alive(pid)]
        assert not left, f"processes left behind: {left}"
        _stopped_quietly(log.read_text())
    finally:
        if serve and alive(serve):     # the test failed: stop what it started
            os.kill(serve, signal.SIGTERM)
        job.stop(timeout_s=60)
