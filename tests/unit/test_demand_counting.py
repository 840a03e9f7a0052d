"""The demand a frontend reports is counted in rows, for models and queries alike: batches are sized
in rows and query stages count rows, so a request of n rows is n units of planned rate. A request
refused as malformed is no demand. In process: the frontend's own request handler, a real routing
table and real KServe messages; the model has no backend, so each valid request ends UNAVAILABLE
after it was counted."""

from __future__ import annotations

import asyncio
import json

import grpc
import numpy as np
import pytest

from common.pb import control, kserve
from frontend.frontend_state import FrontendState
from frontend.inference import infer
from frontend.requests import RequestError
from frontend.routing import RoutingTable

FEATURES = 4
TENSOR = control.TensorDesc(name="x", datatype="FP32", shape=[FEATURES])
OUT = control.TensorDesc(name="y", datatype="FP32", shape=[2])
QUERY = {"name": "q", "slo_ms": 500, "inputs": [{"name": "x", "datatype": "FP32", "shape": [FEATURES]}],
         "stages": [{"name": "s", "model": "m", "inputs": {"x": "x"}}], "outputs": {"y": "s.y"}}


def _table() -> RoutingTable:
    desc = control.ModelDesc(name="m", runtime="onnxruntime", max_batch=8, inputs=[TENSOR], outputs=[OUT])
    return RoutingTable.from_proto(control.RoutingTable(
        epoch=1, routes=[control.ModelRoute(model=desc, slo_ms=100, reason="not placed")],
        queries=[control.QueryInfo(name="q", json=json.dumps(QUERY), budgets_ms={"s": 500})]))


def _request(model: str, rows: int, features: int = FEATURES) -> kserve.ModelInferRequest:
    x = np.zeros((rows, features), np.float32)
    request = kserve.ModelInferRequest(model_name=model)
    request.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


@pytest.mark.parametrize("name", ["m", "q"])
def test_a_request_counts_its_rows_and_a_malformed_one_counts_nothing(name):
    async def main():
        state = FrontendState()
        state.set_table(_table())
        codes = []
        for request in (_request(name, 4), _request(name, 1), _request(name, 3, features=FEATURES + 1)):
            with pytest.raises(RequestError) as err:
                await infer(state, request, None)
            codes.append(err.value.code)
        await state.pool.close()
        return state.requests_window, codes

    window, codes = asyncio.run(main())
    assert codes == [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INVALID_ARGUMENT]
    assert window[name] == 5


def test_a_request_beyond_the_models_batch_cap_is_refused_as_triton_refuses_it():
    """Issue 20 item 5: config.pbtxt's max_batch_size (the model's batch cap) bounds a request's rows,
    whatever its profiles cover; without a cap, the profiles' largest batch does."""
    async def refused(desc: control.ModelDesc, rows: int):
        state = FrontendState()
        state.set_table(RoutingTable.from_proto(control.RoutingTable(
            epoch=1, routes=[control.ModelRoute(model=desc, slo_ms=100, reason="not placed")])))
        try:
            with pytest.raises(RequestError) as err:
                await infer(state, _request("m", rows), None)
        finally:
            await state.pool.close()
        return err.value

    capped = control.ModelDesc(name="m", runtime="onnxruntime", max_batch=32, batch_cap=8, inputs=[TENSOR], outputs=[OUT])
    error = asyncio.run(refused(capped, 20))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch of 20 rows exceeds the model's max_batch_size 8" in str(error)
    assert asyncio.run(refused(capped, 8)).code == grpc.StatusCode.UNAVAILABLE      # within the cap: no backend
    unprofiled = control.ModelDesc(name="m", runtime="onnxruntime", batch_cap=4, inputs=[TENSOR], outputs=[OUT])
    assert asyncio.run(refused(unprofiled, 5)).code == grpc.StatusCode.INVALID_ARGUMENT
