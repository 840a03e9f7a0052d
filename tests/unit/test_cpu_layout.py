"""The CPU layout policy (nexus/cpu_layout.py) on a fake clock, with linear profiles: which layout the
loads pick, the margin, the hold, the cool-down, a session one layout cannot serve; and how the
actuator reads sessions from the scheduler's status (nexus/cpu_layout_switch.py)."""

from __future__ import annotations

import argparse

import pytest

from common.config import BackendConfig, ConfigError
from common.profile import BatchLatency, Profile, ProfileError
from nexus import serve_cmd
from nexus.cpu_layout import (PER_CORE_DEVICE_TYPE, CpuLayout, LayoutConfig, LayoutState, ServingPath, SessionDemand,
                              decide, layout_load, layout_shapes, left_devices)
from nexus.cpu_layout_switch import faster_rows, session_demands, typical
from nexus.status_model import ClusterStatus, DeviceStatus, SessionStatus

SHAPES = layout_shapes(2)
CONFIG = LayoutConfig(margin=0.15, hold_s=10.0, cooldown_s=60.0)
# intra-op threads scale less than linearly: two threads make a batch 1.4x faster, not 2x
MACHINE = Profile.linear(2.0, 1.0, 32)
ONE_THREAD = Profile.linear(2.8, 1.4, 32)


def _demand(rate_rps: float, slo_ms: float = 100.0, machine: Profile | None = MACHINE,
            per_core: Profile | None = ONE_THREAD, name: str = "m") -> SessionDemand:
    return SessionDemand(name, name, slo_ms, rate_rps, {CpuLayout.MACHINE: machine, CpuLayout.PER_CORE: per_core})


def test_shapes_name_their_threads_and_device_types():
    assert SHAPES[CpuLayout.MACHINE].devices == 1 and SHAPES[CpuLayout.MACHINE].threads == 0
    assert SHAPES[CpuLayout.MACHINE].device_type == "cpu"
    assert (SHAPES[CpuLayout.PER_CORE].devices, SHAPES[CpuLayout.PER_CORE].threads) == (2, 1)
    assert SHAPES[CpuLayout.PER_CORE].device_type == PER_CORE_DEVICE_TYPE
    with pytest.raises(ValueError, match="at least one core"):
        layout_shapes(0)


def test_the_load_is_the_lower_bound_over_the_layouts_devices():
    demands = [_demand(300.0)]
    machine = layout_load(demands, SHAPES[CpuLayout.MACHINE])
    per_core = layout_load(demands, SHAPES[CpuLayout.PER_CORE])
    assert machine.devices == 1 and per_core.devices == 2
    # one thread is 1.4x slower per batch, but there are two: per-core has the more room
    assert per_core.load < machine.load
    assert per_core.devices_needed > machine.devices_needed
    assert per_core.room_x > machine.room_x
    assert "of 2 devices" in per_core.describe() and "x the rates" in per_core.describe()


def test_the_room_is_the_largest_multiple_of_the_rates_the_bound_fits():
    demands = [_demand(300.0), _demand(40.0, name="small")]
    for layout in CpuLayout:
        load = layout_load(demands, SHAPES[layout])
        grown = [_demand(300.0 * load.room_x), _demand(40.0 * load.room_x, name="small")]
        assert layout_load(grown, SHAPES[layout]).devices_needed <= SHAPES[layout].devices
        beyond = [_demand(300.0 * load.room_x * 1.01), _demand(40.0 * load.room_x * 1.01, name="small")]
        assert layout_load(beyond, SHAPES[layout]).devices_needed > SHAPES[layout].devices
    # no rates: room for any; fixed costs beyond the devices: none
    idle = layout_load([_demand(0.0)], SHAPES[CpuLayout.MACHINE])
    assert idle.room_x == float("inf") and "room for any rate" in idle.describe()
    crowded = [_demand(0.0, slo_ms=6.0, name=f"m{i}") for i in range(3)]     # each needs 2/(6-2) of a device
    assert layout_load(crowded, SHAPES[CpuLayout.MACHINE]).room_x == 0.0


def test_at_a_low_rate_the_room_not_a_noisy_batch_1_time_decides():
    # CI, 2026-12-05: a 38 KB MLP sent at most 50 rps measured l(1) 0.01 ms on the machine and 0.07 ms
    # on one thread (noise at that scale), and 0.4 against 0.1 ms at batch 32. At 30 rps the loads
    # are batch-1 costs (machine 0.0003, per-core 0.00037 a device), and the loads kept the machine.
    def between(l1_ms: float, l32_ms: float) -> Profile:
        return Profile(tuple(BatchLatency(b, l1_ms + (l32_ms - l1_ms) * (b - 1) / 31) for b in range(1, 33)))

    machine, one_thread = between(0.01, 0.4), between(0.07, 0.1)
    demands = [_demand(30.0, machine=machine, per_core=one_thread)]
    loads = [layout_load(demands, SHAPES[layout]) for layout in CpuLayout]
    assert loads[1].load > loads[0].load
    assert loads[1].room_x > 4 * loads[0].room_x
    state = LayoutState(CpuLayout.MACHINE)
    _, state = decide(demands, SHAPES, state, 0.0, CONFIG)
    decision, _ = decide(demands, SHAPES, state, 10.0, CONFIG)
    assert decision.switch_to is CpuLayout.PER_CORE


def test_when_neither_layout_has_room_the_lower_load_by_the_margin_decides():
    # 100 sessions whose batch-1 fixed costs alone exceed both layouts' devices
    many = [_demand(5.0, name=f"m{i}") for i in range(100)]
    loads = [layout_load(many, SHAPES[layout]) for layout in CpuLayout]
    assert loads[0].room_x == 0.0 == loads[1].room_x and loads[1].load < 0.85 * loads[0].load
    decision, _ = decide(many, SHAPES, LayoutState(CpuLayout.MACHINE, better_since=0.0), 10.0, CONFIG)
    assert decision.switch_to is CpuLayout.PER_CORE
    # and per-core running stays: machine's load is higher
    decision, _ = decide(many, SHAPES, LayoutState(CpuLayout.PER_CORE, better_since=0.0), 10.0, CONFIG)
    assert decision.switch_to is None


# ResNet-18 at 3x64x64 as a backend measured it on an Intel Xeon, 2026-12-06: two threads make a batch
# 1.9x faster (l(32) 63.7 against 122.1 ms), so the layouts tie on the profiles alone
SCALING = Profile.linear(1.955, 1.165, 32)
SCALING_ONE_THREAD = Profile.linear(3.789, 0.831, 32)


def test_the_serving_paths_cores_come_off_every_layouts_devices():
    assert left_devices(1, 0.25) == 0.75 and left_devices(2, 0.25) == 1.75 and left_devices(1, 1.5) == 0.0
    demands = [_demand(100.0, machine=SCALING, per_core=SCALING_ONE_THREAD)]
    alone = [layout_load(demands, SHAPES[layout]) for layout in CpuLayout]
    assert 0.85 * alone[1].room_x < alone[0].room_x < alone[1].room_x     # inside the margin: it stays
    # 0.13 cores of path at these rates (1.3 ms of CPU a request at 100 requests/s), the frontend's 0.1
    path = ServingPath(fixed_cores=0.03, rate_cores=0.1)
    assert path.cores() == pytest.approx(0.13) and path.cores(3.0) == pytest.approx(0.33)
    shared = [layout_load(demands, SHAPES[layout], path=path) for layout in CpuLayout]
    assert shared[0].devices_left == pytest.approx(0.87) and shared[1].devices_left == pytest.approx(1.87)
    assert shared[0].load == pytest.approx(alone[0].devices_needed / 0.87)
    assert shared[0].room_x < 0.85 * shared[1].room_x
    assert "of 1 devices, 0.87 left beside the path's 0.13 cores (" in shared[0].describe()
    # the room: the bound at k times the rates fits the devices that the path at k times the rates leaves
    for load, layout in zip(shared, CpuLayout):
        k = load.room_x
        grown = [_demand(100.0 * k, machine=SCALING, per_core=SCALING_ONE_THREAD)]
        assert layout_load(grown, SHAPES[layout]).devices_needed <= left_devices(SHAPES[layout].devices, path.cores(k))
        grown = [_demand(100.0 * k * 1.01, machine=SCALING, per_core=SCALING_ONE_THREAD)]
        assert layout_load(grown, SHAPES[layout]).devices_needed > left_devices(SHAPES[layout].devices,
                                                                                path.cores(k * 1.01))
    state = LayoutState(CpuLayout.MACHINE)
    for now in (0.0, 10.0):
        decision, state = decide(demands, SHAPES, state, now, CONFIG)
    assert decision.switch_to is None                                   # the profiles alone
    state = LayoutState(CpuLayout.MACHINE)
    _, state = decide(demands, SHAPES, state, 0.0, CONFIG, path=path)
    decision, _ = decide(demands, SHAPES, state, 10.0, CONFIG, path=path)
    assert decision.switch_to is CpuLayout.PER_CORE
    # and per-core running stays so
    decision, _ = decide(demands, SHAPES, LayoutState(CpuLayout.PER_CORE), 0.0, CONFIG, path=path)
    assert decision.switch_to is None


def test_other_work_on_an_idle_machine_is_not_multiplied_by_the_rooms_rates():
    # a session at 2 requests/s has room for hundreds of times its rate; 0.15 cores of other work,
    # grown with the rates as a frontend's would be, would leave the machine none long before that
    demands = [_demand(2.0, machine=SCALING, per_core=SCALING_ONE_THREAD)]
    fixed = [layout_load(demands, SHAPES[layout], path=ServingPath(fixed_cores=0.15)) for layout in CpuLayout]
    grown = [layout_load(demands, SHAPES[layout], path=ServingPath(rate_cores=0.15)) for layout in CpuLayout]
    assert fixed[0].room_x > 20 * grown[0].room_x
    assert fixed[0].room_x > 0.85 * fixed[1].room_x                     # the profiles still decide: no switch
    assert grown[0].room_x < 0.6 * grown[1].room_x


def test_a_path_that_leaves_neither_layout_a_device_switches_nothing():
    many = [_demand(5.0, name=f"m{i}") for i in range(100)]      # fixed costs beyond both layouts' devices
    path = ServingPath(fixed_cores=2.5)
    loads = [layout_load(many, SHAPES[layout], path=path) for layout in CpuLayout]
    assert all(load.room_x == 0.0 and load.load == float("inf") for load in loads)
    decision, _ = decide(many, SHAPES, LayoutState(CpuLayout.MACHINE, better_since=0.0), 10.0, CONFIG, path=path)
    assert decision.switch_to is None and decision.reason.startswith("stay machine: ")


def test_without_rates_neither_layout_has_more_room():
    state = LayoutState(CpuLayout.MACHINE)
    for now in (0.0, 100.0):
        decision, state = decide([_demand(0.0)], SHAPES, state, now, CONFIG)
        assert decision.switch_to is None and decision.reason.startswith("stay machine: ")


def test_per_core_is_chosen_once_better_by_the_margin_for_the_hold():
    demands = [_demand(300.0)]
    state = LayoutState(CpuLayout.MACHINE)
    decision, state = decide(demands, SHAPES, state, 0.0, CONFIG)
    assert decision.switch_to is None and "per-core better for 0 of 10 s" in decision.reason
    decision, state = decide(demands, SHAPES, state, 9.0, CONFIG)
    assert decision.switch_to is None
    decision, state = decide(demands, SHAPES, state, 10.0, CONFIG)
    assert decision.switch_to is CpuLayout.PER_CORE
    assert decision.reason.startswith("switch to per-core: machine: ")
    assert state == LayoutState(CpuLayout.PER_CORE, None, 10.0)


def test_a_break_in_the_preference_starts_the_hold_again():
    better, worse = [_demand(300.0)], [_demand(300.0, per_core=Profile.linear(5.6, 2.8, 32))]
    state = LayoutState(CpuLayout.MACHINE)
    _, state = decide(better, SHAPES, state, 0.0, CONFIG)
    decision, state = decide(worse, SHAPES, state, 5.0, CONFIG)
    assert decision.switch_to is None and decision.reason.startswith("stay machine: ")
    assert state.better_since is None
    _, state = decide(better, SHAPES, state, 6.0, CONFIG)
    decision, _ = decide(better, SHAPES, state, 12.0, CONFIG)
    assert decision.switch_to is None          # 6 s held, not 10
    decision, _ = decide(better, SHAPES, state, 16.0, CONFIG)
    assert decision.switch_to is CpuLayout.PER_CORE


def test_within_the_margin_nothing_switches():
    # one thread 1.8x slower: machine's room is 0.9 of per-core's, inside the 15% margin
    demands = [_demand(300.0, per_core=Profile.linear(3.6, 1.8, 32))]
    machine = layout_load(demands, SHAPES[CpuLayout.MACHINE])
    per_core = layout_load(demands, SHAPES[CpuLayout.PER_CORE])
    assert 0.85 * per_core.room_x < machine.room_x < per_core.room_x
    state = LayoutState(CpuLayout.MACHINE)
    for now in (0.0, 30.0, 100.0):
        decision, state = decide(demands, SHAPES, state, now, CONFIG)
        assert decision.switch_to is None
    # and the other way round as well: per-core running, machine not better by the margin
    decision, _ = decide(demands, SHAPES, LayoutState(CpuLayout.PER_CORE), 0.0, CONFIG)
    assert decision.switch_to is None and decision.reason.startswith("stay per-core: ")


def test_no_switch_within_the_cooldown_of_the_last():
    # per-core running, but one thread cannot meet a tight SLO: machine is better at once
    demands = [_demand(50.0, slo_ms=12.0, machine=Profile.linear(3.0, 0.5, 32),
                       per_core=Profile.linear(8.0, 1.0, 32))]
    state = LayoutState(CpuLayout.PER_CORE, None, last_switch_at=0.0)
    decision, state = decide(demands, SHAPES, state, 15.0, CONFIG)
    assert decision.switch_to is None and "within 60 s of the last switch" in decision.reason
    assert "per-core: cannot serve" in decision.reason and "below 2*l(1)" in decision.reason
    decision, state = decide(demands, SHAPES, state, 60.0, CONFIG)
    assert decision.switch_to is CpuLayout.MACHINE


def test_a_layout_that_cannot_serve_a_session_is_never_chosen():
    demands = [_demand(50.0, slo_ms=12.0, machine=Profile.linear(3.0, 0.5, 32), per_core=Profile.linear(8.0, 1.0, 32)),
               _demand(2000.0, name="busy")]
    state = LayoutState(CpuLayout.MACHINE)
    for now in (0.0, 20.0, 200.0):
        decision, state = decide(demands, SHAPES, state, now, CONFIG)
        assert decision.switch_to is None
    assert decision.loads[1].devices_needed is None and decision.loads[1].blocked


def test_nothing_is_decided_before_both_layouts_are_measured_or_without_sessions():
    state = LayoutState(CpuLayout.MACHINE, better_since=3.0)
    decision, state = decide([_demand(300.0, per_core=None)], SHAPES, state, 50.0, CONFIG)
    assert decision.switch_to is None and decision.reason == "profiles of both layouts not measured yet"
    assert state.better_since is None
    decision, _ = decide([], SHAPES, state, 50.0, CONFIG)
    assert decision.switch_to is None and decision.reason == "no sessions to serve"


def _session(name: str, model: str, measured: float, planned: float, cap: int = 0) -> SessionStatus:
    return SessionStatus(name, model, 4, 5.0, 0.1, 10.0, planned, measured, 80.0, 10.0, cap)


def test_session_demands_fold_replicas_and_take_the_measured_rate_else_the_planned():
    status = ClusterStatus(1, "squishy", 1.0, 2, 1, 1, (
        DeviceStatus("a", "cpu", "cpu", 1000.0, 20.0, (_session("s", "m", 40.0, 30.0, cap=8),
                                                        _session("q/st", "m", 0.0, 12.0))),
        DeviceStatus("b", "cpu", "cpu", 1000.0, 20.0, (_session("s", "m", 40.0, 30.0, cap=8),)),
    ), ())
    demands = session_demands(status, {"m": {CpuLayout.MACHINE: MACHINE, CpuLayout.PER_CORE: ONE_THREAD}})
    assert [(d.session, d.rate_rps, d.slo_ms) for d in demands] == [("s", 40.0, 80.0), ("q/st", 12.0, 80.0)]
    # the model's batch cap caps the profile the layouts are compared with
    assert demands[0].profiles[CpuLayout.PER_CORE].max_batch == 8
    assert demands[1].profiles[CpuLayout.MACHINE].max_batch == 32
    unmeasured = session_demands(status, {})
    assert unmeasured[0].profiles == {CpuLayout.MACHINE: None, CpuLayout.PER_CORE: None}


def _serve_args(*argv: str):
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [
    (("--cpu-layout", "auto", "--backends", "2"), "drop --backends"),
    (("--cpu-layout", "per-core", "--threads", "2"), "drop --threads"),
    (("--cpu-layout", "machine", "--device-type", "x"), "drop --device-type"),
    (("--cpu-layout", "auto", "--device", "emulated:t4"), "--device cpu), not on emulated:t4"),
])
def test_cpu_layout_refuses_the_flags_it_replaces(argv, message):
    args = _serve_args(*argv)
    _, backend, _ = serve_cmd.configs(args)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        serve_cmd.cpu_layout(args, backend)


def _layout(*argv: str):
    args = _serve_args(*argv)
    return serve_cmd.cpu_layout(args, serve_cmd.configs(args)[1])


def test_cpu_layout_is_auto_on_a_cpu_unless_the_backends_are_given():
    assert _layout("--cpu-layout", "per-core") is serve_cmd.CpuLayoutChoice.PER_CORE
    assert _layout("--cpu-layout", "machine") is serve_cmd.CpuLayoutChoice.MACHINE
    assert _layout() is serve_cmd.CpuLayoutChoice.AUTO
    assert _layout("--device", "cpu") is serve_cmd.CpuLayoutChoice.AUTO
    for fixed in (("--backends", "1"), ("--backends", "auto"), ("--threads", "2"), ("--device-type", "x"),
                  ("--device", "emulated:t4")):
        assert _layout(*fixed) is None, fixed
    assert serve_cmd.cpu_layout(_serve_args(), BackendConfig()) is serve_cmd.CpuLayoutChoice.AUTO
    with pytest.raises(SystemExit):
        _serve_args("--cpu-layout", "sideways")


def test_faster_rows_keeps_each_batch_sizes_fastest_measurement_up_to_the_shortest():
    quiet = Profile.from_rows([BatchLatency(1, 1.0), BatchLatency(2, 1.9), BatchLatency(3, 2.6)], "cpu", {"run": 1})
    preempted = Profile.from_rows([BatchLatency(1, 0.9), BatchLatency(2, 4.0)], "cpu", {"run": 2})   # at batch 2
    merged = faster_rows([quiet, preempted])
    assert [(r.batch, r.latency_ms) for r in merged.rows] == [(1, 0.9), (2, 1.9)]
    assert merged.device_type == "cpu" and merged.meta == {"run": 1, "measurements": 2}
    assert faster_rows([quiet]).rows == quiet.rows
    with pytest.raises(ValueError, match="no profile to take rows from"):
        faster_rows([])


def test_the_typical_profile_is_the_medians_times_the_margin_extended_past_them():
    # medians for batches 1-4 (a dip at 3, lifted), none beyond: extended by the last step
    medians = {1: 1.0, 2: 1.5, 3: 1.4, 4: 2.0}
    rows = tuple(BatchLatency(b, 10.0 * b, 5.0, median_ms=medians.get(b)) for b in range(1, 9))
    t = typical(Profile(rows, "cpu-1t", {"source": "x"}))
    assert [round(t.latency_ms(b), 6) for b in range(1, 9)] == [1.15, 1.725, 1.725, 2.3, 2.875, 3.45, 4.025, 4.6]
    assert t.device_type == "cpu-1t" and t.max_batch == 8 and t.meta["extrapolated_from_batch"] == 4
    # a profile without medians (a backend of an earlier release) is compared as it is
    plain = Profile.linear(2.0, 1.0, 8)
    assert typical(plain) is plain


def test_a_profiles_medians_survive_its_json():
    rows = (BatchLatency(1, 2.0, 1.0, 1.5, 0.2, 1.9, 1.4), BatchLatency(2, 3.0, 1.0))
    again = Profile.from_json(Profile(rows).to_json())
    assert [r.median_ms for r in again.rows] == [1.4, None]
    with pytest.raises(ProfileError, match=r"profile\[0\]\.median_ms: must be a number, got 'fast'"):
        Profile.from_json('[{"batch": 1, "latency_ms": 2.0, "median_ms": "fast"}]')
