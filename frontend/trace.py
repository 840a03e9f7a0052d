"""Per-request timelines (``nexus frontend --trace PATH``): where a request's time goes.

For one request in ``--trace-every`` (a model request, not a query), the frontend appends one JSON
object per line to PATH::

    {"model": "m", "rows": 1, "batch_size": 4, "status": "OK", "total_ns": 812345,
     "phases_ns": {"validate": ..., "route": ..., "hop": ..., "backend_edge": ..., "queue": ...,
                   "batch_assembly": ..., "compute": ..., "response": ...}}

The phases follow the request in order and add up to ``total_ns`` exactly:

- ``validate``: from the handler's start (the gRPC message already received and parsed) to the
  request validated against the model's description;
- ``route``: choosing a backend and building the item (and any earlier attempt that failed over);
- ``hop``: the frontend-backend-frontend round trip less the backend's own time: serialisation,
  gRPC and the socket both ways, and the wake-up of the waiting request on the frontend's loop;
- ``backend_edge``: the backend's time outside its queue and the model: decoding the item,
  queueing it in the engine, handing the result from the executor thread back to the backend's
  event loop, encoding the reply;
- ``queue``: waiting in the backend's queue for its batch to start;
- ``batch_assembly``: gathering the batch's inputs (concatenation);
- ``compute``: running the model and splitting its outputs;
- ``response``: building the KServe response and counting it.

What is outside: gRPC's own receive and parse of the client's message before the handler runs,
and the serialisation and send of the response after it returns.

Lines are buffered and written by :meth:`Tracer.flush` (each workload report, and at exit), so that
tracing costs the request path no file I/O.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

PHASES = ("validate", "route", "hop", "backend_edge", "queue", "batch_assembly", "compute", "response")


@dataclass(slots=True)
class Marks:
    """Clock readings (``time.monotonic_ns``) of one traced request, set along its path."""

    start: int
    validated: int = 0
    sent: int = 0
    replied: int = 0


def phases(marks: Marks, end_ns: int, reply) -> dict[str, int]:
    """The phases of a request answered by ``reply`` (a ``frontend.backend_pool.Reply``), in order;
    they add up to ``end_ns - marks.start``."""
    backend = reply.backend_ns
    compute = reply.compute_ns
    assembly = min(reply.compute_input_ns, compute)
    return {
        "validate": marks.validated - marks.start,
        "route": marks.sent - marks.validated,
        "hop": marks.replied - marks.sent - backend,
        "backend_edge": backend - reply.queue_ns - compute,
        "queue": reply.queue_ns,
        "batch_assembly": assembly,
        "compute": compute - assembly,
        "response": end_ns - marks.replied,
    }


class Tracer:
    """Samples one request in ``every`` and appends its timeline to ``path`` as a JSON line."""

    def __init__(self, path: str, every: int = 1) -> None:
        self.path = path
        self.every = max(int(every), 1)
        self._seen = 0
        self._lines: list[str] = []
        with open(path, "a", encoding="utf-8"):   # fail at start, with the OS's reason, not per request
            pass

    def start(self) -> Marks | None:
        """Marks for this request when it is sampled, else None."""
        self._seen += 1
        if self._seen % self.every:
            return None
        return Marks(time.monotonic_ns())

    def record(self, model: str, rows: int, marks: Marks, reply) -> None:
        end = time.monotonic_ns()
        ph = phases(marks, end, reply)
        self._lines.append(json.dumps({"time": time.time(), "model": model, "rows": rows,
                                       "batch_size": reply.batch_size, "status": reply.status.name,
                                       "total_ns": end - marks.start, "phases_ns": ph}))

    def flush(self) -> None:
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
