"""One request inside the engine (:class:`Work`: its decoded inputs and the callback it ends with), how
it ends (:class:`Outcome`, its status one :class:`common.exec_status.ExecStatus`), and a request the
engine refuses before it queues (:class:`ExecError`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from common.exec_status import ExecStatus


class ExecError(Exception):
    """A request the engine refuses, with the status its reply carries."""

    def __init__(self, status: ExecStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Work:
    """One request inside the engine: decoded inputs (``rows`` leading rows each) and its callback."""

    model: str
    arrays: list[np.ndarray]
    rows: int
    deadline_s: float
    arrival_s: float
    done: Callable[["Outcome"], None]
    # deliver(fn, arg) runs fn(arg) where ``done`` belongs (a server passes its loop's
    # call_soon_threadsafe); None: the engine's ``deliver``.
    deliver: Callable[..., object] | None = None


@dataclass
class Outcome:
    status: ExecStatus
    message: str = ""
    outputs: list[np.ndarray] | None = None
    queue_ns: int = 0
    compute_ns: int = 0
    batch_size: int = 0
    input_ns: int = 0                            # part of compute_ns: gathering the batch's inputs
    first_in_batch: bool = False                 # the first request of its model in its batch
