"""Prefix groups: which stored models share a prefix, and what the shared prefix costs when planned.

Two halves, both pure functions:

1. **At upload** (:func:`assign_prefix_group`, the scheduler's ``prefix_fn`` hook of
   :meth:`globalsched.state.modeldb.ModelDatabase.add_model`): the model's *signature* is the list of its
   cut points' prefix ids (as :func:`common.onnx_prefix.prefix_signature` computes them) whose prefix
   is substantial:
   it carries at least :data:`MIN_PREFIX_WEIGHT_BYTES` of weights *and* at least
   :data:`MIN_PREFIX_WEIGHT_SHARE` of the model's weights, so that a shared input stem (an Identity,
   a Cast, one small convolution) never groups unrelated models. The signature is stored as JSON
   (:func:`signature_json`). The group id is a prefix id, so a group names the layers it shares:

   - if the new model has, among its cut points, the id of an existing group, it joins that group
     (the deepest such group);
   - otherwise, if it shares a cut point with stored models that are in no group, the deepest
     such cut point becomes a new group of the new model and all those models;
   - otherwise it is in no group ("").

   The model database then moves every *ungrouped* stored model whose signature lists the group id
   into the group (``ModelDatabase.set_prefix_group``), in the same transaction as the upload.
   Models already in another group are left alone: that group shares a deeper prefix than the one
   the newcomer could offer them.

2. **At planning** (:func:`solve_with_prefix_groups`, called by ``globalsched.planning.cluster_values``): the
   planner (``globalsched.planning.algorithms``) takes a :class:`globalsched.planning.plan.PrefixGroup` per group whose
   ``profile`` is the prefix's own l_p(b), m_p(b), under the contract ``l_p(b) <= l_i(b)``,
   ``m_p(b) <= m_i(b)`` for every member ``i`` and batch ``b`` of its profile. Backends never
   measure the prefix alone, so it is derived from the members' whole-model profiles
   (:func:`derive_prefix_profile`): ``l_p(b) = share * min_i l_i(b)`` and ``m_p(b) = share *
   min_i m_i(b)``, made non-decreasing, extended linearly past the members' largest batch up to the
   sum of their largest batches (so that members can merge their batches). ``share`` is the
   prefix's fraction of the model's weights when the caller knows it (``shares``, from the stored
   signature: :func:`prefix_share`), clamped to [:data:`MIN_SHARE`, :data:`MAX_SHARE`], else
   :data:`DEFAULT_SHARE`. On a GPU the planner charges a group ``l_p(B) + sum_i (l_i(b_i) -
   l_p(b_i))`` and every member's requests see all of it, so the share cuts both ways: a low one
   under-states the saving of the merged prefix *and* over-states the suffixes every member waits
   for. Groups with fewer than two sessions on a device type are dropped (nothing to share), and
   the plan with prefix groups is kept only when it needs no more devices than the plan without
   them: the planner is then never worse for knowing the groups. (It can be: at low rates a member's
   residual load wants a duty cycle capped by its SLO, d = SLO - l(1), and joining a group makes
   its requests wait for the whole group's execution, which no longer fits; squishy then opens a GPU
   per member, e.g. ten members at 10 req/s each on ten GPUs instead of four.) Backends merge the
   members that land on them either way.
"""

from __future__ import annotations

import json
from typing import Iterable, Mapping, Sequence

from globalsched.planning.algorithms import PlannerConfig, solve
from globalsched.planning.plan import GpuSpec, Plan, PlanningError, PrefixGroup, SessionSpec
from common.profile import BatchLatency, Profile

MIN_PREFIX_WEIGHT_BYTES = 256 * 1024
MIN_PREFIX_WEIGHT_SHARE = 0.25
SIGNATURE_VERSION = 1

DEFAULT_SHARE = 0.8
MIN_SHARE = 0.5
MAX_SHARE = 0.95
MAX_PREFIX_BATCH = 1024


# ---- signatures ------------------------------------------------------------------------------------


def model_signature(model_bytes: bytes) -> tuple[list[str], list[int], int]:
    """(prefix ids of the model's substantial prefixes from the inputs outwards, the weight bytes of
    each of those prefixes, the model's weight bytes). ValueError when the bytes are not valid ONNX."""
    from common.onnx_prefix import prefix_cuts  # lazy: it imports onnx (~30 ms at start-up); only uploads need it

    cuts, total = prefix_cuts(model_bytes)
    floor = max(MIN_PREFIX_WEIGHT_BYTES, MIN_PREFIX_WEIGHT_SHARE * total)
    kept = [(pid, weight) for pid, weight in cuts if weight >= floor]
    return [pid for pid, _ in kept], [weight for _, weight in kept], total


def signature_json(ids: Sequence[str], weights: Sequence[int], total_weight_bytes: int) -> str:
    """The stored form: ``{"version", "cuts": [prefix id...], "cut_weight_bytes": [...], "weight_bytes",
    "min_prefix_weight_bytes", "min_prefix_weight_share"}``."""
    return json.dumps({"version": SIGNATURE_VERSION, "cuts": list(ids), "cut_weight_bytes": list(weights),
                       "weight_bytes": int(total_weight_bytes), "min_prefix_weight_bytes": MIN_PREFIX_WEIGHT_BYTES,
                       "min_prefix_weight_share": MIN_PREFIX_WEIGHT_SHARE}, separators=(",", ":"))


def _parse(text: str) -> dict:
    if not text:
        return {}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return {}
    if isinstance(obj, list):       # a bare list of prefix ids
        return {"cuts": obj}
    return obj if isinstance(obj, dict) else {}


def signature_ids(text: str) -> list[str]:
    """The prefix ids of a stored signature ("" or unreadable: none)."""
    cuts = _parse(text).get("cuts", [])
    return [c for c in cuts if isinstance(c, str)] if isinstance(cuts, list) else []


def prefix_share(text: str, group: str) -> float | None:
    """The fraction of a model's weights in the prefix ``group``, from its stored signature; None if unknown."""
    obj = _parse(text)
    cuts, weights, total = obj.get("cuts", []), obj.get("cut_weight_bytes", []), obj.get("weight_bytes", 0)
    if not (isinstance(cuts, list) and isinstance(weights, list) and len(cuts) == len(weights)) or group not in cuts:
        return None
    if not isinstance(total, (int, float)) or total <= 0:
        return None
    return min(1.0, max(0.0, weights[cuts.index(group)] / total))


# ---- assignment at upload ------------------------------------------------------------------------------


def choose_group(ids: Sequence[str], existing: Mapping[str, tuple[str, str, str]]) -> str:
    """The group of a model with signature ``ids`` given ``existing`` name -> (sha256, group, signature)."""
    if not ids:
        return ""
    position = {pid: k for k, pid in enumerate(ids)}
    groups = {group for _, group, _ in existing.values() if group}
    joinable = [g for g in groups if g in position]
    if joinable:
        return max(joinable, key=lambda g: position[g])
    best = -1
    for _, group, sig in existing.values():
        if group:
            continue
        for pid in signature_ids(sig):
            k = position.get(pid, -1)
            if k > best:
                best = k
    return ids[best] if best >= 0 else ""


def assign_prefix_group(model_bytes: bytes, existing: Mapping[str, tuple[str, str, str]]) -> tuple[str, str]:
    """(prefix group, signature JSON) of a new ONNX model; see the module docstring for the rule.

    ``existing`` maps every other stored model's name to (sha256, prefix group, signature JSON).
    A model that cannot be analysed (it passed the upload checks, so this is rare) gets no group.
    """
    try:
        ids, weights, total = model_signature(model_bytes)
    except ValueError:
        return "", ""
    return choose_group(ids, existing), signature_json(ids, weights, total)


def joining_members(group: str, existing: Mapping[str, tuple[str, str, str]]) -> list[str]:
    """Stored models in no group whose signature lists ``group``: they join it with the new model."""
    if not group:
        return []
    return sorted(name for name, (_, g, sig) in existing.items() if not g and group in signature_ids(sig))


# ---- planning --------------------------------------------------------------------------------------------


def derive_prefix_profile(members: Iterable[Profile], share: float = DEFAULT_SHARE) -> Profile:
    """A prefix profile that keeps the planner's contract with every member (module docstring)."""
    profiles = list(members)
    if not profiles:
        raise ValueError("a prefix group needs at least one member profile")
    if not 0 < share <= 1:
        raise ValueError(f"share must lie in (0, 1], got {share}")
    latency_share = memory_share = share
    longest = max(profiles, key=lambda p: p.max_batch)
    top = min(sum(p.max_batch for p in profiles), MAX_PREFIX_BATCH)
    top = max(top, longest.max_batch)
    rows = []
    last_lat = last_mem = 0.0
    for b in range(1, top + 1):
        covering = [p for p in profiles if p.max_batch >= b]
        if covering:
            lat = latency_share * min(p.latency_ms(b) for p in covering)
            mem = memory_share * min(p.memory_mb(b) for p in covering)
        else:  # past every member's profile: extend the longest one's last slope
            n = longest.max_batch
            slope_l = (longest.latency_ms(n) - longest.latency_ms(1)) / max(n - 1, 1)
            slope_m = max(0.0, (longest.memory_mb(n) - longest.memory_mb(1)) / max(n - 1, 1))
            lat = last_lat + latency_share * slope_l
            mem = last_mem + memory_share * slope_m
        # Never decreasing, and still within the contract: for a member i covering b, the running
        # maximum is some share * l_j(b') with b' <= b, j covering b', at most share * l_i(b') <= l_i(b).
        last_lat = max(last_lat, lat)
        last_mem = mem
        rows.append(BatchLatency(b, max(last_lat, 1e-6), max(mem, 0.0)))
    return Profile.from_rows(rows, longest.device_type)


def group_share(models: Iterable[str], shares: Mapping[str, float | None] | None = None) -> float:
    """The share used for a group: the smallest known member share, clamped; the default if none is known."""
    known = [shares[m] for m in models if shares and shares.get(m) is not None]
    if not known:
        return DEFAULT_SHARE
    return min(MAX_SHARE, max(MIN_SHARE, min(known)))


def _ungrouped(s: SessionSpec) -> SessionSpec:
    return SessionSpec(s.name, s.model, s.slo_ms, s.rate_rps, s.profile, None)


def planning_groups(specs: Sequence[SessionSpec], shares: Mapping[str, float | None] | None = None,
                    ) -> tuple[list[SessionSpec], tuple[PrefixGroup, ...]]:
    """Specs with ``prefix_group`` kept only where the group has >= 2 sessions, and those groups.

    ``shares`` maps a model to its prefix's fraction of its weights (:func:`prefix_share`), if known.
    """
    members: dict[str, list[SessionSpec]] = {}
    for s in specs:
        if s.prefix_group:
            members.setdefault(s.prefix_group, []).append(s)
    keep = {g for g, ms in members.items() if len(ms) >= 2}
    out = [s if s.prefix_group in keep else _ungrouped(s) for s in specs]
    groups = tuple(PrefixGroup(g, derive_prefix_profile((s.profile for s in members[g]),
                                                        group_share((s.model for s in members[g]), shares)))
                   for g in sorted(keep))
    return out, groups


def solve_with_prefix_groups(specs: Sequence[SessionSpec], gpu: GpuSpec, solver: str = "squishy",
                             config: PlannerConfig | None = None,
                             shares: Mapping[str, float | None] | None = None) -> Plan:
    """``solve`` with the specs' prefix groups; the plan without them when that one needs fewer devices."""
    config = config or PlannerConfig()
    grouped_specs, groups = planning_groups(specs, shares)
    plain = solve([_ungrouped(s) for s in specs], gpu, solver=solver, config=config)
    if not groups:
        return plain
    try:
        grouped = solve(grouped_specs, gpu, solver=solver, config=config, prefix_groups=groups)
    except PlanningError:
        return plain
    return grouped if len(grouped.gpus) <= len(plain.gpus) else plain
