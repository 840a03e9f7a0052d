"""Reading the planner's input: a frozen :class:`globalsched.cluster.ClusterView` of the scheduler's state.

The registered backends (membership), the served models with their profiles, replicas and load
failures, the stored queries (model administration, over the model database) and the measured
rates and fan-outs (the workload reports), at one instant. Each database read is one short SQLite
statement (globalsched/modeldb.py), so this runs on the event loop.
"""

from __future__ import annotations

from typing import Iterable

from globalsched.algorithms.replan import ReplanReason
from globalsched.cluster import ClusterView, ModelView
from globalsched.membership import Node
from globalsched.model_admin import ModelAdmin
from globalsched.placement import BackendSlot
from globalsched.workload import Workload


def read_view(now_s: float, backends: Iterable[Node], admin: ModelAdmin, workload: Workload,
              force: ReplanReason | None = None, why: tuple[str, ...] = ()) -> ClusterView:
    db = admin.db
    models = []
    for s in db.sessions():
        models.append(_model_view(admin, s.model, s.slo_ms))
    queries = admin.queries()
    stage_models = {st.model: _model_view(admin, st.model, 0.0) for q in queries.values() for st in q.stages}
    return ClusterView(
        now_s=now_s,
        backends=tuple(BackendSlot(n.node_id, n.device_type, n.memory_mb) for n in backends),
        models=tuple(models), queries=queries, stage_models=stage_models,
        rates_rps=workload.planning_rates(now_s), surges_rps=workload.surges(now_s),
        rate_windows_s=workload.rate_windows_s(now_s), surge_windows_s=workload.surge_windows_s(now_s),
        gammas=workload.current_gammas(now_s), force=force, why=why)


def _model_view(admin: ModelAdmin, name: str, slo_ms: float) -> ModelView:
    record = admin.db.model(name)
    group = record.prefix_group if record else ""
    return ModelView(name, slo_ms, admin.profiles(name), group, admin.db.prefix_share(name) if group else None,
                     admin.db.min_replicas(name), admin.unloadable_on(name), admin.db.serving(name).expected_rate_rps)
