"""Models that a backend could not load: a bounded number of attempts, then UNAVAILABLE with the reason.

A model file can pass upload validation (the ONNX checker) and still fail in the runtime, for
example an operator attribute out of range. Each failure, while profiling it or while loading it
from a model table, is recorded against the model and the device type (never the file's content:
another model with the same bytes has its own profiles and its own fate). The scheduler tries
again, on a backend not tried yet when there is one, until ``max_attempts`` failures; then it stops
placing the model on that device type (and query stages that run it), and where no device type is
left the routing table carries the reason so that clients see the model UNAVAILABLE and why. A new
upload or an explicit load starts afresh. Other models are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOAD_ATTEMPTS = 3


@dataclass
class LoadFailures:
    max_attempts: int = MAX_LOAD_ATTEMPTS
    # (model, device type) -> [(node id, reason)] in order
    _failures: dict[tuple[str, str], list[tuple[str, str]]] = field(default_factory=dict)

    def record(self, model: str, device_type: str, node_id: str, reason: str) -> bool:
        """Record one failure (none once the attempts are spent); True while another attempt is allowed."""
        tries = self._failures.setdefault((model, device_type), [])
        if len(tries) < self.max_attempts:
            tries.append((node_id, reason))
        return len(tries) < self.max_attempts

    def forget(self, model: str) -> None:
        """Attempts start afresh for this model (a new upload, an operator's explicit load)."""
        for key in [k for k in self._failures if k[0] == model]:
            del self._failures[key]

    def tried(self, model: str, device_type: str) -> set[str]:
        return {node for node, _ in self._failures.get((model, device_type), ())}

    def exhausted(self, model: str, device_type: str) -> bool:
        return len(self._failures.get((model, device_type), ())) >= self.max_attempts

    def exhausted_types(self, model: str) -> frozenset[str]:
        """The device types with no attempt left for this model."""
        return frozenset(t for (m, t), tries in self._failures.items()
                         if m == model and len(tries) >= self.max_attempts)

    def reason(self, model: str) -> str:
        """Why the model cannot be loaded on a device type where its attempts are spent ("" when none)."""
        for m, device_type in self._failures:
            if m == model and self.exhausted(m, device_type):
                return self.reason_on(model, device_type)
        return ""

    def reason_on(self, model: str, device_type: str) -> str:
        """Why the model cannot be loaded on ``device_type`` ("" while attempts are left)."""
        tries = self._failures.get((model, device_type), ())
        if len(tries) < self.max_attempts:
            return ""
        nodes = len({n for n, _ in tries})
        return (f"cannot load on {device_type} ({len(tries)} attempts on {nodes} backend"
                f"{'s' if nodes != 1 else ''}): {tries[-1][1]}")
