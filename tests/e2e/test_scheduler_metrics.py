"""The scheduler's metrics port: nexus_desired_devices and nexus_registered_devices per device type,
the time its plans took to apply, and the same decision with its reason in GetStatus (in full, and the
scaling part alone that `nexus serve --backends auto` reads), on a live
scheduler with emulated backends."""

from __future__ import annotations

import os

import grpc
from harness.prometheus import scrape
from tests.components import wait_for

from common.pb import control, control_grpc
from nexus.launcher import Child
from nexus.scheduler_client import StatusReader


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """{(sample, its device_type label): value}."""
    return {(name, dict(lab).get("device_type", "")): v for (name, lab), v in scrape(url).samples.items()}


def _start(*argv: str) -> Child:
    child = Child(argv[0], list(argv), dict(os.environ, NEXUS_LOG="WARNING"), start_new_session=True)
    child.wait_ready(60)
    return child


def test_desired_and_registered_devices_are_served_and_follow_the_policy(tmp_path):
    scheduler = _start("scheduler", "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "db"),
                       "--min-devices", "t4=1", "--max-devices", "t4=3", "--scale-down-cooldown-s", "1")
    children = [scheduler]
    try:
        url = scheduler.info["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics") and ":8102/" not in url
        # Before any backend: the floor of the type named by --min-devices.
        assert wait_for(lambda: _scrape(url).get(("nexus_desired_devices", "t4")) == 1, 30, "one t4 desired")
        for _ in range(2):
            children.append(_start("backend", "--scheduler", scheduler.address, "--device", "emulated:t4"))
        assert wait_for(lambda: _scrape(url).get(("nexus_registered_devices", "t4")) == 2, 30, "two t4 registered")
        # Nothing to serve: one device is surplus, and goes after the (1 s) cool-down; one is the floor.
        metrics = wait_for(lambda: (m := _scrape(url)).get(("nexus_desired_devices", "t4")) == 1 and m, 30, "one t4 desired")
        assert metrics[("nexus_plan_devices", "t4")] == 0
        # each backend's registration was planned for and applied, and the apply timed
        assert metrics[("nexus_scheduler_plan_apply_seconds_count", "")] >= 1
        with grpc.insecure_channel(scheduler.address) as channel:
            status = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(), timeout=10)
        [decision] = status.scaling
        assert (decision.device_type, decision.desired, decision.registered) == ("t4", 1, 2)
        assert "--min-devices 1" in decision.reason and decision.drain_node_id.startswith("be-")
        assert decision.drain_node_id in {d.node_id for d in status.devices}
        # What nexus serve's actuator reads ten times a second: the same decision and devices, and none
        # of the rest (the routing table is built for the full reply only).
        with grpc.insecure_channel(scheduler.address) as channel:
            scaling = control_grpc.SchedulerStub(channel).GetStatus(control.StatusRequest(scaling_only=True),
                                                                   timeout=10)
        assert status.HasField("routing") and status.routing.epoch >= 1 and status.solver
        assert not scaling.HasField("routing") and not scaling.solver and not scaling.profiles
        assert [(d.device_type, d.desired, d.registered, d.reason) for d in scaling.scaling] == \
            [("t4", 1, 2, decision.reason)]
        assert sorted((d.node_id, d.address, d.device_type) for d in scaling.devices) == \
            sorted((d.node_id, d.address, d.device_type) for d in status.devices)
        reader = StatusReader(scheduler.address, 10.0, scaling_only=True)
        read = reader()
        reader.close()
        assert read.decision("t4").desired == 1 and len(read.devices) == 2
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
