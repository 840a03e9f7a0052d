"""How a backend answered one request: one enum from the engine, over the wire, to the frontend.

Its values are the control protocol's ``ExecStatus`` (protos/nexus/control.proto), so a reply carries
it as it is; the frontend turns it into the client's gRPC or HTTP status at its edge
(frontend/frontend_state.py).
"""

from __future__ import annotations

import enum

from common.pb import control


class ExecStatus(enum.IntEnum):
    OK = control.EXEC_OK
    NOT_FOUND = control.EXEC_NOT_FOUND          # the model is not loaded there (a stale route)
    INVALID = control.EXEC_INVALID              # bad input
    DEADLINE = control.EXEC_DEADLINE            # dropped: it could not meet its deadline
    OVERLOADED = control.EXEC_OVERLOADED        # the session's queue is full
    INTERNAL = control.EXEC_INTERNAL
    CANCELLED = control.EXEC_CANCELLED          # the frontend cancelled it before it ran
    UNAVAILABLE = control.EXEC_UNAVAILABLE      # the backend is draining, or the model failed to load there

    @classmethod
    def from_wire(cls, value: int) -> "ExecStatus":
        """The status a reply carries; a value this version does not know is INTERNAL."""
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL
