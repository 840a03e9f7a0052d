"""What a backend serves: a :class:`Session` per model (its runtime, queue, batch limits and
statistics) and a :class:`SharedPrefix` for models batched through one shared prefix.

Prefix batching (Nexus section 6.1): sessions of one :class:`SharedPrefix` (models that share
their first layers, split by the backend into one prefix runtime and a suffix runtime per model)
are scheduled as one unit. Their queues are merged in deadline order, the policy picks one batch
from the merged queue (max batch and l(b) are the group's), the prefix runs once on the rows of
every request in it, and each member's suffix runs on its own slice of the prefix's output.
Sessions outside any group take the plain path, which is unchanged.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from backend.batch_accounting import SessionStats
from backend.calibration import Calibration
from common.batch_decision import Pending, saturated_batch
from common.profile import Profile
from common.tensors import TensorSpec


class Session:
    """One model served on this backend: its runtime, queue, policy parameters and statistics.
    ``serve_late``: its late requests are run, not dropped (common/late_requests.py). A prefix group's
    merged queue has one policy: it serves late when any member does (the others' late requests
    then fail at their deadline in the frontend, which takes them off the queue, rather than early).

    In a :class:`SharedPrefix`, ``runtime`` is the model's suffix (it reads the prefix's output)
    and ``inputs``/``outputs`` are given: the whole model's, which requests are checked against.
    """

    def __init__(self, name: str, runtime, slo_ms: float, planned_batch: int, profile: Profile | None,
                 sha256: str = "", max_queue: int = 4096, *, inputs: tuple[TensorSpec, ...] | None = None,
                 outputs: tuple[TensorSpec, ...] | None = None, model: str = "", serve_late: bool = False) -> None:
        self.name = name
        self.serve_late = serve_late        # run its requests however late (common/late_requests.py)
        self.model = model or name
        self.runtime = runtime
        self.sha256 = sha256
        self.inputs: tuple[TensorSpec, ...] = tuple(runtime.inputs if inputs is None else inputs)
        self.outputs: tuple[TensorSpec, ...] = tuple(runtime.outputs if outputs is None else outputs)
        self.slo_ms = slo_ms
        self.profile = profile
        self.planned_batch = max(1, planned_batch)
        self._cap = (None, 0)            # (the calibration factor it was computed for, max batch)
        self.max_queue = max_queue
        self.queue: list[Pending] = []          # sorted by (deadline, id); the executor's
        self.depth = QueueDepth()
        self.stats = SessionStats()
        self.group: SharedPrefix | None = None
        self.calibration = Calibration()        # observed batch times against l(b) (backend/calibration.py)

    @property
    def max_batch(self) -> int:
        """The largest batch of this session here: Nexus's saturated batch (the largest b with
        2 * expected(b) <= SLO, within the profile) on the calibrated estimate, never below the planned
        batch. A profile that over-states l(b) would otherwise cap the batch, and the device's
        throughput, below what it delivers within the SLO."""
        factor = self.calibration.factor
        if self._cap[0] != factor:
            self._cap = (factor, max(self.planned_batch, session_max_batch(self.profile, self.slo_ms, factor)))
        return self._cap[1]

    @property
    def memory_mb(self) -> float:
        """This session's runtime (a member's suffix, plus the prefix on the group's first member)."""
        mb = self.runtime.memory_mb()
        group = self.group
        if group is not None and group.members[0] is self:
            mb += group.runtime.memory_mb()
        return mb

    def latency_ms(self, batch: int) -> float:
        """l(b) from the profile, extended linearly past its largest batch; 0 without a profile."""
        p = self.profile
        if p is None:
            return 0.0
        if batch <= p.max_batch:
            return p.latency_ms(batch)
        per_item = (p.latency_ms(p.max_batch) - p.latency_ms(1)) / max(p.max_batch - 1, 1)
        return p.latency_ms(p.max_batch) + per_item * (batch - p.max_batch)

    def expected_ms(self, batch: int) -> float:
        """How long a batch of ``batch`` rows will take here: l(b) times the calibration's median ratio
        of observed to profiled batch times (the batching decision's estimate; planning keeps l(b))."""
        return self.latency_ms(batch) * self.calibration.factor


def session_max_batch(profile: Profile | None, slo_ms: float, factor: float = 1.0) -> int:
    """The saturated batch of a session (:func:`common.batch_decision.saturated_batch`) with its profile's
    l(b) times ``factor``, at least 1; 32 unprofiled. The engine asks whenever its calibration moves
    (most batches), so this bisects the profile's latency envelope: the same b as the scan from b = 1
    that stops at the first miss, in log(max batch) steps (tests/unit/test_policies.py)."""
    if profile is None:
        return 32
    return max(1, bisect.bisect_right(profile.latency_envelope_ms, slo_ms, key=lambda m: 2.0 * (m * factor)))


@dataclass
class QueueDepth:
    """Requests of a session in the engine, from counters each written by one thread only (so no
    update is lost without a lock): ``submitted`` and ``cancelled`` by the loop, ``retired`` (run or
    dropped) by the executor."""

    submitted: int = 0
    cancelled: int = 0
    retired: int = 0

    @property
    def queued(self) -> int:
        return self.submitted - self.cancelled - self.retired


@dataclass
class GroupStats:
    execution_count: int = 0      # merged batches executed through the prefix
    inference_count: int = 0      # rows through the prefix
    compute_ns: int = 0           # whole group batches (prefix + suffixes)
    prefix_ns: int = 0            # the prefix alone
    batch_histogram: dict[int, int] = field(default_factory=dict)


class SharedPrefix:
    """Sessions whose models share a prefix, batched through one prefix runtime (module docstring).

    ``runtime`` computes the shared layers and outputs ``cut_tensor``; every member's ``runtime`` is
    its suffix, whose one input takes that tensor (its name may differ from model to model). Members
    are kept sorted by name; the first one carries the prefix's memory in :attr:`Session.memory_mb`.
    The group's max batch is the largest b with 2*l(b) <= the tightest member SLO (l: see
    :meth:`latency_ms`), never below the sum of the members' planned batches.
    """

    def __init__(self, name: str, runtime, cut_tensor: str, members: "list[Session]", prefix_id: str = "") -> None:
        if len(members) < 1:
            raise ValueError("a shared prefix needs members")
        self.name = name
        self.prefix_id = prefix_id
        self.runtime = runtime
        self.cut_tensor = cut_tensor
        self.members: tuple[Session, ...] = tuple(sorted(members, key=lambda m: m.name))
        self.by_name = {m.name: m for m in self.members}
        for m in self.members:
            m.group = self
        self.slo_ms = min(m.slo_ms for m in self.members)
        self._profiled = [m for m in self.members if m.profile is not None]
        planned = sum(m.planned_batch for m in self.members)
        profiled = [m.profile for m in self.members if m.profile is not None]
        if profiled:
            best = max(1, saturated_batch(self.latency_ms, self.slo_ms, max(p.max_batch for p in profiled)))
        else:
            best = max(m.max_batch for m in self.members)
        self.max_batch = max(planned, best)
        self.stats = GroupStats()

    def latency_ms(self, batch: int) -> float:
        """l(b) of a merged batch: the prefix plus one suffix, estimated by the fastest member's whole
        model at b (0 without profiles).

        Every member's profile measures the same prefix plus a head; they differ mostly by measurement
        noise, which only ever inflates a figure, so the smallest is the best estimate. (The other
        members' suffixes are not counted: a group forms when the prefix carries most of the work.)
        """
        if self._profiled:
            return min(m.latency_ms(batch) for m in self._profiled)
        return 0.0

    @property
    def memory_mb(self) -> float:
        return self.runtime.memory_mb()
