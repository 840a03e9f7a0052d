"""How each simulated request ended: one status per request, the client's latency, and why a failed
request's backend went away. Every request ends exactly once (:meth:`Outcomes.end` refuses a second
ending), which the conservation test checks."""

from __future__ import annotations

import enum
from array import array

import numpy as np


class Status(enum.IntEnum):
    PENDING = 0             # not ended yet (none is left when a simulation ends)
    ON_TIME = 1             # answered within its SLO
    LATE = 2                # answered after its SLO
    DROPPED = 3             # DEADLINE_EXCEEDED: dropped by the backend (early drop, or expired)
    UNAVAILABLE = 4         # UNAVAILABLE: no backend serves its model
    OVERLOADED = 5          # UNAVAILABLE: its backend's queue was full
    EXPIRED = 6             # DEADLINE_EXCEEDED: its time ran out before a backend took it


class Loss(enum.IntEnum):
    """Why a failed request's backend let it go: what the requests lost to change are counted by."""

    NONE = 0
    FAULT = 1               # its backend was killed
    SCALE_DOWN = 2          # its backend drained, or unloaded its model in a re-plan
    EVICTED = 3             # its backend unloaded its model because the plan left it cold (paged out)


FAILED = (Status.DROPPED, Status.UNAVAILABLE, Status.OVERLOADED, Status.EXPIRED)


class Outcomes:
    """Kept in plain Python buffers while the simulation runs (a numpy scalar per request cost more
    than the rest of its handling) and read as numpy arrays afterwards."""

    def __init__(self, count: int) -> None:
        self._status = bytearray(count)
        self._latency_ms = array("d", bytes(8 * count))
        self._loss = bytearray(count)             # set when a backend let the request go
        self._found_cold = bytearray(count)       # set when its model was cold (on no device) as it came
        self.ended = 0

    def end(self, request: int, status: Status, latency_ms: float = float("nan")) -> None:
        if self._status[request]:
            raise RuntimeError(f"request {request} ended twice ({Status(self._status[request]).name}, "
                               f"then {status.name})")
        self._status[request] = status
        self._latency_ms[request] = latency_ms
        self.ended += 1

    def let_go(self, request: int, why: Loss) -> None:
        """The request's backend let it go (it is retried elsewhere while its deadline allows)."""
        self._loss[request] = why

    def found_cold(self, request: int) -> None:
        """The request found its model cold, and waited for it to be paged in."""
        self._found_cold[request] = 1

    @property
    def status(self) -> np.ndarray:
        return np.frombuffer(bytes(self._status), dtype=np.int8)

    @property
    def latency_ms(self) -> np.ndarray:
        return np.frombuffer(self._latency_ms.tobytes(), dtype=np.float64)

    @property
    def loss(self) -> np.ndarray:
        return np.frombuffer(bytes(self._loss), dtype=np.int8)

    @property
    def cold(self) -> np.ndarray:
        """True where the request found its model cold."""
        return np.frombuffer(bytes(self._found_cold), dtype=np.int8).astype(bool)
