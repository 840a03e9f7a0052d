"""Reading the planner's input: a frozen :class:`globalsched.planning.cluster_values.ClusterView` of the scheduler's state.

The registered backends (membership), the served models with their profiles, replicas and load
failures, the stored queries (model administration, over the model database) and the measured
rates and fan-outs (the workload reports), at one instant. Each database read is one short SQLite
statement (globalsched/state/modeldb.py), so this runs on the event loop.

Versions end here: every version to serve (globalsched/planning/version_rollout.py) is a model of the view under its
version key, and a query stage's model is the version key of the model's newest served version, so
the planner plans sessions and never versions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from common.version_policy import split_key, version_key
from globalsched.planning.algorithms.replan import ReplanReason
from globalsched.planning.cluster_values import ClusterView, ModelView
from globalsched.state.membership import Node
from globalsched.state.model_admin import ModelAdmin
from globalsched.planning.placement import BackendSlot
from globalsched.planning.version_rollout import rates_for_versions
from globalsched.state.rate_reports import Workload


def read_view(now_s: float, backends: Iterable[Node], admin: ModelAdmin, workload: Workload,
              force: ReplanReason | None = None, why: tuple[str, ...] = ()) -> ClusterView:
    db = admin.db
    models = []
    selected_by_name = {}
    for s in db.sessions():
        selected = selected_by_name[s.model] = admin.selected_versions(s.model)
        planned = admin.rollout.plan(s.model, selected, now_s)
        for version in planned:
            models.append(_model_view(admin, version_key(s.model, version), s.slo_ms))
    rates = rates_for_versions(selected_by_name, workload.planning_rates(now_s))
    queries = {name: replace(q, stages=tuple(replace(st, model=admin.current_key(st.model)) for st in q.stages))
               for name, q in admin.queries().items()}
    stage_models = {st.model: _model_view(admin, st.model, 0.0) for q in queries.values() for st in q.stages}
    return ClusterView(
        now_s=now_s,
        backends=tuple(BackendSlot(n.node_id, n.device_type, n.memory_mb) for n in backends),
        models=tuple(models), queries=queries, stage_models=stage_models, force=force, why=why,
        **{**measured(workload, now_s), "rates_rps": rates})


def warm_reads(admin: ModelAdmin) -> None:
    """Read what :func:`read_view` reads of the database for every session's selected versions and the
    queries, so that a scheduler whose reads are cached (globalsched/state/modeldb.py, ``keep_reads``)
    holds them before its first view: at 2,400 models the first view's statements held the event
    loop 0.35-0.66 s while a fleet registered (benchmarks/elastic.md)."""
    for s in admin.db.sessions():
        for version in admin.selected_versions(s.model):
            _model_view(admin, version_key(s.model, version), s.slo_ms)
    admin.queries()


def measured(workload: Workload, now_s: float) -> dict:
    """The view's measured fields (rates, surges, their windows, the latest reports, the counts'
    dispersions, fan-outs) from the workload reports at ``now_s``: what ``nexus simulate`` passes the
    planner as the scheduler does."""
    return dict(rates_rps=workload.planning_rates(now_s), surges_rps=workload.surges(now_s),
                rate_windows_s=workload.rate_windows_s(now_s), surge_windows_s=workload.surge_windows_s(now_s),
                latest_reports=workload.latest_reports(now_s), rate_dispersions=workload.rate_dispersions(now_s),
                **measured_apart_from_rates(workload, now_s))


def measured_apart_from_rates(workload: Workload, now_s: float) -> dict:
    """The measured fields that are not the sessions' rates and their noise: the fan-outs and the last
    requests (what ``nexus simulate`` still measures when told the rates, nexus/simulate/known_rates.py)."""
    return dict(gammas=workload.current_gammas(now_s), last_requested_s=workload.last_requested_s())


def _model_view(admin: ModelAdmin, key: str, slo_ms: float) -> ModelView:
    """One version (``key``, its version key) as the planner sees a model."""
    record = admin.db.model(key)
    name = split_key(key)[0]
    group = record.prefix_group if record else ""
    return ModelView(key, slo_ms, admin.in_service.profiles(key), group, admin.db.prefix_share(key) if group else None,
                     admin.db.min_replicas(name), admin.unloadable_on(key), admin.db.serving(name).expected_rate_rps)
