"""Multi-model queries served end to end: outputs, measured fan-out, refused definitions."""

from __future__ import annotations

import asyncio
import copy
import json
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from common.sample_models import model_bytes, detector_64, face_cls, vehicle_cls
from common.sample_queries import SAMPLE_QUERIES
from tests.components import scrape
from tests.conftest import nexus_cli

pytestmark = pytest.mark.slow

LONG_TIMEOUT_US = 30_000_000


@pytest.fixture(scope="module")
def stages():
    def session(model):
        return ort.InferenceSession(model_bytes(model), providers=["CPUExecutionProvider"])
    return {"detector": session(detector_64()), "vehicle_cls": session(vehicle_cls()), "face_cls": session(face_cls())}


def _image(seed: int, rows: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 3, 64, 64)).astype(np.float32)


def _by_hand(stages, image: np.ndarray) -> dict[str, np.ndarray]:
    scores, crops = stages["detector"].run(None, {"input": image})
    picked = crops.reshape(-1, 3, 64, 64)[scores.reshape(-1) >= 0.5]
    out = {"scores": scores}
    for name, model in (("vehicles", "vehicle_cls"), ("faces", "face_cls")):
        out[name] = (np.concatenate([stages[model].run(None, {"input": picked[i:i + 1]})[0]
                                     for i in range(len(picked))]) if len(picked) else None)
    return out


def test_traffic_query_matches_its_stages_run_by_hand(cluster, stages):
    client = grpcclient.InferenceServerClient(cluster.frontend)
    try:
        assert client.is_model_ready("traffic")
        meta = client.get_model_metadata("traffic")
        assert meta.platform == "ensemble"
        assert [i.name for i in meta.inputs] == ["image"] and list(meta.inputs[0].shape) == [-1, 3, 64, 64]
        assert {o.name for o in meta.outputs} == {"scores", "vehicles", "faces"}
        config = client.get_model_config("traffic").config
        assert config.max_batch_size > 0 and list(config.input[0].dims) == [3, 64, 64]
        assert "late_requests" not in config.parameters       # a query's stages always drop
        traffic = frozenset({("model", "traffic"), ("version", "1")})
        before = scrape(cluster.info["metrics"])[0].get(("nv_inference_request_success", traffic), 0)
        for seed in range(4):
            image = _image(seed)
            x = grpcclient.InferInput("image", list(image.shape), "FP32")
            x.set_data_from_numpy(image)
            result = client.infer("traffic", [x], timeout=LONG_TIMEOUT_US)
            expected = _by_hand(stages, image)
            np.testing.assert_allclose(result.as_numpy("scores"), expected["scores"], rtol=1e-5, atol=1e-6)
            for name in ("vehicles", "faces"):
                got = result.as_numpy(name)
                if expected[name] is None:
                    assert got.shape[0] == 0
                else:
                    np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-5)
        index = {m.name: m.state for m in client.get_model_repository_index().models}
        assert index.get("traffic") == "READY" and "traffic/detect" not in index
        samples = scrape(cluster.info["metrics"])[0]           # a query is counted as the model it is served as
        assert samples[("nv_inference_request_success", traffic)] == before + 4
        assert samples[("nexus_request_latency_seconds_count", traffic)] >= 4
        assert samples[("nexus_session_planned_rate_rps", frozenset({("model", "traffic/detect")}))] > 0
    finally:
        client.close()


def test_gamma_is_measured_within_5_percent_of_the_true_fanout(cluster, stages):
    images = [_image(1000 + i) for i in range(150)]
    true_gamma = np.mean([(stages["detector"].run(None, {"input": im})[0] >= 0.5).sum() for im in images])

    async def drive():
        c = aioclient.InferenceServerClient(cluster.frontend)
        try:
            sem = asyncio.Semaphore(16)

            async def one(im):
                async with sem:
                    x = aioclient.InferInput("image", list(im.shape), "FP32")
                    x.set_data_from_numpy(im)
                    await c.infer("detect_classify", [x], timeout=LONG_TIMEOUT_US)
            await asyncio.gather(*[one(im) for im in images])
        finally:
            await c.close()

    asyncio.run(drive())
    deadline = time.monotonic() + 30
    measured = None
    while time.monotonic() < deadline:
        result = nexus_cli("queries", "list", "--scheduler", cluster.scheduler, "--json")
        assert result.returncode == 0, result.stderr
        query = {q["name"]: q for q in json.loads(result.stdout)}["detect_classify"]
        measured = query["gamma"].get("detect->classify")
        if measured is not None and abs(measured - true_gamma) <= 0.05 * true_gamma:
            break
        time.sleep(1.0)
    assert measured is not None
    assert abs(measured - true_gamma) <= 0.05 * true_gamma, (measured, true_gamma)
    assert query["split"] in ("tree-dp", "dag-dp", "even", "proportional")
    assert sum(query["budgets_ms"].values()) <= 300 + 1e-6
    assert query["planned_rate_rps"] > 0 and query["devices"] == 1   # the cluster has one backend
    # classify ends the query; detect may run late while classify's minimal time still fits
    assert query["latest_finish_ms"]["classify"] == 300
    assert query["budgets_ms"]["detect"] <= query["latest_finish_ms"]["detect"] < 300


def _register(cluster, tmp_path, definition) -> tuple[int, str]:
    path = tmp_path / "q.json"
    path.write_text(definition if isinstance(definition, str) else json.dumps(definition))
    result = nexus_cli("queries", "register", str(path), "--scheduler", cluster.scheduler)
    return result.returncode, result.stderr


def test_bad_definitions_are_refused_naming_the_problem(cluster, tmp_path):
    base = copy.deepcopy(SAMPLE_QUERIES["traffic"])
    base["name"] = "bad_query"

    def variant(change):
        q = copy.deepcopy(base)
        change(q)
        return q

    cases = {
        "cycle": (variant(lambda q: q["stages"][0].update(inputs={"input": "face.logits"})), "cycle"),
        "unknown model": (variant(lambda q: q["stages"][1].update(model="no_such_model")), "unknown model 'no_such_model'"),
        "wrong shape": (variant(lambda q: q["stages"][1].pop("fanout")), "shape"),
        "wrong dtype": (variant(lambda q: q["inputs"][0].update(datatype="FP64")), "FP64"),
        "slo below path": (variant(lambda q: q.update(slo_ms=0.01)), "below the sum of minimal latencies"),
        "unknown tensor": (variant(lambda q: q["outputs"].update(x="detect.nope")), "no output 'nope'"),
        "unknown key": (variant(lambda q: q.update(colour="red")), "unknown key"),
    }
    for label, (definition, expected) in cases.items():
        code, err = _register(cluster, tmp_path, definition)
        assert code == 2, (label, err)
        assert err.startswith("nexus queries register: error:") and expected in err, (label, err)
    code, err = _register(cluster, tmp_path, "{not json")
    assert code == 2 and "not valid JSON" in err
    listed = nexus_cli("queries", "list", "--scheduler", cluster.scheduler, "--json")
    assert "bad_query" not in {q["name"] for q in json.loads(listed.stdout)}
    client = grpcclient.InferenceServerClient(cluster.frontend)
    try:
        with pytest.raises(InferenceServerException) as e:
            client.get_model_metadata("bad_query")
        assert "NOT_FOUND" in e.value.status()
    finally:
        client.close()
