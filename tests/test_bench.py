"""Tests of ``nexus bench``: the open-loop load generator, its report, and its command.

They assert outcomes (counts, classification, errors); the wall-clock figures (latencies, client
lag) are reported by ``benchmarks/timing_checks.py``.

The server side is :mod:`nexus.bench.fake_kserve`, a real KServe v2 gRPC server on loopback run as a
subprocess, whose models answer after a sleep or follow a scripted pattern of late answers and
error statuses, so that the classification can be checked exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from common.pb import kserve
from nexus import bench_cmd
from nexus.bench import (
    BenchError,
    BenchReport,
    build_request,
    find_max_rate,
    poisson_arrivals,
    run_bench,
    run_bench_async,
    search_max_rate,
)
from nexus.bench.report import lag_warning
from nexus.bench.fake_kserve import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SLO_MS = 250.0
GRACE_MS = 250.0  # client deadline 500 ms
# Cycled per request by the server: 5 on time, 1 late, 2 failed, 2 dropped (one by the server
# shedding, one by the client's deadline passing).
MIXED_PATTERN = [
    "ok",
    "ok",
    "sleep:350",  # late: > SLO, well before the 500 ms client deadline
    "error:INTERNAL",  # failed
    "ok",
    "error:RESOURCE_EXHAUSTED",  # dropped
    "ok",
    "sleep:1500",  # dropped: the client's DEADLINE_EXCEEDED
    "error:INVALID_ARGUMENT",  # failed
    "ok",
]

CONFIG = {
    "models": {
        "fast": {"inputs": [["input", "FP32", [-1, 8]]], "outputs": [["output", "FP32", [-1, 4]]], "latency_ms": 1},
        "mixed": {
            "inputs": [["input", "FP32", [-1, 8]]],
            "outputs": [["output", "FP32", [-1, 4]]],
            "latency_ms": 0,
            "pattern": MIXED_PATTERN,
        },
        "slow": {"inputs": [["input", "FP32", [-1, 8]]], "outputs": [["output", "FP32", [-1, 4]]], "latency_ms": 300},
        # One worker, 10 ms per request: a capacity of 100 rps.
        "single": {
            "inputs": [["input", "FP32", [-1, 8]]],
            "outputs": [["output", "FP32", [-1, 4]]],
            "latency_ms": 10,
            "workers": 1,
        },
        "multi": {
            "inputs": [["a", "FP32", [-1, 3, 4]], ["b", "INT64", [-1, 2]], ["c", "UINT8", [-1, -1]]],
            "outputs": [["y", "FP16", [-1, 5]]],
            "latency_ms": 0,
        },
    }
}


@pytest.fixture(scope="module")
def server() -> str:
    proc, address = spawn(CONFIG)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_invariants(r: BenchReport) -> None:
    assert r.sent == r.ok + r.dropped + r.failed
    assert r.ok == r.within_slo + r.late
    assert 0 <= r.client_dropped <= r.dropped
    assert r.throughput_rps == pytest.approx(r.ok / r.duration_s)
    assert r.goodput_rps == pytest.approx(r.within_slo / r.duration_s)
    if r.sent:
        assert r.bad_rate == pytest.approx((r.late + r.dropped + r.failed) / r.sent)
    if r.ok:
        assert r.p50_ms <= r.p90_ms <= r.p99_ms <= r.max_ms
    assert r.client_lag_ms >= 0
    assert sum(r.errors.values()) == r.dropped + r.failed


# ---------------------------------------------------------------- pure parts


def test_poisson_arrivals_count_and_gaps():
    rate, total = 500.0, 40.0
    t = poisson_arrivals(rate, total, np.random.default_rng(1))
    expected = rate * total
    assert abs(len(t) - expected) < 4 * math.sqrt(expected)
    assert np.all(np.diff(t) > 0) and t[0] >= 0 and t[-1] < total
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    # Counts per second are Poisson: variance ~ mean.
    per_s = np.bincount(t.astype(int), minlength=int(total))
    assert per_s.var() / per_s.mean() == pytest.approx(1.0, abs=0.5)
    assert np.array_equal(t, poisson_arrivals(rate, total, np.random.default_rng(1)))
    assert len(poisson_arrivals(0.5, 0.001, np.random.default_rng(0))) <= 1


def test_build_request_shapes_from_metadata():
    meta = kserve.ModelMetadataResponse(name="m")
    meta.inputs.add(name="a", datatype="FP32", shape=[-1, 3, 4])
    meta.inputs.add(name="b", datatype="INT64", shape=[-1, 2])
    req = build_request(meta, model="m", batch=5)
    assert [list(t.shape) for t in req.inputs] == [[5, 3, 4], [5, 2]]
    assert [len(b) for b in req.raw_input_contents] == [5 * 12 * 4, 5 * 2 * 8]
    a = np.frombuffer(req.raw_input_contents[0], dtype="<f4")
    assert np.isfinite(a).all() and a.std() > 0
    meta.inputs.add(name="c", datatype="FP32", shape=[-1, -1])
    with pytest.raises(BenchError, match="--shape c="):
        build_request(meta, model="m")
    req = build_request(meta, model="m", batch=2, input_shapes={"c": (7,)})
    assert list(req.inputs[2].shape) == [2, 7]
    with pytest.raises(BenchError, match="no input named 'zz'"):
        build_request(meta, model="m", input_shapes={"zz": (1,)})


def test_search_max_rate_finds_threshold():
    capacity = 137.0
    seen: list[float] = []

    async def passes(rate: float) -> bool:
        seen.append(rate)
        return rate <= capacity

    best = asyncio.run(search_max_rate(passes, 10.0, None, rel_tol=0.02, max_steps=30))
    assert capacity * 0.98 <= best <= capacity
    assert seen[:5] == [10.0, 20.0, 40.0, 80.0, 160.0]  # ramp, then bisection
    best = asyncio.run(search_max_rate(passes, 10.0, 1000.0, rel_tol=0.02, max_steps=30))
    assert capacity * 0.98 <= best <= capacity
    assert asyncio.run(search_max_rate(passes, 200.0, 400.0)) == 0.0
    assert asyncio.run(search_max_rate(passes, 10.0, 100.0)) == 100.0
    seen.clear()
    asyncio.run(search_max_rate(passes, 10.0, None, max_steps=4))
    assert len(seen) == 4


# ---------------------------------------------------------------- against a real gRPC server


def test_fast_model_all_within_slo(server):
    rate, duration = 200.0, 1.5
    r = run_bench(server, "fast", rate, duration, SLO_MS, warmup_s=0.3, seed=3)
    check_invariants(r)
    expected = rate * duration
    assert abs(r.sent - expected) < 5 * math.sqrt(expected)
    assert r.ok == r.within_slo == r.sent
    assert r.bad_rate == 0.0 and r.errors == {}
    assert r.goodput_rps == pytest.approx(r.sent / duration)
    # Warmup arrivals were sent but are not in the report.
    assert r.samples is not None and len(r.samples.sched_s) > r.sent
    assert r.warmup_s == 0.3 and r.offered_rps == rate
    assert r.timeout_ms == pytest.approx(SLO_MS + max(20.0, SLO_MS / 2))


def test_classifies_late_dropped_failed_exactly(server):
    r = run_bench(server, "mixed", 100.0, 2.0, SLO_MS, grace_ms=GRACE_MS, seed=5)
    check_invariants(r)
    n = r.sent
    assert n > 100
    # The server cycles MIXED_PATTERN over its requests in the order they arrive.
    actions = [MIXED_PATTERN[k % len(MIXED_PATTERN)] for k in range(n)]
    n_ok = actions.count("ok")
    assert r.within_slo == n_ok
    assert r.late == actions.count("sleep:350")
    assert r.failed == actions.count("error:INTERNAL") + actions.count("error:INVALID_ARGUMENT")
    assert r.dropped == actions.count("error:RESOURCE_EXHAUSTED") + actions.count("sleep:1500")
    assert r.errors == {
        "DEADLINE_EXCEEDED": actions.count("sleep:1500"),
        "INTERNAL": actions.count("error:INTERNAL"),
        "INVALID_ARGUMENT": actions.count("error:INVALID_ARGUMENT"),
        "RESOURCE_EXHAUSTED": actions.count("error:RESOURCE_EXHAUSTED"),
    }
    assert r.goodput_rps == pytest.approx(n_ok / 2.0)
    assert r.bad_rate == pytest.approx(1 - n_ok / n)
    assert r.first_error and r.first_error.split(":")[0] in r.errors
    table = r.format_table()
    for word in ("goodput", "bad rate", "latency p99", "within SLO", "late", "dropped", "failed", "client lag"):
        assert word in table


def test_open_loop_does_not_wait_for_slow_responses(server):
    # 300 ms per answer at 50 rps: a closed loop would send a handful; open loop sends them all.
    r = run_bench(server, "slow", 50.0, 1.0, 1000.0, seed=2)
    check_invariants(r)
    assert r.ok == r.within_slo == r.sent
    assert abs(r.sent - 50) < 5 * math.sqrt(50)


def test_client_lag_is_reported_and_late_sends_still_go_out(server):
    async def main() -> BenchReport:
        async def stall() -> None:
            await asyncio.sleep(0.3)
            time.sleep(0.2)  # block the event loop: the sender falls 200 ms behind

        staller = asyncio.ensure_future(stall())
        r = await run_bench_async(server, "fast", 100.0, 1.0, SLO_MS, seed=4)
        await staller
        return r

    r = asyncio.run(main())
    check_invariants(r)
    assert lag_warning(r) and "fell behind" in r.format_table()
    assert abs(r.sent - 100) < 5 * math.sqrt(100)  # arrivals due during the stall were sent late, not skipped
    assert r.ok == r.sent


def test_concurrency_limit_drops_on_the_client(server):
    r = run_bench(server, "slow", 50.0, 1.0, 1000.0, concurrency_limit=3, seed=2)
    check_invariants(r)
    assert r.client_dropped > 0 and r.errors["CLIENT_CONCURRENCY_LIMIT"] == r.client_dropped
    assert r.dropped == r.client_dropped and r.ok == r.sent - r.client_dropped
    # At most 3 in flight, each 300 ms long, over ~1.3 s: a bounded number could be sent.
    assert r.ok <= 3 * 6
    assert "by the client's concurrency limit" in r.format_table()


def test_stub_path_channels_and_multi_input_model(server):
    r = run_bench(server, "multi", 100.0, 0.5, SLO_MS, raw=False, input_shapes={"c": (6,)}, batch=3)
    check_invariants(r)
    assert r.ok == r.sent > 0 and r.batch == 3
    r = run_bench(server, "fast", 100.0, 0.5, SLO_MS, channels=3)
    check_invariants(r)
    assert r.ok == r.sent > 0 and r.channels == 3


def test_api_errors(server):
    with pytest.raises(BenchError, match="unknown model 'nope'"):
        run_bench(server, "nope", 10.0, 0.1, SLO_MS)
    with pytest.raises(BenchError, match="cannot reach the frontend"):
        run_bench(f"127.0.0.1:{free_port()}", "fast", 10.0, 0.1, SLO_MS)
    with pytest.raises(BenchError, match="--rate must be > 0"):
        run_bench(server, "fast", 0.0, 1.0, SLO_MS)
    with pytest.raises(BenchError, match="bad frontend address"):
        run_bench("localhost", "fast", 1.0, 1.0, SLO_MS)


def test_find_max_rate_runs_lo_then_hi_and_returns_the_best_passing_step(server):
    """The search wired to real load steps, with no timing claim: ``lo`` first, then ``hi``; the rate
    returned is the highest step that passed (0.0 when ``lo`` fails). That 20 rps passes and 400 rps
    fails on this machine is a figure of benchmarks/timing_checks.py (--only bench-search)."""
    rate, reports = find_max_rate(
        server, "single", 200.0, 0.99, lo=20.0, hi=400.0, step_duration_s=0.3,
        warmup_s=0.1, cooldown_s=0.0, rel_tol=0.5, max_steps=3,
    )
    for r in reports:
        check_invariants(r)
    offered = [r.offered_rps for r in reports]
    passed = [r.offered_rps for r in reports if r.sent > 0 and r.good_fraction >= 0.99]
    assert 1 <= len(reports) <= 3 and offered[0] == 20.0
    if offered[0] not in passed:
        assert rate == 0.0 and offered == [20.0]
    else:
        assert offered[1] == 400.0 and rate == max(passed)


# ---------------------------------------------------------------- the command


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nexus")
    bench_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def test_cli_json_report_file_and_plot(server, tmp_path):
    out, png = tmp_path / "report.json", tmp_path / "lat.png"
    proc = subprocess.run(
        [
            sys.executable, "-m", "nexus", "bench", "--frontend", server, "--model", "mixed",
            "--rate", "100", "--duration-s", "1", "--warmup-s", "0.2", "--slo-ms", "250", "--grace-ms", "250",
            "--json", "-o", str(out), "--plot", str(png),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # JSON only on stdout
    assert json.loads(out.read_text()) == data
    for key in (
        "offered_rps", "duration_s", "sent", "ok", "within_slo", "late", "dropped", "failed", "throughput_rps",
        "goodput_rps", "bad_rate", "p50_ms", "p90_ms", "p99_ms", "max_ms", "client_lag_ms",
    ):
        assert key in data
    assert data["sent"] == data["ok"] + data["dropped"] + data["failed"]
    assert data["late"] > 0 and data["failed"] > 0 and data["dropped"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bench mixed" in proc.stderr  # the progress bar


def test_cli_table_and_progress(server, capsys):
    assert run_cli(["--frontend", server, "--model", "fast", "--rate", "50", "--duration-s", "0.5"]) == 0
    cap = capsys.readouterr()
    assert "goodput" in cap.out and "p99" in cap.out
    assert "bench fast" in cap.err
    assert run_cli(["--frontend", server, "--model", "fast", "--rate", "50", "--duration-s", "0.3", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_cli_unknown_model(server, capsys):
    assert run_cli(["--frontend", server, "--model", "nope", "--quiet"]) == 2
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nexus bench: error: unknown model 'nope'")
    assert cap.out == ""


def test_cli_unreachable_frontend(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert run_cli(["--frontend", address, "--model", "fast", "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"nexus bench: error: cannot reach the frontend at {address}")


def test_cli_bad_arguments(server, capsys, tmp_path):
    assert run_cli(["--frontend", server, "--model", "fast", "--rate", "-1", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("nexus bench: error: --rate must be > 0")
    assert run_cli(["--frontend", server, "--model", "fast", "--shape", "x", "--quiet"]) == 2
    assert "bad --shape" in capsys.readouterr().err
    missing = tmp_path / "no" / "r.json"
    assert run_cli(["--frontend", server, "--model", "fast", "-o", str(missing), "--quiet"]) == 2
    assert "does not exist" in capsys.readouterr().err
