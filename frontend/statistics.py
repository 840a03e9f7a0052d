"""Backends' session statistics summed per model, cumulative and monotone as Triton's are.

perf_analyzer reads ModelStatistics before and after each measurement window and subtracts (in
unsigned arithmetic): a figure that goes down turns into a huge number. A backend's counters belong
to its sessions, though, and go away with them: when the scheduler moves a session to another
backend, when a backend restarts or dies, or when one Stats call fails. :class:`StatsBook` keeps the
last snapshot of every backend it has heard from and, when a session's counters vanish or restart,
folds what it had last seen of them into a retired total, so every sum it reports only grows.
(What a session did between the last snapshot and its end is not seen; the sums stay consistent.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

# SessionStats fields that add up over backends (per-request sums and counts, batches).
SUMMED = ("success_count", "queue_ns", "request_compute_input_ns", "request_compute_infer_ns",
          "request_compute_output_ns", "execution_count")


@dataclass
class ModelTotals:
    """One model's figures summed over backends (and over sessions that have ended)."""

    sums: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUMMED, 0))
    last_inference_ms: int = 0
    batches: dict[int, list[int]] = field(default_factory=dict)   # size -> [batches, input, infer, output ns]

    def add(self, s) -> None:
        """Add one ``control.SessionStats``."""
        for key in SUMMED:
            self.sums[key] += getattr(s, key)
        self.last_inference_ms = max(self.last_inference_ms, s.last_inference_ms)
        for size, count in s.batch_histogram.items():
            entry = self.batches.setdefault(size, [0, 0, 0, 0])
            entry[0] += count
            entry[1] += s.batch_compute_input_ns.get(size, 0)
            entry[2] += s.batch_compute_ns.get(size, 0)
            entry[3] += s.batch_compute_output_ns.get(size, 0)

    def merged(self, other: "ModelTotals") -> "ModelTotals":
        out = ModelTotals({k: v + other.sums[k] for k, v in self.sums.items()},
                          max(self.last_inference_ms, other.last_inference_ms),
                          {size: list(entry) for size, entry in self.batches.items()})
        for size, entry in other.batches.items():
            mine = out.batches.setdefault(size, [0, 0, 0, 0])
            for i, value in enumerate(entry):
                mine[i] += value
        return out


def reported_executions(executions: int, inferences: int, previous: tuple[int, int] = (0, 0)) -> int:
    """The execution count to report beside ``inferences`` rows, after ``previous`` (the execution and
    inference counts reported last time). Backends count a batch when it runs, the frontend its rows
    when the replies arrive, so a snapshot taken in between would show more executions than
    inferences, which perf_analyzer refuses (it requires 0 < executions <= inferences over a window).
    A batch is reported once its rows are, and never more executions than rows between any two
    reports: then no window, whichever two reports it spans, shows more. The count only grows."""
    reported, rows = previous
    return max(reported, min(executions, reported + max(inferences - rows, 0)))


def _restarted(old, new) -> bool:
    return new.success_count < old.success_count or new.execution_count < old.execution_count


@dataclass
class _Snapshot:
    node_id: str
    taken: float                  # when the call that brought it was issued (monotonic clock)
    sessions: dict             # model -> control.SessionStats


class StatsBook:
    """The last ``BackendStats`` of each backend address, and the retired totals per model."""

    def __init__(self) -> None:
        self._last: dict[str, _Snapshot] = {}
        self._retired: dict[str, ModelTotals] = {}

    def record(self, address: str, reply, issued_at: float) -> None:
        """A ``control.BackendStats`` from ``address``, asked for at ``issued_at``; an older answer than
        the one held (concurrent ModelStatistics calls) is ignored."""
        old = self._last.get(address)
        if old is not None and issued_at < old.taken:
            return
        sessions = {s.model: s for s in reply.sessions}
        if old is not None:
            for model, before in old.sessions.items():
                now = sessions.get(model)
                if old.node_id != reply.node_id or now is None or _restarted(before, now):
                    self._retired.setdefault(model, ModelTotals()).add(before)
        self._last[address] = _Snapshot(reply.node_id, issued_at, sessions)

    def totals(self, model: str) -> ModelTotals:
        """Everything seen of ``model``: the last snapshot of every backend plus the retired sessions."""
        total = ModelTotals()
        for snap in self._last.values():
            s = snap.sessions.get(model)
            if s is not None:
                total.add(s)
        retired = self._retired.get(model)
        return total.merged(retired) if retired is not None else total
