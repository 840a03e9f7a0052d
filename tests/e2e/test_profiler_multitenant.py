"""Multi-tenant measurement: the serving harness, and ``nexus profile multitenant`` end to end on CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from common.runtimes import DeviceSpec, load_runtime
from common.runtimes.emulated import EmulatedRuntime
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes, write_sample_models
from profiler.errors import ProfilerError
from profiler.harness import Harness, TenantModel, max_batch_for_slo
from profiler.slowdown import apply_colocation_slowdown, slowdowns_from_report

# GPU-like synthetic profiles executed by the emulated runtime: l(b) = alpha*b + beta.
PROFILE_A = Profile.linear(0.25, 2.0, 32, 500, 10, device_type="gtx")
PROFILE_B = Profile.linear(0.5, 3.0, 32, 800, 20, device_type="gtx")


@pytest.fixture(scope="module")
def emulated_models():
    data = model_bytes(mlp_small())
    runtimes = [load_runtime("emulated", data, "emulated:gtx", profile=p) for p in (PROFILE_A, PROFILE_B)]
    yield [TenantModel("a", runtimes[0], PROFILE_A, 60.0), TenantModel("b", runtimes[1], PROFILE_B, 60.0)]
    for rt in runtimes:
        rt.close()


def test_max_batch_follows_the_backend_rule():
    assert max_batch_for_slo(PROFILE_A, 12.0) == 16  # 2 * (0.25 * 16 + 2) = 12 <= 12 < 2 * l(17)
    assert max_batch_for_slo(PROFILE_B, 30.0) == 24
    assert max_batch_for_slo(PROFILE_A, 30.0) == 32  # the profile's largest batch
    assert max_batch_for_slo(PROFILE_A, 3.0) == 0


class VirtualClock:
    """Seconds that pass only when something waits: the harness's sleeps and the emulated batches."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += max(seconds, 0.0)


def test_harness_serves_light_load_within_slo_on_a_virtual_clock():
    """The harness's batching and accounting, exact: every batch takes l(b) of virtual time, so light
    load is served in full within the SLO. (On the wall clock the same step is a figure of
    benchmarks/timing_checks.py, --only multitenant.)"""
    clock = VirtualClock()
    data = model_bytes(mlp_small())
    device = DeviceSpec.parse("emulated:gtx")
    a, b = (TenantModel(name, EmulatedRuntime(data, device, profile, wait=clock.advance), profile, 60.0)
            for name, profile in (("a", PROFILE_A), ("b", PROFILE_B)))
    harness = Harness([a, b], clock=clock, sleep=clock.advance)
    stats = harness.run_step({"a": 200.0, "b": 100.0}, 0.5, seed=1)
    assert clock.now_s >= 0.5
    for model, s in zip((a, b), (stats["a"], stats["b"])):
        assert s.offered > 50 and s.completed == s.offered and s.dropped == s.late == 0, s
        assert s.ok and s.p99_ms <= 60.0 and s.bad_rate == 0.0
        assert max(s.exec_ms) <= model.max_batch
        for batch, (count, total_ms) in s.exec_ms.items():
            assert total_ms == pytest.approx(count * model.profile.latency_ms(batch))
        assert sum(batch * count for batch, (count, _) in s.exec_ms.items()) == s.completed


def test_harness_overload_drops_and_fails(emulated_models):
    a, _ = emulated_models
    harness = Harness([a])
    peak = a.predicted_peak_rps
    stats = harness.run_step({"a": 3.0 * peak}, 0.4, seed=2)["a"]
    assert not stats.ok
    assert stats.dropped > 0 and stats.bad_rate > 0.01
    assert max(stats.exec_ms) == a.max_batch  # saturated: full batches


def test_harness_rejects_an_slo_below_two_l1():
    rt = load_runtime("emulated", model_bytes(mlp_small()), "emulated:gtx", profile=PROFILE_A)
    try:
        with pytest.raises(ProfilerError, match=r"below 2\*l\(1\)"):
            TenantModel("a", rt, PROFILE_A, 4.0)
    finally:
        rt.close()


def test_multitenant_end_to_end_on_cpu(tmp_path):
    paths = write_sample_models(tmp_path, ["mlp_small", "vehicle_cls"])
    out = tmp_path / "mt.json"
    price = 2.5
    cmd = [sys.executable, "-m", "nexus", "profile", "multitenant", str(paths["mlp_small"]),
           str(paths["vehicle_cls"]), "--device", "cpu", "--slo-ms", "100", "--price-per-hour", str(price),
           "--duration-s", "0.2", "--refine", "1", "--fractions", "0.25,0.5,0.75", "--batch-sizes", "1,2,4,8",
           "--iters", "8", "--min-iters", "3", "--time-budget-s", "0.15", "--threads", "1", "-q", "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "co-located frontier" in r.stdout and "shared vs dedicated" in r.stdout
    report = json.loads(out.read_text())
    assert (tmp_path / "mt.png").read_bytes()[:4] == b"\x89PNG"

    assert report["kind"] == "nexus-multitenant-report" and report["device_type"] == "cpu"
    models = {m["name"]: m for m in report["models"]}
    assert list(models) == ["mlp_small", "vehicle_cls"]
    peaks = {}
    for name, m in models.items():
        assert m["dedicated_peak_rps"] > 0 and m["max_batch"] >= 1
        assert m["slowdown"] >= 1.0
        runs = m["dedicated_peak_runs_rps"]
        assert len(runs) == 2 and m["dedicated_peak_rps"] == pytest.approx(sum(runs) / 2)
        assert m["peak_drift"] == pytest.approx(runs[1] / runs[0] - 1)
        assert m["cost_per_million_dedicated"] == pytest.approx(price / (3600 * m["dedicated_peak_rps"]) * 1e6)
        profile = Profile.from_json_obj(m["profile"])
        assert profile.device_type == "cpu" and profile.max_batch <= 8
        peaks[name] = m["dedicated_peak_rps"]

    frontier = report["frontier"]
    assert [p["fraction"] for p in frontier] == [0.25, 0.5, 0.75]
    for p in frontier:
        rates = p["rates_rps"]
        assert p["fixed"] == ["mlp_small"] and p["ramped"] == "vehicle_cls"
        line = peaks["vehicle_cls"] * (1 - rates["mlp_small"] / peaks["mlp_small"])
        assert p["line_rps"] == pytest.approx(max(0.0, line))
        if rates["vehicle_cls"] > 0:  # held at the fraction of the first dedicated measurement
            first_peak = models["mlp_small"]["dedicated_peak_runs_rps"][0]
            assert rates["mlp_small"] == pytest.approx(p["fraction"] * first_peak)
        total = sum(rates.values())
        assert p["total_rps"] == pytest.approx(total)
        e = sum(rates[n] / peaks[n] for n in rates)
        assert p["efficiency"] == pytest.approx(e)
        if total > 0:
            assert p["cost_per_million_shared"] == pytest.approx(price / (3600 * total) * 1e6)
            assert p["cost_per_million_dedicated"] == pytest.approx(p["cost_per_million_shared"] * e)
            assert p["cost_change_vs_dedicated"] == pytest.approx(1 / e - 1)
    costs = report["costs"]
    changes = [p["cost_change_vs_dedicated"] for p in frontier if p["cost_change_vs_dedicated"] is not None]
    assert changes and costs["best_change_vs_dedicated"] == pytest.approx(min(changes))
    assert costs["price_per_hour"] == price

    trials = report["trials"]
    assert any(t["kind"] == "dedicated mlp_small" and t["ok"] for t in trials)
    assert any(t["kind"].startswith("co-located") for t in trials)

    # The saved slowdown inflates a profile for a shared device.
    factors = slowdowns_from_report(report)
    profile = Profile.from_json_obj(models["vehicle_cls"]["profile"])
    shared = apply_colocation_slowdown(profile, factors["vehicle_cls"])
    assert shared.latency_ms(1) == pytest.approx(profile.latency_ms(1) * factors["vehicle_cls"])
