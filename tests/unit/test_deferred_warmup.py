"""A backend's model table holds its answer only for the warm-up the plan needs at once
(backend/warmup_runner.py): a session new here warms its planned batch before the answer, and
batch 1 after it, once the device is idle; a re-plan that changes the planned batch of a session
already serving holds nothing. Real ONNX Runtime sessions on a real engine thread."""

from __future__ import annotations

import asyncio
import logging
import time

import backend.model_table as model_table

from backend.engine import Engine
from backend.server import BackendService
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig
from common.pb import control
from common.sample_models import mlp_small, model_bytes
from globalsched.rpc.convert import model_desc
from globalsched.state.modeldb import ModelDatabase


def _mlp(tmp_path) -> tuple[bytes, control.ModelDesc]:
    data = model_bytes(mlp_small(hidden=32))
    db = ModelDatabase(tmp_path)
    db.add_model("mlp", [data])
    desc = model_desc(db.model("mlp"), {}, True)
    db.close()
    return data, desc


def _service(data: bytes) -> BackendService:
    service = BackendService(BackendConfig(), Engine(SlidingWindowEarlyDrop()))

    async def fetch(sha256: str) -> bytes:
        return data
    service.tables._fetch = fetch
    return service


def _table(desc: control.ModelDesc, epoch: int, batch: int) -> control.ModelTable:
    return control.ModelTable(epoch=epoch, sessions=[control.SessionEntry(model=desc, slo_ms=100.0, batch=batch)])


def _warmups(service: BackendService) -> int:
    return service.engine.sessions["mlp"].stats.warmup_count


def test_batch_1_warms_after_the_answer_and_a_new_planned_batch_of_a_serving_session_holds_nothing(tmp_path):
    data, desc = _mlp(tmp_path)

    async def main() -> list[tuple[int, int]]:
        service = _service(data)
        engine = service.engine
        seen = []
        try:
            reply = await service.UpdateModelTable(_table(desc, 1, 4), None)
            assert list(reply.loaded) == ["mlp"] and not reply.failed
            seen.append((_warmups(service), len(service.tables.warmer._deferred)))  # answered: batch 4 only
            for _ in range(200):                         # the idle device runs batch 1's soon after
                await asyncio.sleep(0.01)
                if _warmups(service) == 2:
                    break
            seen.append((_warmups(service), len(service.tables.warmer._deferred)))
            reply = await service.UpdateModelTable(_table(desc, 2, 8), None)   # re-planned at batch 8
            seen.append((_warmups(service), len(service.tables.warmer._deferred)))
            deadline = time.monotonic() + 2.0
            while _warmups(service) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            seen.append((_warmups(service), len(service.tables.warmer._deferred)))
        finally:
            engine.stop()
        return seen

    # ONNX Runtime: one run a size. (warm-up batches counted, deferred sizes under way)
    assert asyncio.run(main()) == [(1, 1), (2, 0), (2, 1), (3, 0)]


class _FailsAtBatch1:
    """A runtime whose batches of one row fail (the rest run on the real one)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, feeds):
        if next(iter(feeds.values())).shape[0] == 1:
            raise RuntimeError("no kernel for this shape")
        return self.inner.run(feeds)


def test_a_failed_deferred_warm_up_is_logged_and_tried_again_by_the_next_table(tmp_path, monkeypatch, caplog):
    data, desc = _mlp(tmp_path)
    load = model_table.load_runtime
    monkeypatch.setattr(model_table, "load_runtime", lambda *a, **k: _FailsAtBatch1(load(*a, **k)))

    async def main() -> tuple[int, set, set]:
        service = _service(data)
        try:
            reply = await service.UpdateModelTable(_table(desc, 1, 4), None)
            assert list(reply.loaded) == ["mlp"] and not reply.failed      # a default warm-up's failure fails nothing
            for _ in range(200):
                await asyncio.sleep(0.01)
                if not service.tables.warmer._deferred:
                    break
            after_failure = set(service.tables.warmer._deferred)
            await service.UpdateModelTable(_table(desc, 2, 4), None)    # the same table again: batch 1 once more
            again = {size for sizes in service.tables.warmer._deferred.values() for size in sizes}
            return service.engine.sessions["mlp"].stats.warmup_count, after_failure, again
        finally:
            service.engine.stop()

    with caplog.at_level(logging.WARNING, logger="nexus.backend"):
        count, after_failure, again = asyncio.run(main())
    assert "deferred warm-up of mlp stopped: mlp: warm-up sample 'default batch 1' (batch 1): RuntimeError: " \
           "no kernel for this shape" in caplog.text
    assert after_failure == set() and again == {1}
    assert count == 2               # batch 4's, and the batch 1 that ran and failed
