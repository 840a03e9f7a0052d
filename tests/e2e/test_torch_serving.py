"""A PyTorch model served end to end: a TorchScript file made here with torch.jit.script, uploaded with
`nexus models upload file.pt --name ... --io io.json` to a real cluster, queried through tritonclient,
answers exactly what torch eager computes."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient

from common.profile import Profile
from tests.conftest import ServedModel, serve_models

torch = pytest.importorskip("torch", reason="the torch extra is not installed")

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings(r"ignore:`torch\.jit\.\w+` is deprecated:DeprecationWarning")]

TIMEOUT_US = 30_000_000


class TwoHeads(torch.nn.Module):
    """A small CNN with two outputs: class logits and an embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 5)
        self.embed = torch.nn.Linear(8, 4)

    def forward(self, image: torch.Tensor):
        h = torch.relu(self.conv(image)).mean(dim=(2, 3))
        return self.fc(h), torch.nn.functional.normalize(self.embed(h), dim=1)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch")
    torch.manual_seed(0)
    eager = TwoHeads().eval()
    path = tmp / "two_heads.pt"
    torch.jit.script(eager).save(str(path))
    io = tmp / "io.json"
    io.write_text(json.dumps({
        "inputs": [{"name": "image", "datatype": "FP32", "shape": [3, 16, 16]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [5]},
                    {"name": "embedding", "datatype": "FP32", "shape": [4]}]}))
    profile = Profile.linear(0.5, 2.0, 16, memory_base_mb=10, device_type="cpu")
    cluster = serve_models(tmp, [ServedModel(path, "two_heads", 2000, profile, ("--io", str(io)))])
    client = grpcclient.InferenceServerClient(cluster.frontend)
    assert client.get_model_config("two_heads").config.backend == "torch"
    yield cluster, client, eager
    client.close()
    cluster.stop()


def _expected(eager, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    with torch.inference_mode():
        logits, embedding = eager(torch.from_numpy(x))
    return logits.numpy(), embedding.numpy()


def test_metadata_describes_the_io_json(served):
    _, client, _ = served
    meta = client.get_model_metadata("two_heads")
    assert [(t.name, t.datatype, list(t.shape)) for t in meta.inputs] == [("image", "FP32", [-1, 3, 16, 16])]
    assert [(t.name, list(t.shape)) for t in meta.outputs] == [("logits", [-1, 5]), ("embedding", [-1, 4])]


def test_torchscript_outputs_equal_torch_eager(served):
    cluster, client, eager = served
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        x = rng.standard_normal((batch, 3, 16, 16)).astype(np.float32)
        t = grpcclient.InferInput("image", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        result = client.infer("two_heads", [t], timeout=TIMEOUT_US)
        logits, embedding = _expected(eager, x)
        np.testing.assert_allclose(result.as_numpy("logits"), logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result.as_numpy("embedding"), embedding, rtol=1e-5, atol=1e-6)

    # Concurrent requests are batched on the backend; each still gets its own rows back.
    xs = [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) for _ in range(24)]

    async def burst():
        c = aioclient.InferenceServerClient(cluster.frontend)
        try:
            async def one(x):
                t = aioclient.InferInput("image", list(x.shape), "FP32")
                t.set_data_from_numpy(x)
                return await c.infer("two_heads", [t], timeout=TIMEOUT_US)
            return await asyncio.gather(*[one(x) for x in xs])
        finally:
            await c.close()

    for x, r in zip(xs, asyncio.run(burst())):
        logits, embedding = _expected(eager, x)
        np.testing.assert_allclose(r.as_numpy("logits"), logits, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r.as_numpy("embedding"), embedding, rtol=1e-5, atol=1e-6)
    stats = client.get_inference_statistics("two_heads").model_stats[0]
    assert stats.inference_count == 1 + 4 + 24
