"""``nexus serve --cpu-layout auto``'s actuator (nexus/cpu_layout_switch.py) with stand-in backend
processes and a scripted ``GetStatus``: it measures each served model once per version, stores the
new layout's profiles before starting its backends, drains the old ones only once the new ones are
registered and profiled, calls a switch off when they are not in time, puts it off when the
scheduler refuses a profile, and tries a failed measurement again later. The whole loop on a real
cluster is tests/e2e/test_cpu_layout.py."""

from __future__ import annotations

import concurrent.futures
import sys
from dataclasses import replace

from common.pb import control
from common.profile import Profile
from nexus.cpu_layout import PER_CORE_DEVICE_TYPE, CpuLayout, LayoutConfig, LayoutShape, ServingPath, layout_shapes
from nexus.cpu_layout_switch import CpuLayoutSwitch
from nexus.launcher import Child, Supervisor
from nexus.scheduler_client import AdminCallError
from nexus.status_model import ClusterStatus, DeviceStatus, ProfileStatus, SessionStatus

_ANNOUNCE = "import sys, time; print('NEXUS-READY backend 127.0.0.1:' + sys.argv[1], flush=True); time.sleep(600)"
SHAPES = layout_shapes(2)
FAST = LayoutConfig(margin=0.15, hold_s=0.0, cooldown_s=60.0)
PROFILES = {2: Profile.linear(2.0, 1.0, 32), 1: Profile.linear(2.8, 1.4, 32)}     # by intra-op threads


class _Scheduler:
    """GetStatus, ListModels and AddProfile as the actuator sees them."""

    def __init__(self) -> None:
        self.devices: tuple[DeviceStatus, ...] = ()
        self.profiles: tuple[ProfileStatus, ...] = ()
        self.version = 1
        self.stored: list[tuple[str, int, Profile]] = []
        self.refuse = ""

    def status(self) -> ClusterStatus:
        return ClusterStatus(1, "squishy", 0.0, 1, 1, 1, self.devices, (), profiles=self.profiles)

    def models(self) -> list[control.ModelDesc]:
        return [control.ModelDesc(name="m", version=self.version)]

    def add_profile(self, name: str, version: int, profile: Profile) -> None:
        if self.refuse:
            raise AdminCallError(self.refuse)
        self.stored.append((name, version, profile))

    def serving(self, children: list[Child], device_type: str) -> None:
        session = SessionStatus("m", "m", 4, 6.0, 0.3, 100.0, 300.0, 300.0, 100.0, 10.0)
        self.devices = tuple(DeviceStatus(f"be-{c.name}", "cpu", device_type, 1000.0, 20.0, (session,),
                                          address=c.address) for c in children)

    def profiled(self, device_type: str) -> None:
        self.profiles = (*self.profiles, ProfileStatus("m", device_type, "table", False, (), (), (), "", 0, 0, 0.0, ""))


class _Path:
    """The serving path as the actuator reads it: set by the test; which backends and frontends it named."""

    def __init__(self) -> None:
        self.path = ServingPath()
        self.pids: list[tuple[list[int], list[int]]] = []
        self.resets = 0

    def sample(self, backend_pids, frontend_pids) -> ServingPath:
        self.pids.append((sorted(backend_pids), sorted(frontend_pids)))
        return self.path

    def reset(self) -> None:
        self.resets += 1


class _Rig:
    def __init__(self, running: CpuLayout = CpuLayout.MACHINE, measure=None) -> None:
        self.lines: list[str] = []
        self.now = [0.0]
        self.supervisor = Supervisor(self.lines.append, clock=lambda: self.now[0])
        self.ports = iter(range(42001, 42020))
        self.scheduler = _Scheduler()
        self.measured: list[tuple[str, int, int]] = []
        self.started: list[tuple[str, LayoutShape]] = []
        self.path = _Path()
        first = [self.supervisor.add(self.start(SHAPES[running], f"backend-{i}"))
                 for i in range(SHAPES[running].devices)]
        self.frontend = self.supervisor.add(Child("frontend", ["-c", _ANNOUNCE, str(next(self.ports))],
                                                  command=[sys.executable]))
        for c in (*first, self.frontend):
            c.wait_ready(30)
        self.switch = CpuLayoutSwitch(self.supervisor, self.start, SHAPES, running, first, self.scheduler.status,
                                      self.scheduler.models, measure or self.measure, self.scheduler.add_profile,
                                      self.lines.append, cores=2, drain_timeout_s=30, config=FAST, poll_s=1.0,
                                      switch_timeout_s=30.0, clock=lambda: self.now[0], path_meter=self.path,
                                      frontends=[self.frontend])
        self.first = first

    def start(self, shape: LayoutShape, name: str) -> Child:
        self.started.append((name, shape))
        return Child(name, ["-c", _ANNOUNCE, str(next(self.ports))], command=[sys.executable])

    def measure(self, address: str, desc: control.ModelDesc, threads: int) -> Profile:
        self.measured.append((desc.name, desc.version, threads))
        return PROFILES[threads]

    def tick(self, seconds: float = 1.0) -> None:
        self.now[0] += seconds
        self.supervisor.check()
        self.switch.step()
        if self.switch._measuring is not None:
            concurrent.futures.wait([self.switch._measuring[2]], 30)    # the worker's measurement, then collected
            self.switch.step()

    def close(self) -> None:
        self.switch.close()
        self.supervisor.stop_all()


def test_it_measures_stores_the_new_profiles_starts_the_new_layout_and_drains_the_old_once_ready():
    rig = _Rig()
    try:
        rig.scheduler.serving(rig.first, "cpu")
        rig.scheduler.profiled("cpu")
        rig.tick()
        assert rig.measured == [("m", 1, 2), ("m", 1, 1), ("m", 1, 1), ("m", 1, 2)]     # in turn, twice
        assert any(line.startswith("cpu layout: measured m (typical): machine l(1)=3 ms") for line in rig.lines)
        rig.tick()
        # the per-core profile went to the scheduler, for its device type, before its backends started
        [(name, version, stored)] = rig.scheduler.stored
        assert (name, version, stored.device_type) == ("m", 1, PER_CORE_DEVICE_TYPE)
        assert stored.rows == PROFILES[1].rows
        assert [(n, s.layout) for n, s in rig.started[1:]] == [("backend-1", CpuLayout.PER_CORE),
                                                              ("backend-2", CpuLayout.PER_CORE)]
        assert any(line.startswith("cpu layout: switch to per-core: machine: ") for line in rig.lines)
        new = [c for c in rig.supervisor.children if c.name in ("backend-1", "backend-2")]
        for c in new:
            c.wait_ready(30)
        # registered, but the scheduler holds no profile for cpu-1t yet: the old backend stays
        rig.scheduler.serving([*rig.first, *new[:1]], "cpu")
        rig.scheduler.devices = (*rig.scheduler.devices[:1], *(
            DeviceStatus(f"be-{c.name}", "cpu", PER_CORE_DEVICE_TYPE, 1000.0, 20.0, (), address=c.address) for c in new))
        rig.tick()
        assert not rig.supervisor.retiring
        rig.scheduler.profiled(PER_CORE_DEVICE_TYPE)
        rig.tick()
        assert rig.supervisor.retiring == rig.first
        assert any(line.startswith("cpu layout: now per-core (2 backend(s) registered") for line in rig.lines)
        assert rig.switch.running is CpuLayout.PER_CORE
        # a model is measured once per version: a new version is measured again
        rig.scheduler.serving(new, PER_CORE_DEVICE_TYPE)
        rig.tick()
        assert len(rig.measured) == 4
        rig.scheduler.version = 2
        rig.tick()
        assert rig.measured[4:] == [("m", 2, 2), ("m", 2, 1), ("m", 2, 1), ("m", 2, 2)]
    finally:
        rig.close()


def test_a_switch_whose_backends_are_not_ready_in_time_is_called_off_and_cooled_down():
    rig = _Rig()
    try:
        rig.scheduler.serving(rig.first, "cpu")
        rig.scheduler.profiled("cpu")
        rig.tick()
        rig.tick()
        new = [c for c in rig.supervisor.children if c not in (*rig.first, rig.frontend)]
        assert len(new) == 2
        rig.tick(31.0)                 # never registered
        assert set(rig.supervisor.retiring) == set(new)
        assert rig.first[0] in rig.supervisor.children and rig.first[0] not in rig.supervisor.retiring
        assert any("switch to per-core called off after 30 s (registered 0 of 2" in line for line in rig.lines)
        assert rig.switch.running is CpuLayout.MACHINE
        rig.tick()
        assert len(rig.started) == 3                       # nothing new within the cool-down
        assert any("within 60 s of the last switch" in line for line in rig.lines)
    finally:
        rig.close()


def test_a_refused_profile_puts_the_switch_off_and_starts_nothing():
    rig = _Rig()
    try:
        rig.scheduler.refuse = "the scheduler is not the leader"
        rig.scheduler.serving(rig.first, "cpu")
        rig.tick()
        rig.tick()
        assert len(rig.started) == 1
        assert any("switch to per-core put off: storing m's profile for cpu-1t failed (the scheduler is not the "
                   "leader)" in line for line in rig.lines)
        assert rig.switch.running is CpuLayout.MACHINE
    finally:
        rig.close()


def test_a_failed_measurement_is_said_once_and_tried_again_later():
    calls = []

    def failing(address: str, desc: control.ModelDesc, threads: int) -> Profile:
        calls.append(threads)
        raise RuntimeError("ProfileModel: the backend is draining")

    rig = _Rig(measure=failing)
    try:
        rig.scheduler.serving(rig.first, "cpu")
        rig.tick()
        assert calls == [2]
        assert any("cpu layout: measuring m failed (ProfileModel: the backend is draining); again in 60 s" in line
                   for line in rig.lines)
        rig.tick(30.0)
        assert calls == [2]
        rig.tick(31.0)
        assert calls == [2, 2]
        assert len(rig.started) == 1
    finally:
        rig.close()


def _with_medians(profile: Profile, median_per_item_ms: float, median_fixed_ms: float) -> Profile:
    return Profile(tuple(replace(r, median_ms=median_fixed_ms + median_per_item_ms * r.batch) for r in profile.rows),
                   profile.device_type)


def test_the_typical_runs_decide_and_the_scheduler_is_given_the_conservative_profile():
    # per-core's tails (the conservative figure takes a preempted run in ten) leave it 1.11x machine's
    # room, inside the margin; its medians, one thread 1.4x slower on two cores, 1.45x
    tails = {2: _with_medians(Profile.linear(2.0, 1.0, 32), 1.6, 0.4),
             1: _with_medians(Profile.linear(3.6, 2.0, 32), 2.2, 0.8)}

    def measure(address: str, desc: control.ModelDesc, threads: int) -> Profile:
        return tails[threads]

    rig = _Rig(measure=measure)
    try:
        rig.scheduler.serving(rig.first, "cpu")
        rig.scheduler.profiled("cpu")
        rig.tick()
        assert any(line.startswith("cpu layout: measured m (typical): machine l(1)=2.3 ms, l(32)=59.3 ms; "
                                   "per-core l(1)=3.45 ms") for line in rig.lines), rig.lines
        rig.tick()
        assert any(line.startswith("cpu layout: switch to per-core: ") for line in rig.lines), rig.lines
        [(_, _, stored)] = rig.scheduler.stored
        assert [r.latency_ms for r in stored.rows] == [r.latency_ms for r in tails[1].rows]
    finally:
        rig.close()


def test_with_the_tails_alone_it_stays():
    tails = {2: Profile.linear(2.0, 1.0, 32), 1: Profile.linear(3.6, 2.0, 32)}
    rig = _Rig(measure=lambda address, desc, threads: tails[threads])
    try:
        rig.scheduler.serving(rig.first, "cpu")
        rig.scheduler.profiled("cpu")
        rig.tick()
        rig.tick()
        assert any(line.startswith("cpu layout: stay machine: ") for line in rig.lines), rig.lines
        assert not rig.scheduler.stored and len(rig.started) == 1
    finally:
        rig.close()


def test_the_serving_paths_cpu_takes_its_share_and_its_readings_restart_with_the_backends():
    # the tails of the test above: inside the margin on the profiles alone; a path of 0.5 cores at
    # these rates leaves machine 0.5 of its device and per-core 1.5 of its 2
    tails = {2: Profile.linear(2.0, 1.0, 32), 1: Profile.linear(3.6, 2.0, 32)}
    rig = _Rig(measure=lambda address, desc, threads: tails[threads])
    try:
        rig.path.path = ServingPath(fixed_cores=0.1, rate_cores=0.4)
        rig.scheduler.serving(rig.first, "cpu")
        rig.scheduler.profiled("cpu")
        rig.tick()
        rig.tick()
        line = next(line for line in rig.lines if line.startswith("cpu layout: switch to per-core: "))
        assert "of 1 devices, 0.50 left beside the path's 0.50 cores (" in line, line
        assert "of 2 devices, 1.50 left beside the path's 0.50 cores (" in line, line
        # the running backends are not the path; the frontends' part of it grows with the rates
        assert rig.path.pids[-1] == ([rig.first[0].proc.pid], [rig.frontend.proc.pid])
        assert rig.path.resets == 1                                # the switch started: new readings
    finally:
        rig.close()
