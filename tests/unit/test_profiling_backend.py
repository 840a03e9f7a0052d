"""Where the scheduler profiles a model (globalsched/actuators/profiling.py): on a backend of the type
that the plan in force leaves idle, else the least busy one, never on one that failed to load it
while another has not."""

from __future__ import annotations

import asyncio

from common.config import SchedulerConfig
from common.pb import control
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from globalsched.actuators.profiling import planned_busy, profiling_backend
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.planning.placement import BackendAssignment, PlacedSession, Placement
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.state.membership import Node
from globalsched.state.model_admin import ModelAdmin
from globalsched.state.modeldb import ModelDatabase


class ProfilingBackend:
    """A backend's stub that answers every profile request with a table, and keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[control.ProfileRequest] = []

    async def ProfileModel(self, request, timeout=None):
        self.requests.append(request)
        return control.MeasuredProfile(profile_json=Profile.linear(1.0, 5.0, 8, device_type="t4").to_json())


def _node(node_id: str) -> Node:
    return Node(node_id, control.NODE_KIND_BACKEND, "127.0.0.1:1", "emulated:t4", "t4", 16000.0,
                stub=ProfilingBackend())


def _plan(exec_ms: dict[str, float], need_profile: dict[str, str] | None = None) -> ClusterPlan:
    """A plan on T4s whose backends (node id -> their batches' execution per 50 ms duty cycle) serve
    one session each."""
    backends = tuple(BackendAssignment(n, 50.0, (PlacedSession(f"s-{n}", 4, 80.0),), exec_ms=ms)
                     for n, ms in exec_ms.items())
    return ClusterPlan({"t4": Placement(backends, 0, 0)}, {}, need_profile or {})


def test_the_busy_fraction_is_the_plan_s_execution_per_duty_cycle_of_backends_with_sessions():
    plan = _plan({"be-1": 40.0, "be-2": 10.0})
    empty = BackendAssignment("be-3", 50.0, ())
    plan = ClusterPlan({"t4": Placement((*plan.placements["t4"].backends, empty), 0, 0),
                        "a100": Placement((BackendAssignment("be-4", 0.0, (PlacedSession("s", 1, 1.0),)),), 0, 0)},
                       {}, {})
    assert planned_busy(plan) == {"be-1": 0.8, "be-2": 0.2, "be-4": 0.0}


def test_an_idle_backend_is_chosen_first_then_the_least_busy_and_failed_ones_last():
    a, b, c = _node("be-1"), _node("be-2"), _node("be-3")
    busy = {"be-1": 0.8, "be-2": 0.2}
    assert profiling_backend([a, b, c], set(), busy) is c                  # the plan leaves it idle
    assert profiling_backend([a, b], set(), busy) is b                     # the least busy
    assert profiling_backend([a, b], set(), {"be-1": 0.0, "be-2": 0.0}) is a   # a tie: the earlier
    assert profiling_backend([a, b], set(), {"be-1": 0.0}) is b            # serving, even lightly, is not idle
    assert profiling_backend([a, b, c], {"be-3", "be-2"}, busy) is a       # failed there: another
    assert profiling_backend([a, b], {"be-1", "be-2"}, busy) is a          # failed everywhere: the first
    assert profiling_backend([], set(), busy) is None


def test_the_scheduler_profiles_an_uploaded_model_on_the_backend_the_plan_leaves_idle(tmp_path):
    nodes = {n: _node(n) for n in ("be-1", "be-2", "be-3")}
    trigger = ReplanTrigger()
    trigger.request = lambda why, membership=False: None
    db = ModelDatabase(tmp_path / "db")
    admin = ModelAdmin(SchedulerConfig(data_dir=tmp_path / "db"), db, nodes, trigger)
    db.add_model("m", [model_bytes(mlp_small())])
    db.add_model("n", [model_bytes(mlp_small())])

    async def profile(plan: ClusterPlan) -> None:
        await admin.profiling.apply(plan, 1)
        while admin.profiling.running:
            await asyncio.sleep(0.01)

    asyncio.run(profile(_plan({"be-1": 40.0, "be-2": 10.0}, {"m": "t4"})))
    assert [len(nodes[n].stub.requests) for n in ("be-1", "be-2", "be-3")] == [0, 0, 1]
    assert nodes["be-3"].stub.requests[0].model.name == "m"
    assert not nodes["be-3"].stub.requests[0].background
    asyncio.run(profile(_plan({"be-1": 40.0, "be-2": 10.0, "be-3": 45.0}, {"n": "t4"})))
    assert [len(nodes[n].stub.requests) for n in ("be-1", "be-2", "be-3")] == [0, 1, 1]
    assert db.profiles("m") and db.profiles("n")
