"""A backend's model tables arrive one plan at a time, but a plan's release step (globalsched/actuators/handover.py)
is pushed in the background and can be still waiting for the table lock when the next plan's tables
come: the older table is answered without effect, as one older than the table applied is, so that a
cold model's page-in does not wait behind a table that the newer one supersedes."""

from __future__ import annotations

import asyncio

from backend.engine import Engine
from backend.server import BackendService
from common.batch_decision import SlidingWindowEarlyDrop
from common.config import BackendConfig
from common.pb import control


def test_a_table_queued_behind_a_newer_one_is_answered_without_effect():
    async def main() -> tuple[list, int]:
        engine = Engine(SlidingWindowEarlyDrop(), lambda: 0.0, wall_clock=lambda: 0.0, start=False)
        service = BackendService(BackendConfig(), engine)
        applied: list[int] = []
        set_sessions = engine.set_sessions

        def spy(sessions, groups):
            applied.append(service.epoch)
            return set_sessions(sessions, groups)

        engine.set_sessions = spy
        await service.UpdateModelTable(control.ModelTable(epoch=10), None)
        async with service.tables.lock:         # table 10 is still being applied...
            older = asyncio.create_task(service.UpdateModelTable(control.ModelTable(epoch=11), None))
            newer = asyncio.create_task(service.UpdateModelTable(control.ModelTable(epoch=12), None))
            await asyncio.sleep(0.05)           # ...while 11, then 12, wait for the lock
        await asyncio.gather(older, newer)
        stale = asyncio.create_task(service.UpdateModelTable(control.ModelTable(epoch=11), None))
        await stale                              # older than the table applied
        return applied, service.epoch

    applied, epoch = asyncio.run(main())
    assert applied == [10, 12] and epoch == 12
