"""A model table's loads and warm-ups overlap (backend/model_table.py): its models are fetched from the
scheduler ahead of the loads (a few models' bytes at most), and a session's warm-up runs as soon as its
runtime is loaded, while the next models load. A backend given many models at once, a new one at a load step,
then answers sooner. Real ONNX Runtime sessions on a real engine thread; the fetches are the test's."""

from __future__ import annotations

import asyncio

import pytest

import backend.model_table as model_table
from backend.engine import Engine
from backend.server import BackendService
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig
from common.pb import control
from common.sample_models import mlp_small, model_bytes
from globalsched.rpc.convert import model_desc
from globalsched.state.modeldb import ModelDatabase

WAIT_S = 10.0       # far beyond what a load and a warm-up of these models take


def _models(tmp_path, n: int) -> tuple[dict[str, bytes], list[control.ModelDesc]]:
    """``n`` distinct MLPs: their bytes by sha256, and their descriptions."""
    db = ModelDatabase(tmp_path)
    data, descs = {}, []
    for i in range(n):
        blob = model_bytes(mlp_small(hidden=16 + 8 * i))
        db.add_model(f"m{i}", [blob])
        desc = model_desc(db.model(f"m{i}"), {}, True)
        data[desc.sha256] = blob
        descs.append(desc)
    db.close()
    return data, descs


def _table(descs: list[control.ModelDesc], epoch: int = 1) -> control.ModelTable:
    return control.ModelTable(epoch=epoch, sessions=[control.SessionEntry(model=d, slo_ms=100.0, batch=4)
                                                     for d in descs])


def test_a_session_warms_up_while_the_next_model_is_still_being_fetched(tmp_path):
    data, descs = _models(tmp_path, 2)
    first, second = descs

    async def main() -> tuple[list[bool], control.ModelTableReply, int]:
        service = BackendService(BackendConfig(), Engine(SlidingWindowEarlyDrop()))
        warmed_first = asyncio.Event()
        seen: list[bool] = []           # whether the first was warm when the second's bytes came
        warm_up = service.engine.warm_up

        def spy(batches, budget_s, deferred=False):
            job = warm_up(batches, budget_s, deferred)
            if not deferred and service.tables.warming == {"m0"}:      # the first session's warm-up
                job.add_done_callback(lambda _: loop.call_soon_threadsafe(warmed_first.set))
            return job

        async def fetch(sha256: str) -> bytes:
            if sha256 == second.sha256:         # the second model's bytes come once the first is warm
                try:
                    await asyncio.wait_for(warmed_first.wait(), WAIT_S)
                    seen.append(True)
                except asyncio.TimeoutError:
                    seen.append(False)
            return data[sha256]

        loop = asyncio.get_running_loop()
        service.engine.warm_up = spy
        service.tables._fetch = fetch
        try:
            reply = await service.UpdateModelTable(_table(descs), None)
        finally:
            service.engine.stop()
        return seen, reply, service.engine.sessions["m0"].stats.warmup_count

    seen, reply, warmups = asyncio.run(main())
    assert sorted(reply.loaded) == ["m0", "m1"] and not reply.failed
    assert warmups == 1
    assert seen == [True], "the first session waited for the second model's bytes to warm up"


def test_fetches_run_a_few_ahead_of_the_loads_and_a_failed_one_fails_only_its_model(tmp_path, monkeypatch,
                                                                                     caplog):
    monkeypatch.setattr(model_table, "FETCHES_AHEAD", 2)
    data, descs = _models(tmp_path, 4)
    started: list[str] = []
    started_at_loads: list[int] = []            # fetches started when each load began
    load = model_table.load_runtime

    def counted_load(*args, **kwargs):
        started_at_loads.append(len(started))
        return load(*args, **kwargs)

    monkeypatch.setattr(model_table, "load_runtime", counted_load)

    async def main() -> tuple[int, control.ModelTableReply]:
        service = BackendService(BackendConfig(), Engine(SlidingWindowEarlyDrop()))
        in_flight, most = 0, 0

        async def fetch(sha256: str) -> bytes:
            nonlocal in_flight, most
            started.append(sha256)
            in_flight += 1
            most = max(most, in_flight)
            try:
                await asyncio.sleep(0.05)
                if sha256 == descs[1].sha256:
                    raise ConnectionError("the scheduler went away")
                return data[sha256]
            finally:
                in_flight -= 1

        service.tables._fetch = fetch
        try:
            reply = await service.UpdateModelTable(_table(descs), None)
        finally:
            service.engine.stop()
        return most, reply

    most, reply = asyncio.run(main())
    assert most == 2 and started_at_loads[0] <= 3     # two ahead, and the one taken made room for the third
    assert sorted(reply.loaded) == ["m0", "m2", "m3"]
    assert list(reply.failed) == ["m1: ConnectionError: the scheduler went away"]
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("which", ["load", "warm-up samples"])
def test_a_session_that_cannot_load_leaves_the_others_warmed_and_serving(tmp_path, which):
    data, descs = _models(tmp_path, 3)
    bad = control.ModelDesc()
    bad.CopyFrom(descs[1])
    if which == "load":
        data[bad.sha256] = b"not an onnx model"
    else:                                   # a sample that names no input of the model
        bad.warmup.add(name="s", batch_size=1).inputs.add(name="nope", zero_data=True)

    async def main() -> tuple[control.ModelTableReply, dict[str, int], set[str]]:
        service = BackendService(BackendConfig(), Engine(SlidingWindowEarlyDrop()))

        async def fetch(sha256: str) -> bytes:
            return data[sha256]

        service.tables._fetch = fetch
        try:
            reply = await service.UpdateModelTable(_table([descs[0], bad, descs[2]]), None)
        finally:
            service.engine.stop()
        return (reply, {n: s.stats.warmup_count for n, s in service.engine.sessions.items()},
                service.tables.warming)

    reply, warmups, warming = asyncio.run(main())
    assert sorted(reply.loaded) == ["m0", "m2"]
    assert len(reply.failed) == 1 and reply.failed[0].startswith("m1: ")
    assert warmups == {"m0": 1, "m2": 1} and warming == set()
