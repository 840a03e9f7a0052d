"""Executing a multi-model query (a DAG of stage sessions) at the frontend.

Contract: :func:`run_query` is called on the event loop for a request whose ``model_name`` is a
query in the routing table. Every stage runs as soon as its parents are done (independent stages
concurrently), each with the deadline its latency budget gives (``stage_deadlines_ms``), or later
when the stages after it can still fit (``latest_finish_ms`` from the scheduler); both scale when the
request brings its own timeout. Fan-out rows become separate one-row requests, which the
backends batch with everything else. The frontend counts rows in and out of every edge so the
scheduler can re-split budgets with the measured gamma.
"""

from __future__ import annotations

import asyncio

import grpc
import numpy as np

from common.pb import kserve
from common.query_def import StageDef, stage_deadlines_ms
from common.tensors import numpy_dtype
from frontend.frontend_state import FrontendState, RequestRecord, dispatch, request_budget_s
from frontend.requests import RequestError, add_output, parse_infer_request
from frontend.routing import ModelEntry, QueryEntry


def _decode(result, entry: ModelEntry) -> dict[str, np.ndarray]:
    out = {}
    for spec, raw, shape in zip(entry.outputs, result.outputs, result.output_shapes):
        out[spec.name] = np.frombuffer(raw, dtype=spec.dtype).reshape(shape)
    return out


def _empty_outputs(entry: ModelEntry) -> dict[str, np.ndarray]:
    return {spec.name: np.zeros((0, *[max(d, 0) for d in spec.shape]), dtype=spec.dtype) for spec in entry.outputs}


async def _run_stage(state: FrontendState, query: QueryEntry, stage: StageDef, values: dict, end_s: float,
                     ) -> dict[str, np.ndarray]:
    """Run one stage given the outputs of its parents (``values[stage]``) and the query inputs."""
    entry = query.stage_models[stage.name]
    q = query.definition

    def source(src) -> np.ndarray:
        return values["$inputs"][src.tensor] if src.stage is None else values[src.stage][src.tensor]

    if stage.fanout is None:
        arrays = [np.ascontiguousarray(source(src)) for _, src in _ordered(stage, entry)]
        rows = arrays[0].shape[0]
        for parent in stage.parents():
            _count_edge(state, q.name, parent, stage.name, values[parent], rows)
        if rows == 0:
            return _empty_outputs(entry)
        result = await dispatch(state, entry, [a.tobytes() for a in arrays], rows, end_s)
        state.count_demand(entry.name, rows)
        return _decode(result, entry)
    fanned = []
    for _, src in _ordered(stage, entry):
        a = source(src)
        fanned.append(a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]))
    keep = np.ones(fanned[0].shape[0], dtype=bool)
    if stage.fanout.select is not None:
        keep = source(stage.fanout.select).reshape(-1) >= stage.fanout.min_score
    picked = np.flatnonzero(keep)
    for parent in stage.parents():
        _count_edge(state, q.name, parent, stage.name, values[parent], len(picked))
    if len(picked) == 0:
        return _empty_outputs(entry)
    state.count_demand(entry.name, len(picked))
    results = await asyncio.gather(*[
        dispatch(state, entry, [np.ascontiguousarray(a[i:i + 1]).tobytes() for a in fanned], 1, end_s)
        for i in picked])
    decoded = [_decode(r, entry) for r in results]
    return {spec.name: np.concatenate([d[spec.name] for d in decoded]) for spec in entry.outputs}


def _ordered(stage: StageDef, entry: ModelEntry):
    """The stage's (input, source) pairs in the model's input order."""
    mapping = dict(stage.inputs)
    return [(spec.name, mapping[spec.name]) for spec in entry.inputs]


def _count_edge(state: FrontendState, query: str, parent: str, child: str, parent_out: dict, child_rows: int):
    parent_rows = next(iter(parent_out.values())).shape[0] if parent_out else 0
    counts = state.edge_window.setdefault((query, parent, child), [0, 0])
    counts[0] += parent_rows
    counts[1] += child_rows


async def run_query(state: FrontendState, query: QueryEntry, request, deadline_s: float | None,
                    record: RequestRecord) -> kserve.ModelInferResponse:
    """Run the query's stages for ``request``; its outcome goes to ``record``."""
    start = record.start_s
    q = query.definition
    parsed = parse_infer_request(request, query, state.shared_memory)
    record.accepted(parsed.rows)
    if not query.ready:
        raise RequestError(grpc.StatusCode.UNAVAILABLE,
                           f"query {q.name!r} is not available: {query.reason or 'a stage has no backend'}")
    budget_s = request_budget_s(q.slo_ms, parsed.timeout_us, deadline_s)
    scale = budget_s * 1000 / q.slo_ms
    # A stage's request is dropped only past the later of its planned finish and the latest finish
    # that still leaves the stages after it their minimal time: slack passes down the DAG.
    finish_ms = {name: max(ms, query.latest_finish_ms.get(name, 0.0))
                 for name, ms in stage_deadlines_ms(q, query.budgets_ms).items()}
    values: dict = {"$inputs": {spec.name: np.frombuffer(raw, dtype=numpy_dtype(spec.datatype)).reshape(
        parsed.rows, *spec.shape) for spec, raw in zip(q.inputs, parsed.inputs)}}
    tasks: dict[str, asyncio.Task] = {}

    async def stage_task(stage: StageDef):
        for parent in stage.parents():
            values[parent] = await tasks[parent]
        end_s = start + min(finish_ms[stage.name] * scale / 1000, budget_s)
        return await _run_stage(state, query, stage, values, end_s)

    for name in q.graph.topological_order():
        tasks[name] = asyncio.ensure_future(stage_task(q.stage(name)))
    try:
        await asyncio.gather(*tasks.values())
    except RequestError as exc:
        for t in tasks.values():
            t.cancel()
        raise RequestError(exc.code, f"query {q.name!r}: {exc}") from None
    for name, t in tasks.items():
        values[name] = t.result()
    response = kserve.ModelInferResponse(model_name=q.name, model_version="1", id=request.id)
    for i in parsed.output_indices:
        out_name, src = q.outputs[i]
        array = np.ascontiguousarray(values[src.stage][src.tensor])
        spec = query.outputs[i]
        add_output(response, parsed, i, out_name, spec.datatype, list(array.shape), array.tobytes(), state.shared_memory)
    record.succeeded(parsed.rows, budget_s)
    return response
