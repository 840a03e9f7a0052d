"""`nexus serve --backends auto`'s actuator (nexus/local_scaler.py) without a cluster: what it does for
each decision of the scheduler's scaling policy, and the supervisor's retirement of a backend it
stopped on purpose (never restarted). The whole loop on real processes is tests/e2e/test_elastic.py."""

from __future__ import annotations

import argparse
import signal
import sys

import pytest

from common.config import ConfigError
from nexus import serve_cmd
from nexus.launcher import Child, Supervisor
from nexus.local_scaler import Drain, LocalBackend, LocalScaler, Start, drains, next_step
from nexus.scheduler_client import AdminCallError
from nexus.status_model import ClusterStatus, DeviceStatus, ScalingStatus


def _decision(desired: int, registered: int, drain: str | tuple[str, ...] = "",
              reason: str = "the plan uses 2") -> ScalingStatus:
    drains = (drain,) if isinstance(drain, str) and drain else tuple(drain)
    return ScalingStatus("t4", desired, registered, desired, desired, reason, drains)


def _ours(*addresses: str) -> list[LocalBackend]:
    return [LocalBackend(f"backend-{i}", a) for i, a in enumerate(addresses)]


REG = {"be-a": "127.0.0.1:1", "be-b": "127.0.0.1:2", "be-c": "127.0.0.1:3"}


def test_more_desired_starts_the_difference_at_once_within_the_maximum():
    assert next_step(_decision(3, 1, reason="why"), _ours("127.0.0.1:1"), {"be-a": "127.0.0.1:1"}, (1, 8)) == \
        Start(2, "why")
    # backends still starting (no address yet) count: nothing more to start
    assert next_step(_decision(3, 1), [*_ours("127.0.0.1:1"), LocalBackend("backend-1"), LocalBackend("backend-2")],
                     {"be-a": "127.0.0.1:1"}, (1, 8)) is None
    assert next_step(_decision(9, 1), _ours("127.0.0.1:1"), {"be-a": "127.0.0.1:1"}, (1, 4)) == \
        Start(3, "the plan uses 2")
    # a backend of the type that this process did not start counts towards the total
    assert next_step(_decision(2, 2), _ours("127.0.0.1:1"), {"be-a": "127.0.0.1:1", "be-x": "10.0.0.9:1"},
                     (1, 8)) is None
    assert next_step(None, _ours("127.0.0.1:1"), {}, (1, 8)) is None


def test_the_minimum_is_kept_even_before_the_policy_says_so():
    assert next_step(_decision(0, 0), [], {}, (2, 8)) == Start(2, "the plan uses 2")


def test_fewer_desired_drains_the_backends_the_policy_names_while_others_drain():
    ours = _ours("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert next_step(_decision(2, 3, drain="be-b", reason="surplus"), ours, REG, (1, 8)) == \
        Drain("backend-1", "be-b", "127.0.0.1:2", "surplus")
    draining = [ours[0], LocalBackend("backend-1", "127.0.0.1:2", retiring=True), ours[2]]
    # the next one goes while the first drains, down to the desired count and no further
    assert next_step(_decision(1, 3, drain="be-a"), draining, REG, (1, 8)) == \
        Drain("backend-0", "be-a", "127.0.0.1:1", "the plan uses 2")
    assert next_step(_decision(2, 3, drain="be-a"), draining, REG, (1, 8)) is None
    # a draining backend named again is not drained twice
    assert next_step(_decision(1, 3, drain="be-b"), draining, REG, (1, 8)) is None
    # none while a backend is still starting, none below the minimum, none without a name
    assert next_step(_decision(2, 3, drain="be-b"), [*ours, LocalBackend("backend-3")], REG, (1, 8)) is None
    assert next_step(_decision(2, 3, drain="be-b"), ours, REG, (3, 8)) is None
    assert next_step(_decision(2, 3), ours, REG, (1, 8)) is None


def test_the_whole_surplus_drains_together_in_the_policys_order():
    ours = _ours("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    decision = _decision(1, 3, drain=("be-c", "be-a"), reason="surplus")
    assert drains(decision, ours, REG, (1, 8)) == [Drain("backend-2", "be-c", "127.0.0.1:3", "surplus"),
                                                   Drain("backend-0", "be-a", "127.0.0.1:1", "surplus")]
    # one of them draining already: the other goes; both: nothing more
    one_draining = [ours[0], ours[1], LocalBackend("backend-2", "127.0.0.1:3", retiring=True)]
    assert drains(decision, one_draining, REG, (1, 8)) == [Drain("backend-0", "be-a", "127.0.0.1:1", "surplus")]
    both = [LocalBackend("backend-0", "127.0.0.1:1", retiring=True), ours[1], one_draining[2]]
    assert drains(decision, both, REG, (1, 8)) == []
    # never below the minimum, and none while a backend is still starting
    assert drains(decision, ours, REG, (2, 8)) == [Drain("backend-2", "be-c", "127.0.0.1:3", "surplus")]
    assert drains(decision, [*ours, LocalBackend("backend-3")], REG, (1, 8)) == []
    # a named backend of another process is left to it; the next named one of ours goes in its place
    # only while the count still needs it
    registered = {**REG, "be-x": "10.0.0.9:1"}
    assert drains(_decision(2, 4, drain=("be-x", "be-b")), ours, registered, (1, 8)) == \
        [Drain("backend-1", "be-b", "127.0.0.1:2", "the plan uses 2")]
    assert drains(_decision(3, 4, drain=("be-x",)), ours, registered, (1, 8)) == []


def test_a_backend_this_process_did_not_start_is_never_drained():
    ours = _ours("127.0.0.1:1", "127.0.0.1:2")
    registered = {"be-a": "127.0.0.1:1", "be-b": "127.0.0.1:2", "be-x": "10.0.0.9:1"}
    assert next_step(_decision(2, 3, drain="be-x"), ours, registered, (1, 8)) is None


class _FakeStatus:
    """GetStatus as the scaler reads it: one decision and the registered devices, or unreachable."""

    def __init__(self) -> None:
        self.decision: ScalingStatus | None = None
        self.devices: tuple[DeviceStatus, ...] = ()
        self.down = False

    def __call__(self) -> ClusterStatus:
        if self.down:
            raise AdminCallError("cannot reach the scheduler")
        return ClusterStatus(1, "squishy", 0.0, 0, 0, 1, self.devices, (),
                             scaling=(self.decision,) if self.decision else ())


_ANNOUNCE = "import sys, time; print('NEXUS-READY backend 127.0.0.1:' + sys.argv[1], flush=True); time.sleep(600)"


def test_the_scaler_starts_and_retires_processes_and_logs_why():
    lines: list[str] = []
    now = [0.0]
    supervisor = Supervisor(lines.append, clock=lambda: now[0])
    ports = iter(range(41001, 41010))

    def start(name: str) -> Child:
        return Child(name, ["-c", _ANNOUNCE, str(next(ports))], command=[sys.executable])

    status = _FakeStatus()
    scaler = LocalScaler(supervisor, start, "t4", (1, 4), status, lines.append, drain_timeout_s=30,
                         clock=lambda: now[0])
    try:
        first = supervisor.add(scaler.add(start("backend-0")))
        first.wait_ready(30)
        status.decision = _decision(3, 1, reason="demand outruns the plan")
        status.devices = (DeviceStatus("be-a", "emulated:t4", "t4", 0, 0, (), address=first.address),)
        scaler.step()
        assert [c.name for c in scaler.backends] == ["backend-0", "backend-1", "backend-2"]
        assert "t4: 3 devices desired, 1 registered: demand outruns the plan" in lines
        assert sum("adding backend-" in line and "demand outruns the plan" in line for line in lines) == 2
        for c in scaler.backends:
            c.wait_ready(30)
        now[0] += 1
        scaler.step()
        assert sum(" started (pid " in line for line in lines) == 2
        # the scheduler restarting: nothing changes
        status.down = True
        now[0] += 1
        scaler.step()
        assert len(scaler.backends) == 3 and not supervisor.retiring
        status.down = False
        status.devices = tuple(DeviceStatus(f"be-{c.name[-1]}", "emulated:t4", "t4", 0, 0, (), address=c.address)
                               for c in scaler.backends)
        status.decision = _decision(2, 3, drain="be-1", reason="surplus for 60 s: remove one")
        now[0] += 1
        scaler.step()
        [retired] = supervisor.retiring
        assert retired.name == "backend-1"
        assert any(line.startswith("removing backend-1 (be-1 at ") and "surplus for 60 s" in line for line in lines)
        retired.proc.wait(30)                      # SIGTERM ends the stand-in at once
        now[0] += 1
        supervisor.check()
        scaler.step()
        assert retired.starts == 1 and retired not in supervisor.children
        assert any(line.startswith("backend-1 (pid ") and "stopped, exit status" in line for line in lines)
        assert [c.name for c in scaler.backends] == ["backend-0", "backend-2"]
    finally:
        supervisor.stop_all()


def test_a_retired_child_that_ignores_sigterm_is_killed_after_its_time_and_never_restarted():
    lines: list[str] = []
    now = [0.0]
    supervisor = Supervisor(lines.append, initial_s=0.1, clock=lambda: now[0])
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('NEXUS-READY backend 127.0.0.1:1', flush=True); time.sleep(600)")
    child = supervisor.add(Child("backend-0", ["-c", stubborn], command=[sys.executable]))
    other = supervisor.add(Child("frontend", ["-c", _ANNOUNCE, "2"], command=[sys.executable]))
    late = supervisor.add(Child("backend-1", ["-c", _ANNOUNCE, "3"], command=[sys.executable]), stop_after=other)
    try:
        child.wait_ready(30)
        supervisor.retire(child, timeout_s=5)
        supervisor.check()
        assert child.running() and supervisor.retiring == [child]
        now[0] += 6
        supervisor.check()
        assert any("did not exit within its time to drain" in line for line in lines)
        child.proc.wait(30)
        assert child.proc.returncode == -signal.SIGKILL
        for _ in range(3):
            now[0] += 10
            supervisor.check()
        assert child.starts == 1 and child not in supervisor.children
        # a backend added while the cluster runs stops after the frontend (stop_all goes last-added first)
        assert supervisor.children == [late, other]
    finally:
        supervisor.stop_all()


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_auto_bounds_default_to_the_cores_on_cpu_and_8_on_emulated_gpus():
    import os

    args = _serve_args("--backends", "auto")
    _, backend, _ = serve_cmd.configs(args)
    assert serve_cmd.auto_backends(args, backend) == serve_cmd.AutoBackends("cpu", 1, len(os.sched_getaffinity(0)))
    args = _serve_args("--backends", "auto", "--device", "emulated:t4", "--min-backends", "2")
    _, backend, _ = serve_cmd.configs(args)
    assert serve_cmd.auto_backends(args, backend) == serve_cmd.AutoBackends("t4", 2, 8)
    args = _serve_args("--backends", "3")
    assert serve_cmd.auto_backends(args, serve_cmd.configs(args)[1]) is None


@pytest.mark.parametrize("argv, message", [
    (["--backends", "3", "--max-backends", "4"], "--max-backends needs --backends auto"),
    (["--backends", "auto", "--min-backends", "0"], "--min-backends: must be at least 1"),
    (["--backends", "auto", "--min-backends", "3", "--max-backends", "2"], "--max-backends 2 is below --min-backends 3"),
    (["--backends", "auto", "--max-devices", "4"], "--max-devices with --backends auto: use --min-backends"),
    (["--backends", "auto", "--device", "cuda:0"], "--backends auto starts backends on cpu or emulated"),
])
def test_bad_auto_flags_are_refused_naming_the_flag(argv, message):
    args = _serve_args(*argv)
    with pytest.raises(ConfigError, match=message):
        serve_cmd.auto_backends(args, serve_cmd.configs(args)[1])


def test_backends_is_a_count_or_auto(capsys):
    with pytest.raises(SystemExit):
        _serve_args("--backends", "many")
    assert "expected a number of backends (0 or more) or 'auto', got 'many'" in capsys.readouterr().err


def test_a_bad_auto_flag_stops_serve_before_anything_starts(tmp_path, capsys):
    args = _serve_args("--data-dir", str(tmp_path), "--backends", "auto", "--min-backends", "0")
    assert serve_cmd.run(args) == 2
    assert "--min-backends: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "db").exists()
