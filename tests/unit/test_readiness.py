"""Serving states (globalsched/state/readiness.py): the pure decision from a version's description, and the
record of when versions became ready and the stages on the way, on a fake clock."""

from __future__ import annotations

import asyncio

from common.pb import control
from globalsched.state.readiness import Readiness, serving_state


def _desc(loaded: bool = True, *types: tuple[str, int, int, str]) -> control.ModelDesc:
    desc = control.ModelDesc(name="m", loaded=loaded)
    for device_type, state, backends, reason in types:
        desc.device_types.add(device_type=device_type, state=state, backends=backends, reason=reason)
    return desc


def test_the_serving_state_says_what_a_version_waits_for_or_why_it_cannot_serve():
    cpu_ok = ("cpu", control.PROFILED, 1, "")
    assert serving_state(_desc(False, cpu_ok), routed=False) == (control.STORED, "stored, not loaded")
    assert serving_state(_desc(True, cpu_ok), routed=True) == (control.READY, "")
    assert serving_state(_desc(True), routed=False) == (control.LOADING, "no backend is registered")
    # a type without backends does not count: its profile is no way to serve
    assert serving_state(_desc(True, ("t4", control.PROFILED, 0, "")), routed=False)[1] == "no backend is registered"
    assert serving_state(_desc(True, ("cpu", control.PROFILING, 2, "")), routed=False) == (
        control.LOADING, "its profile is being measured on cpu")
    assert serving_state(_desc(True, ("cpu", control.NOT_PROFILED, 1, "")), routed=False) == (
        control.LOADING, "waiting for a backend of cpu to measure its profile")
    assert serving_state(_desc(True, cpu_ok), routed=False) == (
        control.LOADING, "being placed, loaded and warmed up on backends")
    failed = _desc(True, ("cpu", control.CANNOT_LOAD, 2, "Softmax axis (3 attempts on 2 backends)"),
                   ("t4", control.NEEDS_PROFILE, 1, "upload a t4 profile"))
    assert serving_state(failed, routed=False) == (control.FAILED, "cpu: Softmax axis (3 attempts on 2 backends)")
    # one type that can still serve it keeps it loading
    hope = _desc(True, ("cpu", control.CANNOT_LOAD, 2, "x"), ("t4", control.PREDICTED, 1, ""))
    assert serving_state(hope, routed=False)[0] == control.LOADING


def test_readiness_times_each_stage_once_from_the_upload_to_the_first_route():
    now = [100.0]
    r = Readiness(clock=lambda: now[0])
    r.started("m", at=99.5)
    r.reached(["m"], "stored")
    now[0] = 101.0
    r.reached(["m", "other"], "planned")       # a key not on its way is not recorded
    now[0] = 101.5
    r.reached(["m"], "planned")                # the first time counts
    r.reached(["m"], "loaded")
    now[0] = 102.0
    r.routed_now(["m"])
    assert r.ready_after_s == {"m": 2.5}
    assert r.stages["m"] == {"stored": 0.5, "planned": 1.5, "loaded": 2.0, "routed": 2.5}
    assert "other" not in r.stages
    now[0] = 110.0
    r.routed_now([])                           # unrouted and routed again: ready once, the first time
    r.routed_now(["m"])
    assert r.ready_after_s == {"m": 2.5} and r.routed == frozenset({"m"})
    r.started("m")                             # uploaded again: measured afresh
    assert "m" not in r.ready_after_s and r.stages["m"] == {}
    r.forget(["m"])
    assert "m" not in r.since and "m" not in r.stages


def test_a_waiter_wakes_at_the_next_change_or_at_its_timeout():
    async def run():
        r = Readiness()
        waiter = asyncio.create_task(r.changed(30.0))
        await asyncio.sleep(0)
        assert not waiter.done()
        r.routed_now(["m"])
        await asyncio.wait_for(waiter, 5)
        await r.changed(0.01)                  # nothing changes: back after the timeout
    asyncio.run(run())
