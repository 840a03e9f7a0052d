"""A zero-downtime update: a new version of a served model is uploaded while clients send requests
without a version; the new version is loaded and warmed on its backends before any traffic moves to
it, then the old one is unloaded. Every request is recorded (when sent, when answered, status, which
version's output it got): none fails, and none sent after the first answer of the new version (the
switch) got the old version's output. The backends' sessions are sampled meanwhile: the old version
was still loaded after the switch, so it was unloaded only once traffic had moved."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from nexus.scheduler_client import upload_model
from tests.components import start_cluster, wait_for

pytestmark = pytest.mark.slow

MODEL = "upd"
RATE_RPS = 40
TIMEOUT_US = 20_000_000       # each request's own budget: generous, the machine is shared
X = np.random.default_rng(7).standard_normal((1, 64)).astype(np.float32)


class Recorder:
    """Open-loop requests of MODEL (no version) at RATE_RPS on a thread; each one's (sent, answered,
    status, output)."""

    def __init__(self, frontend: str) -> None:
        self.frontend = frontend
        self.records: list[tuple[float, float, str, np.ndarray | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, stub) -> None:
        request = kserve.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="input", datatype="FP32", shape=list(X.shape))
        request.raw_input_contents.append(X.tobytes())
        request.parameters["timeout"].int64_param = TIMEOUT_US
        sent = time.monotonic()
        try:
            reply = await stub.ModelInfer(request, timeout=60)
            output = np.frombuffer(reply.raw_output_contents[0], np.float32)
            self.records.append((sent, time.monotonic(), "OK", output))
        except grpc.aio.AioRpcError as exc:
            self.records.append((sent, time.monotonic(), f"{exc.code().name}: {exc.details()}", None))

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(self.frontend) as channel:
            stub = kserve_grpc.GRPCInferenceServiceStub(channel)
            tasks = set()
            start = time.monotonic()
            i = 0
            while not self._stop.is_set():
                task = asyncio.ensure_future(self._one(stub))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                await asyncio.sleep(max(start + i / RATE_RPS - time.monotonic(), 0))
            await asyncio.gather(*tasks)

    def start(self) -> "Recorder":
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, float, str, np.ndarray | None]]:
        self._stop.set()
        self._thread.join(120)
        return sorted(self.records, key=lambda r: r[0])


class SessionWatch:
    """Samples which sessions the backends hold, every 0.1 s on a thread: [(time, session names)]."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster
        self.samples: list[tuple[float, set[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            names = set(_sessions(self.cluster))
            self.samples.append((time.monotonic(), names))
            self._stop.wait(0.1)

    def start(self) -> "SessionWatch":
        self._thread.start()
        return self

    def stop(self) -> list[tuple[float, set[str]]]:
        self._stop.set()
        self._thread.join(60)
        return self.samples


def _sessions(cluster) -> dict[str, list]:
    """Session name -> its SessionStats on each live backend."""
    out: dict[str, list] = {}
    for b in cluster.backends:
        with grpc.insecure_channel(b.address) as channel:
            stats = control_grpc.BackendStub(channel).Stats(control.BackendStatsRequest(), timeout=10)
        for s in stats.sessions:
            out.setdefault(s.model, []).append(s)
    return out


def test_an_update_under_load_loses_no_request_and_old_outputs_stop_at_the_switch(tmp_path):
    models = {1: mlp_small(), 2: mlp_small(hidden=32)}
    expected = {v: ort.InferenceSession(model_bytes(m), providers=["CPUExecutionProvider"]).run(None, {"input": X})[0][0]
                for v, m in models.items()}
    assert not np.allclose(expected[1], expected[2])
    files = {}
    for v, m in models.items():
        files[v] = tmp_path / f"v{v}.onnx"
        files[v].write_bytes(model_bytes(m))
    profile = tmp_path / "cpu.json"
    profile.write_text(Profile.linear(0.2, 1.0, 16, device_type="cpu").to_json())
    cluster = start_cluster(tmp_path / "cluster", 2, "cpu")
    try:
        scheduler, frontend = cluster.scheduler.address, cluster.frontend.address
        upload_model(scheduler, files[1], MODEL, profile_path=str(profile), slo_ms=1000)
        wait_for(lambda: MODEL in _sessions(cluster), 120, "version 1 loaded")
        cluster.wait_models_ready([MODEL], 120)
        recorder, watch = Recorder(frontend).start(), SessionWatch(cluster).start()
        time.sleep(2.0)                                      # steady load on version 1
        uploaded_at = time.monotonic()
        assert upload_model(scheduler, files[2], MODEL, profile_path=str(profile)).version == 2
        wait_for(lambda: any(r[3] is not None and np.allclose(r[3], expected[2], atol=1e-5)
                             for r in list(recorder.records)), 120, "the first answer of version 2")
        wait_for(lambda: MODEL not in _sessions(cluster), 60, "version 1 unloaded from every backend")
        warmed = _sessions(cluster)[f"{MODEL}:2"]
        time.sleep(1.0)                                      # and some load on version 2 alone
        records, samples = recorder.stop(), watch.stop()
    finally:
        cluster.stop()

    failed = [r for r in records if r[2] != "OK"]
    assert not failed, f"{len(failed)} of {len(records)} requests failed, e.g. {failed[0][2]}"
    version_of = []
    for sent, answered, _, output in records:
        matches = [v for v, out in expected.items() if np.allclose(output, out, atol=1e-5)]
        assert len(matches) == 1, f"an output of neither version: {output}"
        version_of.append(matches[0])
    switch = min(answered for (_, answered, _, _), v in zip(records, version_of) if v == 2)
    old_after = [r for r, v in zip(records, version_of) if v == 1 and r[0] > switch]
    counts = {"requests": len(records), "version 1": version_of.count(1), "version 2": version_of.count(2),
              "sent after the switch": sum(r[0] > switch for r in records), "old output after the switch": len(old_after),
              "switch after upload (s)": round(switch - uploaded_at, 2)}
    v1_last_loaded = max(t for t, names in samples if MODEL in names)
    counts["version 1 unloaded after the switch (s)"] = round(v1_last_loaded - switch, 2)
    print(f"update under load: {counts}")
    assert not old_after, counts
    assert counts["version 1"] > 0 and counts["sent after the switch"] > 0, counts
    assert v1_last_loaded > switch, counts          # the old version left only after traffic had moved
    # Loaded and warmed before it took traffic: every backend serving version 2 ran its warm-up batches.
    assert warmed and all(s.warmup_count > 0 for s in warmed), warmed
