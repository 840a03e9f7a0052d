"""A backend's model table holds its answer only for the warm-up the plan needs at once
(backend/warmup_runner.py): a session new here warms its planned batch before the answer, and
batch 1 after it, once the device is idle; a re-plan that changes the planned batch of a session
already serving holds nothing. Real ONNX Runtime sessions on a real engine thread."""

from __future__ import annotations

import asyncio
import time

from backend.engine import Engine
from backend.server import BackendService
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig
from common.pb import control
from common.sample_models import mlp_small, model_bytes
from globalsched.rpc.convert import model_desc
from globalsched.state.modeldb import ModelDatabase


def _table(desc: control.ModelDesc, epoch: int, batch: int) -> control.ModelTable:
    return control.ModelTable(epoch=epoch, sessions=[control.SessionEntry(model=desc, slo_ms=100.0, batch=batch)])


def _warmups(service: BackendService) -> int:
    return service.engine.sessions["mlp"].stats.warmup_count


def test_batch_1_warms_after_the_answer_and_a_new_planned_batch_of_a_serving_session_holds_nothing(tmp_path):
    data = model_bytes(mlp_small(hidden=32))
    db = ModelDatabase(tmp_path)
    db.add_model("mlp", [data])
    desc = model_desc(db.model("mlp"), {}, True)
    db.close()

    async def main() -> list[tuple[int, int]]:
        engine = Engine(SlidingWindowEarlyDrop())
        service = BackendService(BackendConfig(), engine)

        async def fetch(sha256: str) -> bytes:
            assert sha256 == desc.sha256
            return data
        service.tables._fetch = fetch
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
