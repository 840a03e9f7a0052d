"""Models that a backend could not load: a bounded number of attempts, then UNAVAILABLE with the reason.

A model file can pass upload validation (the ONNX checker) and still fail in the runtime, for
example an operator attribute out of range. Each failure, while profiling it or while loading it
from a model table, is recorded against the file's sha256 and the device type. The scheduler tries
again, on a backend not tried yet when there is one, until ``max_attempts`` failures; then it stops
placing the model (and query stages that run it), and the routing table carries the reason so
that clients see the model UNAVAILABLE and why. A new upload (another sha256) or an explicit load
starts afresh. Other models are not affected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOAD_ATTEMPTS = 3


@dataclass
class LoadFailures:
    max_attempts: int = MAX_LOAD_ATTEMPTS
    # (sha256, device type) -> [(node id, reason)] in order
    _failures: dict[tuple[str, str], list[tuple[str, str]]] = field(default_factory=dict)

    def record(self, sha256: str, device_type: str, node_id: str, reason: str) -> bool:
        """Record one failure; True while another attempt is allowed."""
        tries = self._failures.setdefault((sha256, device_type), [])
        tries.append((node_id, reason))
        return len(tries) < self.max_attempts

    def forget(self, sha256: str) -> None:
        """Attempts start afresh for this file (an operator's explicit load)."""
        for key in [k for k in self._failures if k[0] == sha256]:
            del self._failures[key]

    def tried(self, sha256: str, device_type: str) -> set[str]:
        return {node for node, _ in self._failures.get((sha256, device_type), ())}

    def exhausted(self, sha256: str, device_type: str) -> bool:
        return len(self._failures.get((sha256, device_type), ())) >= self.max_attempts

    def exhausted_types(self, sha256: str) -> frozenset[str]:
        """The device types with no attempt left for this file."""
        return frozenset(t for (sha, t), tries in self._failures.items()
                         if sha == sha256 and len(tries) >= self.max_attempts)

    def reason(self, sha256: str) -> str:
        """Why the file cannot be served ("" when it never failed everywhere it was tried)."""
        for (sha, device_type), tries in self._failures.items():
            if sha == sha256 and len(tries) >= self.max_attempts:
                nodes = len({n for n, _ in tries})
                return (f"cannot load on {device_type} ({len(tries)} attempts on {nodes} backend"
                        f"{'s' if nodes != 1 else ''}): {tries[-1][1]}")
        return ""
