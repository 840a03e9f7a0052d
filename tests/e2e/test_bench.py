"""Tests of ``nexus bench``: the open-loop load generator, its report, and its command.

They assert outcomes (counts, classification, errors); the wall-clock figures (latencies, client
lag) are reported by ``benchmarks/timing_checks.py``.

The server side is :mod:`harness.fake_kserve`, a real KServe v2 gRPC server on loopback run as a
subprocess, whose models answer after a sleep or follow a scripted pattern of late answers and
error statuses, so that the classification can be checked exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from common.pb import kserve
from nexus import bench_cmd
from harness.background_load import BackgroundLoad
from nexus.bench import (
    BenchError,
    BenchReport,
    build_request,
    find_max_rate,
    run_bench,
    run_bench_async,
)
from nexus.bench.report import lag_warning
from harness.fake_kserve import GRACE_MS, MIXED_PATTERN, SCRIPTED_CONFIG, SLO_MS, spawn
from harness.ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

@pytest.fixture(scope="module")
def server() -> str:
    proc, address = spawn(SCRIPTED_CONFIG)
    try:
        yield address
    finally:
        proc.terminate()
        proc.wait(10)


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


def test_background_load_runs_until_stopped_and_keeps_every_request(server):
    load = BackgroundLoad(server, "fast", 200.0, slo_ms=SLO_MS, timeout_s=1.0, cv=0.0).start()
    deadline = time.monotonic() + 10
    while load.counts()["answered"] < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    tail = load.last_answered(20)
    report = load.stop()
    check_invariants(report)
    samples = report.samples
    assert report.sent >= 50 and samples.status_counts() == {"OK": report.sent}
    assert load.counts() == {"sent": report.sent, "answered": report.sent, "failed": {}, "failed_total": 0,
                             "no_response": 0, "examples": {}}
    assert len(tail) == 20 and all(s == "OK" for s, _ in tail)
    assert [t for _, t in tail] == sorted(t for _, t in tail) and tail[-1][1] <= time.monotonic()
    assert np.all(samples.done_at >= samples.sent_at) and load.in_flight() == 0
    # cv=0: evenly spaced arrivals at 200 rps
    assert np.allclose(np.diff(samples.sched_s), 1 / 200.0)


def test_requests_past_the_client_deadline_are_no_response_and_server_errors_keep_their_status(server):
    slow = BackgroundLoad(server, "slow", 20.0, slo_ms=100.0, timeout_s=0.15).start()
    time.sleep(0.5)
    statuses = slow.stop().samples.status_counts()
    assert set(statuses) == {"NO_RESPONSE"}
    assert slow.counts()["no_response"] == statuses["NO_RESPONSE"] and slow.counts()["failed_total"] == 0
    mixed = run_bench(server, "mixed", 100.0, 1.0, SLO_MS, grace_ms=GRACE_MS, seed=5).samples.status_counts()
    assert {"OK", "INTERNAL", "RESOURCE_EXHAUSTED", "NO_RESPONSE"} <= set(mixed)   # sleep:1500 has no answer


def test_several_frontends_are_balanced(server):
    other, address = spawn({"models": {"fast": {**SCRIPTED_CONFIG["models"]["fast"], "pattern": ["error:INTERNAL"]}}})
    try:
        r = run_bench([server, address], "fast", 200.0, 1.0, SLO_MS, seed=1)
    finally:
        other.terminate()
        other.wait(10)
    check_invariants(r)
    assert r.ok > 0.3 * r.sent and r.errors.get("INTERNAL", 0) > 0.3 * r.sent      # round-robin over both
    assert r.address == f"{server},{address}"


def test_background_load_errors():
    with pytest.raises(BenchError, match="must not be below the SLO"):
        BackgroundLoad("127.0.0.1:1", "fast", 10.0, slo_ms=500.0, timeout_s=0.1)
    with pytest.raises(BenchError, match="cannot reach the frontend"):
        BackgroundLoad(f"127.0.0.1:{free_port()}", "fast", 10.0, slo_ms=100.0).start()
    with pytest.raises(BenchError, match="no frontend address"):
        run_bench([], "fast", 10.0, 1.0, SLO_MS)


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
