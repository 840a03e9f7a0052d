"""``nexus bench``: open-loop Poisson load against a KServe v2 gRPC frontend.

API for benchmarks and scripts::

    from nexus.bench import run_bench, find_max_rate
    report = run_bench("127.0.0.1:8001", "resnet18_64", rate_rps=200, duration_s=10, slo_ms=100)
    print(report.format_table()); print(report.to_json())
    rate, reports = find_max_rate("127.0.0.1:8001", "resnet18_64", slo_ms=100, lo=50)

``run_bench_async`` / ``find_max_rate_async`` are the same inside a running event loop, and
:class:`LoadClient` keeps one connection and prepared request across several runs (``search_rate``
searches with one). The search itself is :mod:`common.rate_search`, the arrivals
:mod:`common.arrivals`.
"""

from nexus.bench.loadgen import (
    BenchError,
    LoadClient,
    build_request,
    default_grace_ms,
    find_max_rate,
    find_max_rate_async,
    run_bench,
    run_bench_async,
    search_rate,
)
from nexus.bench.report import BenchReport, BenchSamples, format_table

__all__ = [
    "BenchError",
    "BenchReport",
    "BenchSamples",
    "LoadClient",
    "build_request",
    "default_grace_ms",
    "find_max_rate",
    "find_max_rate_async",
    "format_table",
    "run_bench",
    "run_bench_async",
    "search_rate",
]
