"""The scheduler's metrics port: nexus_desired_devices and nexus_registered_devices per device type,
and the same decision with its reason in GetStatus, on a live scheduler with emulated backends."""

from __future__ import annotations

import os
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from common.pb import control, control_grpc
from nexus.launcher import Child


def _scrape(url: str) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, s.labels.get("device_type", "")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _start(*argv: str) -> Child:
    child = Child(argv[0], list(argv), dict(os.environ, NEXUS_LOG="WARNING"), start_new_session=True)
    child.wait_ready(60)
    return child


def _until(condition, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout_s} s")


def test_desired_and_registered_devices_are_served_and_follow_the_policy(tmp_path):
    scheduler = _start("scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "db"),
                       "--min-devices", "t4=1", "--max-devices", "t4=3", "--scale-down-cooldown-s", "1")
    children = [scheduler]
    try:
        url = scheduler.info["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics") and ":8102/" not in url
        # Before any backend: the floor of the type named by --min-devices.
        assert _until(lambda: _scrape(url).get(("nexus_desired_devices", "t4")) == 1)
        for _ in range(2):
            children.append(_start("backend", "--scheduler", scheduler.address, "--device", "emulated:t4"))
        assert _until(lambda: _scrape(url).get(("nexus_registered_devices", "t4")) == 2)
        # Nothing to serve: one device is surplus, and goes after the (1 s) cool-down; one is the floor.
        metrics = _until(lambda: (m := _scrape(url)).get(("nexus_desired_devices", "t4")) == 1 and m)
        assert metrics[("nexus_plan_devices", "t4")] == 0
        with grpc.insecure_channel(scheduler.address) as channel:
            status = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(), timeout=10)
        [decision] = status.scaling
        assert (decision.device_type, decision.desired, decision.registered) == ("t4", 1, 2)
        assert "--min-devices 1" in decision.reason and decision.drain_node_id.startswith("be-")
        assert decision.drain_node_id in {d.node_id for d in status.devices}
    finally:
        for c in reversed(children):
            c.stop(timeout_s=20)


def test_a_busy_metrics_port_stops_the_scheduler_with_a_message(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "nexus", "scheduler", "--listen", "127.0.0.1:0", "--data-dir",
                               str(tmp_path), "--metrics-listen", f"127.0.0.1:{port}"],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"cannot serve --metrics-listen 127.0.0.1:{port}" in done.stderr
