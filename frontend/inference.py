"""One KServe inference request, of a model or of a query: what every transport calls.

Contract: :func:`infer` serves one ``ModelInferRequest`` on the event loop and returns its
``ModelInferResponse``, or raises :class:`~frontend.requests.RequestError` with the gRPC status.
KServe gRPC (unary and streaming) and HTTP/REST reach it through the KServe handlers
(``frontend/kserve.py``); a request of a model is validated and dispatched here, one of a query
runs in ``frontend/queries.py``; both record their outcome through the dispatch core's
:class:`~frontend.frontend_state.RequestRecord`.
"""

from __future__ import annotations

import time

from common.pb import kserve
from frontend.frontend_state import FrontendState, RequestRecord, cold_budget_s, dispatch, late_limit_s, \
    request_budget_s
from frontend.queries import run_query
from frontend.requests import add_output, parse_infer_request
from frontend.routing import ModelEntry
from frontend.trace import Marks


async def infer(state: FrontendState, request, deadline_s: float | None) -> kserve.ModelInferResponse:
    """Serve one ModelInferRequest (a model or a query) whose transport leaves it ``deadline_s``
    (None: no deadline); raise RequestError with the gRPC status on failure. The request is counted
    in flight, and held for the first routing table, by the dispatch core (FrontendState.admit)."""
    async with state.admit(deadline_s) as deadline_s:
        start = time.monotonic()
        marks = state.tracer.start() if state.tracer is not None else None
        name = request.model_name
        model = state.entry(name, request.model_version)
        if name in state.table.queries:
            with state.record(name, start) as record:
                return await run_query(state, model, request, deadline_s, record)
        with state.record(model.session, start) as record:
            return await _run_model(state, model, request, deadline_s, record, marks)


async def _run_model(state: FrontendState, model: ModelEntry, request, deadline_s: float | None,
                     record: RequestRecord, marks: Marks | None) -> kserve.ModelInferResponse:
    parsed = parse_infer_request(request, model, state.shared_memory)
    record.accepted(parsed.rows)
    budget_s = request_budget_s(model.slo_ms, parsed.timeout_us, deadline_s)
    if model.cold:      # within its SLO plus the time to page it in
        budget_s = cold_budget_s(budget_s, deadline_s)
    end = record.start_s + budget_s
    if marks is not None:
        marks.validated = time.monotonic_ns()
    if model.serve_late:    # the budget orders and batches it; it fails only at the client's own deadline
        give_up = record.start_s + max(budget_s, late_limit_s(deadline_s))
        result = await dispatch(state, model, parsed.inputs, parsed.rows, give_up, marks, serve_by_s=end)
    else:
        result = await dispatch(state, model, parsed.inputs, parsed.rows, end, marks)
    response = kserve.ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request.id)
    for i in parsed.output_indices:
        spec = model.outputs[i]
        add_output(response, parsed, i, spec.name, spec.datatype, result.output_shapes[i], result.outputs[i],
                   state.shared_memory)
    record.succeeded(parsed.rows, end - record.start_s, result)
    if marks is not None:
        state.tracer.record(model.name, parsed.rows, marks, result)
    return response
