"""The profiling actuator: a model without a profile for a present device type is profiled on a
backend of that type on demand, and a served model that plans with a prediction is profiled while it
serves (globalsched/state/profiles_in_service.py says what plans meanwhile).

A profile is a quick one (:data:`QUICK_BATCH_SIZES`), extended to the model's batch cap; the
backends' serving measurements refine it. It runs on the backend of the type that the plan in force
keeps least busy, one it leaves idle first (:func:`profiling_backend`), at the serving threads'
priority: run below it (``ProfileRequest.background``) on a backend serving at 130 requests/s, it
took longer and cost the served model more requests, not fewer (benchmarks/ready.md). A backend
that cannot load the model records a load failure (globalsched/state/load_failures.py) and the next
attempt goes to another backend; a device that cannot measure at all (an emulated GPU without the
model's table) marks the pair unmeasurable.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AbstractSet, Callable, Mapping, Sequence

import grpc

from common.pb import control
from common.profile import Profile, ProfileError
from globalsched.planning.cluster_values import ClusterPlan
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.state.load_failures import LoadFailures
from globalsched.state.membership import Node
from globalsched.state.modeldb import ModelDatabase
from globalsched.state.profile_book import ProfileBook
from globalsched.state.readiness import Readiness
from profiler.tables import load_warning

log = logging.getLogger("nexus.scheduler")

PROFILE_BUDGET_S = 20.0         # what a backend may spend measuring a model's profile
# A model is profiled at a few batch sizes, a quick estimate that its serving measurements refine
# (common/measured_profile.py): the largest batches took most of a whole profile's time (ResNet-18
# at 64x64 on 2 cores: 16 and 32 were over half of 3.7 s). The estimate is extended to the model's
# batch cap, or to the largest batch a whole profile measures (backend/profile_requests.py).
QUICK_BATCH_SIZES = (1, 2, 4, 8)
QUICK_EXTEND_TO_BATCH = 32
PROFILE_TIMEOUT_S = 300         # how long the scheduler waits for that profile


class ProfilingActuator:
    """Profiling runs in flight (``running``: (model, device type)) and the pairs no backend of the type
    can measure (``unmeasurable``, with why)."""

    def __init__(self, nodes: Mapping[str, Node], db: ModelDatabase, book: ProfileBook, load_failures: LoadFailures,
                 readiness: Readiness, trigger: ReplanTrigger, desc_of: Callable[[str], control.ModelDesc],
                 present_types: Callable[[], tuple[str, ...]]) -> None:
        self.nodes = nodes
        self.db = db
        self.book = book
        self.load_failures = load_failures
        self.readiness = readiness
        self.trigger = trigger
        self.desc_of = desc_of
        self.present_types = present_types
        self.running: set[tuple[str, str]] = set()
        self.unmeasurable: dict[tuple[str, str], str] = {}

    async def apply(self, plan: ClusterPlan, epoch: int) -> None:
        """Profile every model the plan has no profile for on a present device type and, while it
        serves, every served model that plans with a prediction on a present type."""
        busy = planned_busy(plan)
        for model, device_type in plan.need_profile.items():
            self.start(model, device_type, busy)
        served = {plan.model_of(s) for s in plan.sessions}
        present = set(self.present_types())
        for model, device_type in sorted(self.book.predictions):
            if model in served and device_type in present:
                self.start(model, device_type, busy)

    def models(self) -> set[str]:
        """The models being profiled now."""
        return {m for m, _ in self.running}

    def start(self, model: str, device_type: str, busy: Mapping[str, float]) -> None:
        """Profile ``model`` on a backend of ``device_type`` (``busy``: :func:`planned_busy` of the plan
        in force), unless it is being profiled or cannot be."""
        key = (model, device_type)
        if key in self.running or key in self.unmeasurable or self.load_failures.exhausted(model, device_type):
            return
        candidates = [n for n in self.nodes.values()
                      if n.kind == control.NODE_KIND_BACKEND and n.device_type == device_type]
        node = profiling_backend(candidates, self.load_failures.tried(model, device_type), busy)
        if node is None:
            return
        self.running.add(key)
        asyncio.create_task(self._profile(node, model, key))

    async def _profile(self, node: Node, model: str, key: tuple[str, str]) -> None:
        try:
            desc = self.desc_of(model)
            request = control.ProfileRequest(model=desc, budget_s=PROFILE_BUDGET_S, batch_sizes=QUICK_BATCH_SIZES,
                                             extend_to_batch=desc.batch_cap or QUICK_EXTEND_TO_BATCH)
            reply = await node.stub.ProfileModel(request, timeout=PROFILE_TIMEOUT_S)
            if reply.unmeasurable:          # not the model's fault, and no other backend of the type can either
                log.warning("%s has no profile for %s, which cannot measure one: %s", model, node.device_type,
                            reply.error)
                self.unmeasurable[key] = reply.error
                return
            if reply.error:
                log.warning("profiling %s on %s failed: %s", model, node.node_id, reply.error)
                self.load_failures.record(model, node.device_type, node.node_id, reply.error)
                return
            profile = Profile.from_json(reply.profile_json)
            await asyncio.to_thread(self.db.add_profile, model, profile)
            self.book.table_arrived(key, profile, "a profiling run")
            self.readiness.reached([model], "profiled")
            extended = profile.meta.get("extrapolated_from_batch")
            log.info("profiled %s on %s (max batch %d%s)", model, profile.device_type, profile.max_batch,
                     f"; measured to {extended}, beyond that an estimate that serving refines" if extended else "")
            if busy := load_warning(profile):
                log.warning("profiling %s on %s: %s", model, node.node_id, busy)
        except (grpc.aio.AioRpcError, ProfileError, KeyError) as exc:
            log.warning("profiling %s on %s failed: %s", model, node.node_id, exc)
            self.load_failures.record(model, node.device_type, node.node_id, str(exc))
        finally:
            self.running.discard(key)
            self.readiness.poke()
            self.trigger.request(f"profile of {model} done")


def planned_busy(plan: ClusterPlan) -> dict[str, float]:
    """Every backend the plan gives sessions, by node id: the fraction of its duty cycle its batches
    take (0 where it gives no duty cycle)."""
    return {b.node_id: b.exec_ms / b.duty_cycle_ms if b.duty_cycle_ms > 0 else 0.0
            for placement in plan.placements.values() for b in placement.backends if b.sessions}


def profiling_backend(candidates: Sequence[Node], tried: AbstractSet[str], busy: Mapping[str, float]) -> Node | None:
    """Where to profile a model: among ``candidates`` (backends of the type) that have not failed to
    load it (``tried``; all have: the first), one the plan leaves idle (absent from ``busy``), else the
    least busy; ties go to the earlier candidate. None: no candidate."""
    fresh = [n for n in candidates if n.node_id not in tried] or list(candidates[:1])
    return min(fresh, key=lambda n: (n.node_id in busy, busy.get(n.node_id, 0.0)), default=None)
