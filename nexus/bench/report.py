"""The result of one open-loop run: :class:`BenchReport`, built from per-request samples."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from dataclasses import dataclass, field

import grpc
import numpy as np

# Per-request outcome codes kept in BenchSamples.outcome.
PENDING = 0  # never finished (only while running)
OK = 1  # a response (within SLO or late: see latency)
DROPPED = 2  # DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED / UNAVAILABLE from the server or the client deadline
FAILED = 3  # any other error status
CLIENT_DROPPED = 4  # never sent: the client's concurrency limit was reached (counts as dropped)


@dataclass
class BenchSamples:
    """Raw per-request data of a run, index = arrival order (warmup requests included).

    ``sched_s`` is the scheduled arrival time from the start of the run, ``lag_s`` how late the
    client sent it, ``latency_ms`` the client-side latency of a response (NaN without one),
    ``outcome`` one of the module's outcome codes and ``done_s`` when the request ended, answered or
    not (from the start of the run; NaN if never sent). ``start_s`` is the start of the run on the
    monotonic clock (``time.monotonic``), ``timeout_ms`` the client's deadline of every request.
    """

    sched_s: np.ndarray
    lag_s: np.ndarray
    latency_ms: np.ndarray
    outcome: np.ndarray
    status: np.ndarray  # gRPC status code number of each request (0 = OK; see NO_STATUS, CLIENT_LIMIT_STATUS)
    warmup_s: float
    slo_ms: float
    done_s: np.ndarray | None = None
    start_s: float = 0.0
    timeout_ms: float = math.inf

    @property
    def measured(self) -> np.ndarray:
        return self.sched_s >= self.warmup_s

    @property
    def sent_at(self) -> np.ndarray:
        """When each request was sent, on the monotonic clock."""
        return self.start_s + self.sched_s + self.lag_s

    @property
    def done_at(self) -> np.ndarray:
        """When each request ended, on the monotonic clock (NaN if it was never sent)."""
        return self.start_s + self.done_s

    def statuses(self) -> list[str]:
        """Each request's status by name, in sending order: ``OK``, a gRPC status code
        (``UNAVAILABLE``, ...), ``NO_RESPONSE`` when the client's own deadline passed without an
        answer, ``CLIENT_CONCURRENCY_LIMIT`` when the client never sent it."""
        no_answer = ((self.status == grpc.StatusCode.DEADLINE_EXCEEDED.value[0])
                     & (self.done_s - self.sched_s - self.lag_s >= 0.999 * self.timeout_ms / 1000.0))
        return ["NO_RESPONSE" if none else _CODE_NAMES.get(code, f"CODE_{code}")
                for code, none in zip(self.status.tolist(), no_answer.tolist())]

    def status_counts(self) -> dict[str, int]:
        """How many requests ended with each status of :meth:`statuses`."""
        counts: dict[str, int] = {}
        for name in self.statuses():
            counts[name] = counts.get(name, 0) + 1
        return dict(sorted(counts.items()))


@dataclass
class BenchReport:
    """Summary of an open-loop run over the measured window (warmup excluded).

    Counts: ``sent = ok + dropped + failed`` and ``ok = within_slo + late``. ``sent`` counts every
    arrival of the window, also those that the client itself dropped at its concurrency limit
    (``client_dropped``, included in ``dropped``). Rates are per second of the window; ``bad_rate``
    is the fraction ``(late + dropped + failed) / sent``. Latencies are client-side, from sending a
    request to its response, over successful responses (late ones included); None without any.
    ``client_lag_ms`` is the most that any send fell behind its scheduled arrival time: when it is
    large, the client could not keep up and the load was less than the offered rate.
    """

    model: str
    address: str
    offered_rps: float
    duration_s: float
    warmup_s: float
    slo_ms: float
    batch: int
    sent: int
    ok: int
    within_slo: int
    late: int
    dropped: int
    failed: int
    client_dropped: int
    throughput_rps: float
    goodput_rps: float
    bad_rate: float
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    max_ms: float | None
    mean_ms: float | None
    client_lag_ms: float
    timeout_ms: float
    channels: int = 1
    errors: dict[str, int] = field(default_factory=dict)
    first_error: str | None = None
    samples: BenchSamples | None = field(default=None, repr=False, compare=False)

    @property
    def good_fraction(self) -> float:
        """Fraction of the window's requests answered within the SLO (1.0 for an empty window)."""
        return self.within_slo / self.sent if self.sent else 1.0

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            if f.name == "samples":
                continue
            value = getattr(self, f.name)
            if isinstance(value, float):
                value = _round(value)
            out[f.name] = value
        return out

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def format_table(self) -> str:
        return format_table(self)


# What a benchmark keeps of each step of a search (``step_summary``).
STEP_KEYS = ("offered_rps", "sent", "within_slo", "late", "dropped", "failed", "goodput_rps", "throughput_rps",
             "bad_rate", "p50_ms", "p90_ms", "p99_ms", "client_lag_ms")


def step_summary(r: BenchReport, digits: int | None = None) -> dict:
    """The report's :data:`STEP_KEYS` as a dict, floats rounded to ``digits`` when given."""
    d = {k: getattr(r, k) for k in STEP_KEYS}
    if digits is not None:
        d = {k: (round(v, digits) if isinstance(v, float) else v) for k, v in d.items()}
    return d


def write_json(path: str | pathlib.Path, data, indent: int = 1) -> pathlib.Path:
    """Write a benchmark's raw result as JSON (values JSON cannot hold as their ``str``), creating
    the directory; returns the path."""
    out = pathlib.Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    return out


def _round(x: float, digits: int = 4) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), digits)


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}
NO_STATUS = -1
CLIENT_LIMIT_STATUS = -2
_CODE_NAMES[NO_STATUS] = "NO_STATUS"
_CODE_NAMES[CLIENT_LIMIT_STATUS] = "CLIENT_CONCURRENCY_LIMIT"

# Status codes that mean "dropped" (shed or out of time) rather than "failed".
DROP_CODES = frozenset({"DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"})


def build_report(
    samples: BenchSamples,
    *,
    model: str,
    address: str,
    offered_rps: float,
    duration_s: float,
    batch: int,
    timeout_ms: float,
    channels: int = 1,
    first_error: str | None = None,
) -> BenchReport:
    """Summarise ``samples`` over the measured window (arrivals at or after ``warmup_s``)."""
    m = samples.measured
    outcome = samples.outcome[m]
    lat = samples.latency_ms[m]
    ok_mask = outcome == OK
    ok_lat = lat[ok_mask]
    slo = samples.slo_ms
    sent = int(m.sum())
    ok = int(ok_mask.sum())
    within = int((ok_lat <= slo).sum())
    late = ok - within
    client_dropped = int((outcome == CLIENT_DROPPED).sum())
    dropped = int((outcome == DROPPED).sum()) + client_dropped
    failed = sent - ok - dropped  # PENDING cannot remain after a run; count it as failed if it did
    if ok_lat.size:
        p50, p90, p99 = (float(v) for v in np.percentile(ok_lat, [50, 90, 99]))
        mx, mean = float(ok_lat.max()), float(ok_lat.mean())
    else:
        p50 = p90 = p99 = mx = mean = None
    lag = samples.lag_s[m & (samples.outcome != CLIENT_DROPPED)]
    errors: dict[str, int] = {}
    codes, counts = np.unique(samples.status[m & (samples.outcome != OK)], return_counts=True)
    for code, count in zip(codes.tolist(), counts.tolist()):
        errors[_CODE_NAMES.get(code, f"CODE_{code}")] = count
    return BenchReport(
        model=model,
        address=address,
        offered_rps=float(offered_rps),
        duration_s=float(duration_s),
        warmup_s=float(samples.warmup_s),
        slo_ms=float(slo),
        batch=int(batch),
        sent=sent,
        ok=ok,
        within_slo=within,
        late=late,
        dropped=dropped,
        failed=failed,
        client_dropped=client_dropped,
        throughput_rps=ok / duration_s,
        goodput_rps=within / duration_s,
        bad_rate=(sent - within) / sent if sent else 0.0,
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        max_ms=mx,
        mean_ms=mean,
        client_lag_ms=float(lag.max() * 1e3) if lag.size else 0.0,
        timeout_ms=float(timeout_ms),
        channels=int(channels),
        errors=dict(sorted(errors.items())),
        first_error=first_error,
        samples=samples,
    )


# A client lag above this (ms), or above 10% of the SLO, is called out in the table.
LAG_WARN_MS = 10.0


def lag_warning(r: BenchReport) -> str | None:
    if r.client_lag_ms > max(LAG_WARN_MS, 0.1 * r.slo_ms):
        return (
            f"warning: the client fell behind its arrival schedule by up to {r.client_lag_ms:.1f} ms; "
            "the load was not fully open-loop (try --channels, fewer rows per request, or a less busy machine)"
        )
    return None


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} ms"


def _pct(n: int, total: int) -> str:
    return f"{100.0 * n / total:.2f}%" if total else "-"


def format_table(r: BenchReport) -> str:
    """A two-column human-readable table of the report."""
    rows: list[tuple[str, str]] = [
        ("model", f"{r.model} @ {r.address}"),
        ("offered rate", f"{r.offered_rps:g} rps (Poisson), batch {r.batch}"),
        ("window", f"{r.duration_s:g} s" + (f" after {r.warmup_s:g} s warmup" if r.warmup_s else "")),
        ("SLO", f"{r.slo_ms:g} ms (client timeout {r.timeout_ms:g} ms)"),
        ("sent", f"{r.sent}"),
        ("ok", f"{r.ok}"),
        ("  within SLO", f"{r.within_slo} ({_pct(r.within_slo, r.sent)})"),
        ("  late", f"{r.late} ({_pct(r.late, r.sent)})"),
        (
            "dropped",
            f"{r.dropped} ({_pct(r.dropped, r.sent)})"
            + (f", {r.client_dropped} by the client's concurrency limit" if r.client_dropped else ""),
        ),
        ("failed", f"{r.failed} ({_pct(r.failed, r.sent)})"),
        ("throughput", f"{r.throughput_rps:.2f} rps"),
        ("goodput", f"{r.goodput_rps:.2f} rps (within SLO)"),
        ("bad rate", f"{100.0 * r.bad_rate:.2f}% (late + dropped + failed)"),
        ("latency p50", _ms(r.p50_ms)),
        ("latency p90", _ms(r.p90_ms)),
        ("latency p99", _ms(r.p99_ms)),
        ("latency max", _ms(r.max_ms)),
        ("client lag max", f"{r.client_lag_ms:.2f} ms"),
    ]
    if r.errors:
        rows.append(("errors", ", ".join(f"{k}: {v}" for k, v in r.errors.items())))
    if r.first_error:
        rows.append(("first error", r.first_error))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    warn = lag_warning(r)
    if warn:
        lines.append(warn)
    return "\n".join(lines)
