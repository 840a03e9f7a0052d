"""A request for a cold model asks the scheduler to page it in with a report of its own
(frontend/early_report.py): once per routing table, however many requests wait, and again when a
table comes that leaves the model cold. In process: the frontend's own request handler and real
routing tables; no backend serves the model, so the waits end when the table says it is gone."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from common.pb import control, kserve
from frontend.frontend_state import FrontendState
from frontend.inference import infer
from frontend.requests import RequestError
from frontend.routing import RoutingTable

DESC = control.ModelDesc(name="m", runtime="onnxruntime", max_batch=8,
                         inputs=[control.TensorDesc(name="x", datatype="FP32", shape=[4])],
                         outputs=[control.TensorDesc(name="y", datatype="FP32", shape=[2])])


def _table(epoch: int, cold: bool) -> RoutingTable:
    route = control.ModelRoute(model=DESC, slo_ms=100, reason="cold: not resident" if cold else "not placed",
                               cold=cold)
    return RoutingTable.from_proto(control.RoutingTable(epoch=epoch, routes=[route]))


def _request() -> kserve.ModelInferRequest:
    request = kserve.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    request.raw_input_contents.append(np.zeros((1, 4), np.float32).tobytes())
    return request


def test_waiting_requests_ask_once_per_table_and_again_when_it_leaves_the_model_cold():
    async def main():
        state = FrontendState()
        state.set_table(_table(1, cold=True))
        waits = [asyncio.create_task(infer(state, _request(), None)) for _ in range(3)]
        await asyncio.sleep(0.05)
        first = set(state.page_in), state.page_in_asked.is_set()
        state.page_in.clear()
        state.page_in_asked.clear()
        late = asyncio.create_task(infer(state, _request(), None))     # asked for already: no new ask
        await asyncio.sleep(0.05)
        repeated = set(state.page_in)
        state.set_table(_table(2, cold=True))                           # a plan that left it cold
        await asyncio.sleep(0.05)
        again = set(state.page_in)
        state.set_table(_table(3, cold=False))                          # no longer cold, and no backend
        codes = []
        for task in (*waits, late):
            with pytest.raises(RequestError) as err:
                await task
            codes.append(err.value.code)
        await state.pool.close()
        return first, repeated, again, codes

    first, repeated, again, codes = asyncio.run(main())
    assert first == ({"m"}, True)
    assert repeated == set()
    assert again == {"m"}
    assert codes == [grpc.StatusCode.UNAVAILABLE] * 4


def test_a_cold_model_is_ready_to_tritons_clients_with_its_reason_in_the_repository_index():
    """READY, as Triton says of a model that can serve: a client that waits for readiness before its
    first request must not be kept from the request that pages the model in."""
    from common.pb import kserve as pb
    from frontend.kserve_api import Call, KServeApi

    async def main():
        state = FrontendState()
        service = KServeApi(state, None)
        state.set_table(_table(1, cold=True))
        cold_ready = (await service.ModelReady(pb.ModelReadyRequest(name="m"), Call())).ready
        cold_index = (await service.RepositoryIndex(pb.RepositoryIndexRequest(ready=True), Call())).models
        state.set_table(_table(2, cold=False))                  # no backend, and not cold: unavailable
        gone_ready = (await service.ModelReady(pb.ModelReadyRequest(name="m"), Call())).ready
        gone_index = (await service.RepositoryIndex(pb.RepositoryIndexRequest(), Call())).models
        await state.pool.close()
        return cold_ready, list(cold_index), gone_ready, list(gone_index)

    cold_ready, cold_index, gone_ready, gone_index = asyncio.run(main())
    assert cold_ready is True
    [entry] = cold_index
    assert (entry.name, entry.state) == ("m", "READY") and entry.reason.startswith("cold:")
    assert gone_ready is False
    [entry] = gone_index
    assert (entry.state, entry.reason) == ("UNAVAILABLE", "not placed")
