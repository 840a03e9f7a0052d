"""Prefix batching end to end: three backbone variants uploaded separately through `nexus models upload`
to a real cluster (`nexus serve --no-samples`) are grouped by the scheduler, split by the backend into one
shared prefix and three suffixes, and served through tritonclient with the outputs of the whole models;
the prefix's memory is counted once."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

from common.onnx_prefix import find_shared_prefix
from common.profile import Profile
from common.sample_models import backbone_variant, model_bytes
from tests.conftest import ServedModel, nexus_cli, serve_models

pytestmark = pytest.mark.slow

NAMES = ("bb_a", "bb_b", "bb_c")
# A generous CPU profile, so that nothing is profiled on demand and no request is dropped.
PROFILE = Profile.linear(3.0, 5.0, 32, memory_base_mb=50, memory_per_item_mb=1, device_type="cpu")
TIMEOUT_US = 30_000_000


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix_e2e")
    files, models = {}, []
    for i, name in enumerate(NAMES):
        path = tmp / f"{name}.onnx"
        path.write_bytes(model_bytes(backbone_variant(i)))
        files[name] = path.read_bytes()
        models.append(ServedModel(path, name, 2000, PROFILE))
    cluster = serve_models(tmp, models)
    client = grpcclient.InferenceServerClient(cluster.frontend)
    yield cluster, client, files
    client.close()
    cluster.stop()


def _whole(data: bytes, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]


def _wait_for_one_group(client, files, timeout_s: float = 60.0) -> None:
    """Tables arrive one upload at a time: wait until the backend reports the three in one group
    (the memory of a grouped member is its suffix, far below the whole model)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        mem = {n: sum(m.byte_size for m in client.get_inference_statistics(n).model_stats[0].memory_usage)
               for n in NAMES}
        if sum(1 for n in NAMES if 0 < mem[n] < len(files[n]) / 4) >= 2:
            return
        time.sleep(0.3)
    raise AssertionError(f"the backend never grouped the three models: {mem}")


def test_separately_uploaded_variants_share_one_prefix_group(served):
    cluster, _, _ = served
    listed = {m["name"]: m for m in json.loads(nexus_cli("models", "list", "--scheduler", cluster.scheduler,
                                                         "--json").stdout)}
    groups = {listed[n]["prefix_group"] for n in NAMES}
    assert len(groups) == 1 and "" not in groups, groups


def test_prefix_batched_outputs_equal_each_model_run_whole(served):
    cluster, client, files = served
    _wait_for_one_group(client, files)
    rng = np.random.default_rng(3)
    for name in NAMES:
        for batch in (1, 3):
            x = rng.standard_normal((batch, 3, 64, 64)).astype(np.float32)
            t = grpcclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            got = client.infer(name, [t], timeout=TIMEOUT_US).as_numpy("logits")
            np.testing.assert_allclose(got, _whole(files[name], x), rtol=1e-5, atol=1e-6)

    # Concurrent bursts over the three models: merged batches, every answer still exact. Each burst
    # opens with a full batch of bb_a, so that the singles queue up behind it and meet in one prefix
    # batch however fast the machine is; a burst is repeated (at most 5) until a merge is seen.
    per_model = 8

    async def burst(inputs):
        c = aioclient.InferenceServerClient(cluster.frontend)
        try:
            async def one(name, x):
                t = aioclient.InferInput("input", list(x.shape), "FP32")
                t.set_data_from_numpy(x)
                return (await c.infer(name, [t], timeout=TIMEOUT_US)).as_numpy("logits")
            keys = list(inputs)
            outs = await asyncio.gather(*[one(n, inputs[(n, k)]) for n, k in keys])
            return dict(zip(keys, outs))
        finally:
            await c.close()

    merged = {}
    for _ in range(5):
        inputs = {("bb_a", "occupier"): rng.standard_normal((32, 3, 64, 64)).astype(np.float32)}
        inputs.update({(n, k): rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
                       for n in NAMES for k in range(per_model)})
        results = asyncio.run(burst(inputs))
        for (name, k), got in results.items():
            np.testing.assert_allclose(got, _whole(files[name], inputs[(name, k)]), rtol=1e-5, atol=1e-5)
        # A model's batches are counted under their merged size: rows in the batches it took part in
        # exceed its own rows exactly when other models' requests shared its prefix batches.
        for n in NAMES:
            stats = client.get_inference_statistics(n).model_stats[0]
            merged[n] = (sum(b.batch_size * b.compute_infer.count for b in stats.batch_stats),
                         stats.inference_count)
        if any(rows_in_batches > own_rows for rows_in_batches, own_rows in merged.values()):
            break
    assert any(rows_in_batches > own_rows for rows_in_batches, own_rows in merged.values()), merged


def test_memory_of_the_shared_prefix_is_counted_once(served):
    _, client, files = served
    _wait_for_one_group(client, files)
    memory = {n: sum(m.byte_size for m in client.get_inference_statistics(n).model_stats[0].memory_usage)
              for n in NAMES}
    split = find_shared_prefix(files)
    heads = sum(split.suffix_weight_bytes.values())
    one_whole = len(files[NAMES[0]])
    total = sum(memory.values())
    # One member carries the prefix, the others only their suffixes.
    assert sorted(memory.values())[-1] > split.prefix_weight_bytes
    assert sorted(memory.values())[0] < split.prefix_weight_bytes / 10
    # Reported memory also holds the I/O buffers of the largest batch run so far; the prefix
    # counted three times would be at least 3x its weights, far above this bound.
    assert total <= 1.5 * one_whole + heads < 3 * split.prefix_weight_bytes, (memory, one_whole, heads)
    assert total < sum(len(d) for d in files.values()) / 2
