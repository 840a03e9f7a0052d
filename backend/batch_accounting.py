"""A batch's accounting: its inputs gathered from the requests, its outputs split back, its time cut
into phases, and what it adds to its session's statistics and its requests' outcomes. The engine's
plain path and its prefix-group path both go through these, so the two count alike.

Statistics, phase by phase, as Triton reports them (:class:`Phases`): a batch's time on the executor
is cut into gathering its inputs (concatenating the requests' arrays), running the model (in a
group: the prefix and every suffix) and splitting its outputs into each request's part. Each
successful request adds its queue time and its batch's three phases to the session's per-request
sums, in one step with ``success_count``, under :attr:`Engine.stats_lock`, so that a snapshot
always holds as many queue and compute samples as successes (perf_analyzer refuses figures whose
compute counts differ). Serialising the outputs (on the event loop, per request) is not a phase:
like Triton's gRPC encoding, it falls in the overhead outside queue and compute.

Statistics of a session in a group: ``inference_count`` counts its own rows, while a batch counts
once per member present in it, under the size of the *merged* batch (``batch_histogram``) and with
the time of the whole group batch (``compute_ns``): what its requests experienced. Memory: a
member reports its suffix; the group's first member (by name) also reports the prefix, so the
prefix's weights are counted once when memory is summed over sessions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from backend.work import Outcome, Work
from common.exec_status import ExecStatus


@dataclass
class SessionStats:
    inference_count: int = 0      # rows executed
    execution_count: int = 0      # batches executed
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    dropped: int = 0
    cancelled: int = 0            # requests taken off the queue by their frontend, never run
    last_inference_ms: int = 0
    batch_histogram: dict[int, int] = field(default_factory=dict)
    batch_compute_ns: dict[int, int] = field(default_factory=dict)          # the infer phase
    # Triton's phases (module docstring, "Statistics"): per successful request, its batch's time in each.
    request_compute_input_ns: int = 0
    request_compute_infer_ns: int = 0
    request_compute_output_ns: int = 0
    # Per batch size (rows): the batches' input and output phases (batch_compute_ns holds the infer phase).
    batch_compute_input_ns: dict[int, int] = field(default_factory=dict)
    batch_compute_output_ns: dict[int, int] = field(default_factory=dict)
    # Warm-up before the session (or a new runtime of it) took traffic here: apart from everything above.
    warmup_count: int = 0
    warmup_ns: int = 0

    def add_batch(self, rows: int, phases: "Phases") -> None:
        """One batch of ``rows`` rows that this session ran (or, in a prefix group, took part in)."""
        self.execution_count += 1
        self.compute_ns += phases.total_ns
        self.batch_histogram[rows] = self.batch_histogram.get(rows, 0) + 1
        self.batch_compute_input_ns[rows] = self.batch_compute_input_ns.get(rows, 0) + phases.input_ns
        self.batch_compute_ns[rows] = self.batch_compute_ns.get(rows, 0) + phases.infer_ns
        self.batch_compute_output_ns[rows] = self.batch_compute_output_ns.get(rows, 0) + phases.output_ns

    def add_success(self, queue_ns: int, success_ns: int, phases: "Phases") -> None:
        """One request answered from a batch: its queue time, and its batch's phases."""
        self.success_count += 1
        self.success_ns += success_ns
        self.queue_ns += queue_ns
        self.request_compute_input_ns += phases.input_ns
        self.request_compute_infer_ns += phases.infer_ns
        self.request_compute_output_ns += phases.output_ns


@dataclass(frozen=True, slots=True)
class Phases:
    """A batch's time on the executor, cut where Triton cuts it: gathering the requests' inputs into
    the batch (``input_ns``), running the model (``infer_ns``) and splitting the outputs into each
    request's part (``output_ns``); ``start`` and ``end`` are the clock's readings in seconds around
    all three. Made by :func:`phases_of`, which works the nanoseconds out once per batch."""

    start: float
    end: float
    input_ns: int
    infer_ns: int
    output_ns: int

    @property
    def total_ns(self) -> int:
        return self.input_ns + self.infer_ns + self.output_ns


def gather(specs, works: list[Work]) -> dict[str, np.ndarray]:
    """The batch's inputs by name: each request's rows, concatenated in order (one request's as they are)."""
    if len(works) == 1:
        return {spec.name: works[0].arrays[i] for i, spec in enumerate(specs)}
    return {spec.name: np.concatenate([w.arrays[i] for w in works]) for i, spec in enumerate(specs)}


def split(outputs: list[np.ndarray], works: list[Work]) -> list[list[np.ndarray]]:
    """Each request's rows of the batch's outputs (views, no copy), in order."""
    parts, offset = [], 0
    for w in works:
        parts.append([o[offset:offset + w.rows] for o in outputs])
        offset += w.rows
    return parts


def count_batch(stats: SessionStats, works: list[Work], batch_rows: int, phases: Phases, error: str | None,
           now_ms: int) -> None:
    """One batch of ``batch_rows`` in a session's counters, its ``works`` among them (under the stats lock)."""
    stats.inference_count += sum(w.rows for w in works)
    stats.add_batch(batch_rows, phases)
    stats.last_inference_ms = now_ms
    for w in works:
        if error is None:
            stats.add_success(max(int((phases.start - w.arrival_s) * 1e9), 0), int((phases.end - w.arrival_s) * 1e9),
                              phases)
        else:
            stats.fail_count += 1


def outcomes(works: list[Work], parts: list[list[np.ndarray]], error: str | None, phases: Phases, batch_rows: int,
              answers: list) -> None:
    """Each request's outcome: its outputs, or ``error``."""
    if error is not None:
        answers.extend((w, Outcome(ExecStatus.INTERNAL, error)) for w in works)
        return
    start, compute_ns, input_ns = phases.start, phases.total_ns, phases.input_ns
    for i, w in enumerate(works):
        answers.append((w, Outcome(ExecStatus.OK, outputs=parts[i], queue_ns=max(int((start - w.arrival_s) * 1e9), 0),
                                   compute_ns=compute_ns, batch_size=batch_rows, input_ns=input_ns,
                                   first_in_batch=i == 0)))


def phases_of(start: float, gathered: float, ran: float, end: float, error: str | None) -> Phases:
    """The batch's phases from the clock's readings; a failed batch's time all counts as its infer
    phase (where it failed is not worth telling apart, and only the batch's counters see it)."""
    if error is not None:
        gathered, ran = start, end
    return Phases(start, end, max(int((gathered - start) * 1e9), 0), max(int((ran - gathered) * 1e9), 0),
                  max(int((end - ran) * 1e9), 0))
