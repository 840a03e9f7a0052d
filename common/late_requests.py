"""What becomes of a request of a model that can no longer meet its SLO: a per-model setting.

- ``drop`` (the default, Nexus's): the request is answered DEADLINE_EXCEEDED as soon as it cannot
  make its deadline, early where the calibrated profile says its batch would end too late
  (common/batch_decision.py), so that the device's time goes to requests that can still make theirs.
- ``serve`` (Triton's behaviour): the SLO (or the request's ``timeout`` parameter, which stands for
  it) still orders and batches the request and counts it as late, but it is run however late; it
  fails only at the client's gRPC deadline, or after :data:`SERVE_LATE_LIMIT_S` without one. For clients that
  prefer a late answer to none, such as perf_analyzer, which stops a measurement at the first
  failed request.

Set at upload (``nexus models upload --late-requests serve``) and carried in ``ModelDesc`` to the
frontends (which wait) and the backends (whose batching decision then drops nothing of the model).
"""

from __future__ import annotations

import enum

from common.pb import control

SERVE_LATE_LIMIT_S = 30.0


class LateRequests(enum.Enum):
    DROP = "drop"
    SERVE = "serve"

    @staticmethod
    def from_pb(value: int) -> "LateRequests":
        """The wire's value (DEFAULT: DROP)."""
        return LateRequests.SERVE if value == control.LATE_REQUESTS_SERVE else LateRequests.DROP

    def to_pb(self) -> int:
        return control.LATE_REQUESTS_SERVE if self is LateRequests.SERVE else control.LATE_REQUESTS_DROP
