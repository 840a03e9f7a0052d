"""Open-loop load that runs beside a test or scenario until stopped, over ``nexus bench``'s load client."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence

import numpy as np

from nexus.bench.loadgen import BenchError, LoadClient, RunState
from nexus.bench.report import PENDING, BenchReport, BenchSamples


class BackgroundLoad:
    """Open-loop load from a thread and event loop of its own until :meth:`stop`: for tests and
    scenarios that kill, pause or restart nodes while requests flow.

    A :class:`LoadClient` run of at most ``max_duration_s`` at ``rate_rps`` (``cv``: 1 Poisson, 0
    evenly spaced; see :mod:`common.arrivals`) with SLO ``slo_ms`` and a client deadline of
    ``timeout_s``: a request without an answer by then is counted as ``NO_RESPONSE``.
    ``client_options`` are those of :class:`LoadClient` (several addresses balance over frontends).
    """

    def __init__(self, address: str | Sequence[str], model: str, rate_rps: float, *, slo_ms: float,
                 timeout_s: float = 10.0, cv: float = 1.0, seed: int = 0, max_duration_s: float = 1800.0,
                 **client_options: Any) -> None:
        if not timeout_s * 1000.0 >= slo_ms:
            raise BenchError(f"the client deadline ({timeout_s:g} s) must not be below the SLO ({slo_ms:g} ms)")
        self.client = LoadClient(address, model, seed=seed, **client_options)
        self.rate_rps, self.slo_ms, self.timeout_s, self.cv = rate_rps, slo_ms, timeout_s, cv
        self.max_duration_s = max_duration_s
        self.report: BenchReport | None = None
        self._error: BaseException | None = None
        self._opened = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="background-load", daemon=True)

    async def _run(self) -> None:
        try:
            async with self.client:
                self._opened.set()
                self.report = await self.client.run(
                    self.rate_rps, self.max_duration_s, self.slo_ms, grace_ms=self.timeout_s * 1000.0 - self.slo_ms,
                    cv=self.cv, stop=self._stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc
        finally:
            self._opened.set()

    def start(self, timeout_s: float = 30.0) -> "BackgroundLoad":
        """Start sending once the client reached the frontend (BenchError if it could not)."""
        self._thread.start()
        self._opened.wait(timeout_s)
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def in_flight(self) -> int:
        st = self.client.current
        return st.inflight if st is not None else 0

    def _samples(self) -> BenchSamples:
        st = self.client.current or RunState(0, self.slo_ms)     # none before the run's first line
        k = st.sent
        return BenchSamples(sched_s=st.sched_s[:k], lag_s=st.lag_s[:k], latency_ms=st.latency_ms[:k],
                            outcome=st.outcome[:k], status=st.status[:k], warmup_s=0.0, slo_ms=self.slo_ms,
                            done_s=st.done_s[:k], start_s=st.start_s, timeout_ms=self.timeout_s * 1000.0)

    def last_answered(self, n: int) -> list[tuple[str, float]]:
        """(status, time sent on the monotonic clock) of the last ``n`` requests that ended, in sending order."""
        s = self._samples()
        ended = np.flatnonzero(s.outcome != PENDING)[-n:] if n > 0 else np.zeros(0, dtype=int)
        names = s.statuses()
        sent = s.sent_at
        return [(names[i], float(sent[i])) for i in ended]

    def counts(self) -> dict:
        """``sent``, ``answered``, ``failed`` (by status), ``failed_total``, ``no_response`` (so far) and
        ``examples`` (the first message of each failed status)."""
        s = self._samples() if self.report is None else self.report.samples
        statuses = [name for name, done in zip(s.statuses(), (s.outcome != PENDING).tolist()) if done]
        failed: dict[str, int] = {}
        for name in statuses:
            if name not in ("OK", "NO_RESPONSE"):
                failed[name] = failed.get(name, 0) + 1
        return {"sent": len(s.sched_s), "answered": statuses.count("OK"), "failed": dict(sorted(failed.items())),
                "failed_total": sum(failed.values()), "no_response": statuses.count("NO_RESPONSE"),
                "examples": dict(self.client.current.examples) if self.client.current is not None else {}}

    def stop(self) -> BenchReport:
        """Stop sending, wait for every request sent to end (answered, failed or past its deadline)."""
        self._stop.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.report
