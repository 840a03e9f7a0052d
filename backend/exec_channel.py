"""One frontend's requests on this backend, whichever transport carries them (the framed execute
channel, backend/framed_exec.py, or the gRPC ``Execute`` stream).

Contract: :meth:`ExecChannel.receive` takes each ``ExecItem`` on the event loop as it arrives and
every request gets exactly one ``ExecResult`` through ``reply`` (also on the loop): its outcome, an
error when it cannot be queued, or ``EXEC_CANCELLED`` when the frontend cancelled it before it ran.
:meth:`ExecChannel.close` (the transport ended) takes every request still queued out of the engine;
nobody waits for their answers any more.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from backend.engine import Engine
from backend.wire import encode_result
from backend.work import ExecError, Outcome, Work
from common.exec_status import ExecStatus
from common.pb import control


class Executor(Protocol):
    """What a channel needs of the backend service (backend/server.py's BackendService)."""

    engine: Engine
    in_flight: int

    def work(self, item: control.ExecItem, now: float, done: Callable[[Outcome], None]) -> Work: ...


class ExecChannel:
    def __init__(self, executor: Executor, reply: Callable[[control.ExecResult], None]) -> None:
        self._executor = executor
        self._engine = executor.engine
        self._reply = reply
        self._queued: dict[int, object] = {}     # request id -> its engine entry, until answered

    def receive(self, item: control.ExecItem) -> None:
        received_ns = time.monotonic_ns()
        request_id = item.request_id
        if item.cancel:         # the client gave up: a request still queued never runs
            entry = self._queued.pop(request_id, None)
            if entry is not None and self._engine.cancel(entry):
                self._executor.in_flight -= 1
                self._reply(encode_result(request_id, Outcome(ExecStatus.CANCELLED, "cancelled by the frontend"),
                                          received_ns))
            return
        try:
            work = self._executor.work(item, self._engine.clock(), self._completer(request_id, received_ns))
            self._queued[request_id] = self._engine.submit(work)
        except ExecError as exc:
            self._reply(encode_result(request_id, Outcome(exc.status, str(exc)), received_ns))
            return
        self._executor.in_flight += 1

    def _completer(self, request_id: int, received_ns: int) -> Callable[[Outcome], None]:
        def done(outcome: Outcome) -> None:     # on the loop: the engine delivers a batch at a time
            self._executor.in_flight -= 1
            self._queued.pop(request_id, None)
            self._reply(encode_result(request_id, outcome, received_ns))
        return done

    def close(self) -> None:
        queued, self._queued = self._queued, {}
        for entry in queued.values():
            if self._engine.cancel(entry):
                self._executor.in_flight -= 1
