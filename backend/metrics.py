"""Prometheus text endpoint of a backend: ``GET /metrics`` (``nexus backend --metrics-port P``).

A plain asyncio HTTP/1.0-style server on the backend's event loop: each request is answered from a
:class:`control.BackendStats` snapshot (the same one the ``Stats`` RPC returns) rendered in the
Prometheus text exposition format 0.0.4. Metric names (labels ``model`` = the session, ``group`` =
a prefix group id):

- ``nexus_backend_queue_length{model}`` gauge, requests waiting
- ``nexus_backend_inference_count_total{model}`` rows executed; ``nexus_backend_execution_count_total{model}``
  batches; ``nexus_backend_success_total``, ``nexus_backend_failure_total``, ``nexus_backend_dropped_total``
- ``nexus_backend_queue_seconds_total{model}``, ``nexus_backend_compute_seconds_total{model}``
- ``nexus_backend_batch_size{model}`` histogram of executed batch sizes (``_bucket{le}``, ``_sum``, ``_count``)
- ``nexus_backend_memory_bytes{model}`` gauge (a prefix group's prefix counted on one member only),
  ``nexus_backend_memory_bytes_total`` gauge for the whole backend
- ``nexus_backend_utilization`` gauge, busy fraction over the last 10 s; ``nexus_backend_busy_fraction_total``
  since start
- ``nexus_backend_prefix_group_*{group}``: merged batches, rows, prefix seconds, memory of each shared prefix
- ``nexus_backend_info{node_id,device}`` 1
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from common.pb import control

log = logging.getLogger("nexus.backend.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
_MAX_REQUEST_BYTES = 16 * 1024


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


def _num(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._declared: set[str] = set()

    def metric(self, name: str, kind: str, help_text: str) -> None:
        if name not in self._declared:
            self._declared.add(name)
            self.lines.append(f"# HELP {name} {help_text}")
            self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, **labels: str) -> None:
        self.lines.append(f"{name}{_labels(**labels)} {_num(value)}")


def render(stats: control.BackendStats, device: str = "") -> str:
    """The Prometheus text for one stats snapshot."""
    w = _Writer()
    w.metric("nexus_backend_info", "gauge", "Backend identity.")
    w.sample("nexus_backend_info", 1, node_id=stats.node_id, device=device)
    w.metric("nexus_backend_utilization", "gauge", "Busy fraction of the device over the last 10 seconds.")
    w.sample("nexus_backend_utilization", stats.utilization)
    w.metric("nexus_backend_busy_fraction_total", "gauge", "Busy fraction of the device since the backend started.")
    w.sample("nexus_backend_busy_fraction_total", stats.utilization_total)
    w.metric("nexus_backend_memory_bytes_total", "gauge", "Memory of every runtime, each shared prefix once.")
    w.sample("nexus_backend_memory_bytes_total", stats.memory_bytes)
    w.metric("nexus_backend_sessions", "gauge", "Sessions loaded on this backend.")
    w.sample("nexus_backend_sessions", len(stats.sessions))
    per_session = (
        ("nexus_backend_queue_length", "gauge", "Requests waiting in the session's queue.", "queue_length", 1),
        ("nexus_backend_inference_count_total", "counter", "Rows (inferences) executed.", "inference_count", 1),
        ("nexus_backend_execution_count_total", "counter", "Batches executed.", "execution_count", 1),
        ("nexus_backend_success_total", "counter", "Requests answered successfully.", "success_count", 1),
        ("nexus_backend_failure_total", "counter", "Requests failed (dropped included).", "fail_count", 1),
        ("nexus_backend_dropped_total", "counter", "Requests dropped: deadline unreachable or queue full.",
         "dropped", 1),
        ("nexus_backend_queue_seconds_total", "counter", "Time requests spent queued.", "queue_ns", 1e-9),
        ("nexus_backend_compute_seconds_total", "counter", "Time of the batches the session ran in.", "compute_ns",
         1e-9),
        ("nexus_backend_memory_bytes", "gauge", "Memory of the session's runtime (a shared prefix on one member).",
         "memory_bytes", 1),
    )
    for name, kind, help_text, field, scale in per_session:
        w.metric(name, kind, help_text)
        for s in stats.sessions:
            value = getattr(s, field)
            w.sample(name, value * scale if scale != 1 else value, model=s.model)
    w.metric("nexus_backend_batch_size", "histogram", "Sizes of the batches executed (merged size in a prefix group).")
    for s in stats.sessions:
        hist = dict(s.batch_histogram)
        for bound in BATCH_BUCKETS:
            cumulative = sum(c for size, c in hist.items() if size <= bound)
            w.sample("nexus_backend_batch_size_bucket", cumulative, model=s.model, le=str(bound))
        count = sum(hist.values())
        w.sample("nexus_backend_batch_size_bucket", count, model=s.model, le="+Inf")
        w.sample("nexus_backend_batch_size_sum", sum(size * c for size, c in hist.items()), model=s.model)
        w.sample("nexus_backend_batch_size_count", count, model=s.model)
    w.metric("nexus_backend_session_info", "gauge", "Session metadata: its prefix group on this backend.")
    for s in stats.sessions:
        w.sample("nexus_backend_session_info", 1, model=s.model, prefix_group=s.prefix_group)
    per_group = (
        ("nexus_backend_prefix_group_executions_total", "counter", "Merged batches run through the shared prefix.",
         "execution_count", 1),
        ("nexus_backend_prefix_group_inferences_total", "counter", "Rows run through the shared prefix.",
         "inference_count", 1),
        ("nexus_backend_prefix_group_prefix_seconds_total", "counter", "Time spent in the shared prefix.",
         "prefix_compute_ns", 1e-9),
        ("nexus_backend_prefix_group_memory_bytes", "gauge", "Memory of the shared prefix (held once).",
         "memory_bytes", 1),
        ("nexus_backend_prefix_group_sessions", "gauge", "Sessions batched through the shared prefix.", None, 1),
    )
    for name, kind, help_text, field, scale in per_group:
        w.metric(name, kind, help_text)
        for g in stats.prefix_groups:
            value = len(g.sessions) if field is None else getattr(g, field)
            w.sample(name, value * scale if scale != 1 else value, group=g.group)
    return "\n".join(w.lines) + "\n"


async def serve_metrics(host: str, port: int, snapshot: Callable[[], str]) -> asyncio.AbstractServer:
    """Serve ``GET /metrics`` (the text ``snapshot()`` returns) on ``host:port``; 404 elsewhere."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
            parts = request_line.split()
            method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            path = target.split("?", 1)[0]
            if method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"only GET\n", "text/plain"
            elif path in ("/metrics", "/metrics/"):
                status, body, ctype = "200 OK", snapshot().encode(), CONTENT_TYPE
            else:
                status, body, ctype = "404 Not Found", b"see /metrics\n", "text/plain"
            writer.write((f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                          f"Connection: close\r\n\r\n").encode())
            if method != "HEAD":
                writer.write(body)
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        except Exception:  # never let a scrape take the backend down
            log.exception("metrics request failed")
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port, limit=_MAX_REQUEST_BYTES)
