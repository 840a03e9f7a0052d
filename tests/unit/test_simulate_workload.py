"""The simulator's workloads (nexus/simulate/workload.py): rate schedules, scheduled and Azure-like
arrival streams, and trace files."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nexus.simulate.workload import (
    Arrivals,
    RateSchedule,
    WorkloadError,
    diurnal_schedule,
    load_trace,
    parse_schedule,
    scheduled_arrivals,
    synthetic_azure,
    write_trace,
    zipf_shares,
)

NAMES = [f"m{i}" for i in range(20)]
# Counts are compared with their expectation within this many standard deviations.
SIGMAS = 5


def per_second_counts(arrivals: Arrivals, model: int | None = None) -> np.ndarray:
    t = arrivals.times_s if model is None else arrivals.times_s[arrivals.models == model]
    return np.bincount(t.astype(int), minlength=math.ceil(arrivals.duration_s))


# --- rate schedules ---------------------------------------------------------------------------

def test_parse_schedule_steps_and_ramps_give_rates_and_exact_integrals():
    s = parse_schedule("0:60, 120:300 ,240~60")
    assert s.points == ((0.0, 60.0, False), (120.0, 300.0, False), (240.0, 60.0, True))
    assert s.end_s == 240.0
    assert [s.rate_at(t) for t in (0, 119.999, 120, 180, 240, 1e6)] == pytest.approx(
        [60, 60, 300, 180, 60, 60])
    assert s.integral(0, 120) == pytest.approx(7200)
    assert s.integral(120, 240) == pytest.approx((300 + 60) / 2 * 120)  # the ramp: a trapezoid
    assert s.integral(100, 130) == pytest.approx(20 * 60 + 10 * (300 - 240 / 120 * 5))
    assert s.integral(240, 300) == pytest.approx(3600)  # constant after the last point
    assert s.integral(50, 50) == 0


def test_a_ramp_from_zero_and_a_silent_stretch():
    s = parse_schedule("0:0,100~1000,150:0,200:10")
    assert s.rate_at(50) == pytest.approx(500)
    assert s.rate_at(160) == 0
    assert s.integral(0, 100) == pytest.approx(50_000)
    assert s.integral(100, 200) == pytest.approx(50_000)
    with pytest.raises(WorkloadError, match="t0_s <= t1_s"):
        s.integral(10, 5)
    with pytest.raises(WorkloadError, match="t_s"):
        s.rate_at(-1)


@pytest.mark.parametrize("text, message", [
    ("5:60,120:300", r"item 1 '5:60'.*first point must be at time 0"),
    ("0~60,120:300", r"item 1 '0~60'.*must be a step"),
    ("0:60,120:300,120:60", r"item 3 '120:60'.*strictly increasing"),
    ("0:60,120:300,100:60", r"item 3 '100:60'.*strictly increasing"),
    ("0:60,120:-5", r"item 2 '120:-5'.*rate must be a finite number >= 0"),
    ("0:60,120:nan", r"item 2 '120:nan'.*rate must be a finite number"),
    ("0:60,inf:5", r"item 2 'inf:5'.*time must be a finite"),
    ("0:60,garbage", r"item 2 'garbage'.*expected SECONDS:RPS"),
    ("0:60,,120:5", r"item 2 ''.*expected SECONDS:RPS"),
    ("", r"item 1 ''.*expected SECONDS:RPS"),
    ("0:60,abc:5", r"item 2 'abc:5'.*time 'abc' is not a number"),
    ("0:sixty", r"item 1 '0:sixty'.*rate 'sixty' is not a number"),
])
def test_bad_schedule_strings_name_the_item_and_its_position(text, message):
    with pytest.raises(WorkloadError, match=message):
        parse_schedule(text)


def test_rate_schedule_checks_its_points():
    with pytest.raises(WorkloadError, match="point 2"):
        RateSchedule(((0.0, 1.0, False), (0.0, 2.0, False)))
    with pytest.raises(WorkloadError, match="at least one point"):
        RateSchedule(())


def test_diurnal_schedule_starts_low_peaks_high_half_a_period_later():
    s = diurnal_schedule(86400.0, 10.0, 110.0)
    assert s.rate_at(0) == pytest.approx(10)
    assert s.rate_at(43200) == pytest.approx(110)
    assert s.rate_at(21600) == pytest.approx(60)
    assert s.end_s >= 86400
    assert all(ramp for _, _, ramp in s.points[1:])
    # The ramps approximate the sinusoid's integral, (low + high) / 2 per second over a period.
    assert s.integral(0, 86400) == pytest.approx(60 * 86400, rel=1e-4)


# --- scheduled arrivals -----------------------------------------------------------------------

def test_zipf_shares_sum_to_one_and_decrease_with_rank():
    shares = zipf_shares(NAMES, 1.2)
    values = list(shares.values())
    assert list(shares) == NAMES
    assert sum(values) == pytest.approx(1.0)
    assert all(a > b for a, b in zip(values, values[1:]))
    assert values[0] / values[1] == pytest.approx(2 ** 1.2)
    assert list(zipf_shares(NAMES, 0.0).values()) == pytest.approx([1 / len(NAMES)] * len(NAMES))
    with pytest.raises(WorkloadError, match="twice"):
        zipf_shares(["a", "a"])


def test_same_seed_same_arrivals_other_seed_other_arrivals():
    s = parse_schedule("0:100,20~400")
    shares = zipf_shares(NAMES)
    a = scheduled_arrivals(s, shares, 30.0, cv=2.0, seed=7)
    b = scheduled_arrivals(s, shares, 30.0, cv=2.0, seed=7)
    c = scheduled_arrivals(s, shares, 30.0, cv=2.0, seed=8)
    assert np.array_equal(a.times_s, b.times_s) and np.array_equal(a.models, b.models)
    assert a.times_s.dtype == np.float64 and a.models.dtype == np.int32
    assert a.names == tuple(NAMES) and a.duration_s == 30.0
    assert np.all(np.diff(a.times_s) >= 0) and a.times_s[0] >= 0 and a.times_s[-1] < 30.0
    assert not (a.count() == c.count() and np.array_equal(a.times_s, c.times_s))


@pytest.mark.parametrize("text, cv", [
    ("0:60,120:300,240:60", 1.0),
    ("0:60,120:300,240:60", 2.0),
    ("0:0,150~400,300:100", 1.0),
    ("0:0,150~400,300:100", 3.0),
])
def test_each_models_count_is_its_share_of_the_schedules_integral(text, cv):
    s, duration = parse_schedule(text), 360.0
    shares = zipf_shares(NAMES)
    counts = scheduled_arrivals(s, shares, duration, cv=cv, seed=3).per_model_counts()
    for name, share in shares.items():
        expected = share * s.integral(0, duration)
        # a renewal count over many gaps has standard deviation ~ cv * sqrt(mean)
        assert abs(counts[name] - expected) < SIGMAS * cv * math.sqrt(expected) + 1, name


def test_a_ramp_spreads_arrivals_as_the_rate_rises():
    s = parse_schedule("0:0,100~1000")  # rate 10 t: Lambda(50) = 12,500, Lambda(100) = 50,000
    a = scheduled_arrivals(s, {"only": 1.0}, 100.0, seed=4)
    first_half = int(np.sum(a.times_s < 50))
    assert abs(first_half - 12_500) < SIGMAS * math.sqrt(12_500)
    assert abs(a.count() - first_half - 37_500) < SIGMAS * math.sqrt(37_500)


def test_time_rescaling_is_exact_mapped_back_the_gaps_are_unit_exponential():
    s = parse_schedule("0:20,30~200,60:50,90:0,100~80")
    a = scheduled_arrivals(s, {"only": 1.0}, 130.0, seed=5)
    u = np.array([s.integral(0, t) for t in a.times_s])
    gaps = np.diff(u)
    n = len(gaps)
    assert n > 5000
    assert gaps.mean() == pytest.approx(1.0, abs=SIGMAS / math.sqrt(n))
    assert gaps.std() == pytest.approx(1.0, abs=0.05)
    assert not np.any((a.times_s >= 60 + 30) & (a.times_s < 90 + 0))  # no arrival while the rate is 0


def test_a_step_from_60_to_300_rps_shows_in_the_seconds_either_side():
    s = parse_schedule("0:60,120:300,240:60")
    seeds = range(20)
    before = after = 0
    for seed in seeds:
        t = scheduled_arrivals(s, {"a": 1.0, "b": 3.0}, 125.0, seed=seed).times_s
        before += int(np.sum((t >= 119) & (t < 120)))
        after += int(np.sum((t >= 120) & (t < 121)))
    n_before, n_after = 60 * len(seeds), 300 * len(seeds)
    assert abs(before - n_before) < SIGMAS * math.sqrt(n_before)
    assert abs(after - n_after) < SIGMAS * math.sqrt(n_after)


def test_cv_3_makes_per_second_counts_overdispersed_cv_1_poisson():
    s = parse_schedule("0:200")
    poisson = per_second_counts(scheduled_arrivals(s, {"x": 1.0}, 400.0, cv=1.0, seed=6))
    bursty = per_second_counts(scheduled_arrivals(s, {"x": 1.0}, 400.0, cv=3.0, seed=6))
    assert poisson.var() / poisson.mean() == pytest.approx(1.0, abs=0.4)
    assert bursty.var() / bursty.mean() > 4  # about cv**2 = 9 for windows of many gaps
    assert bursty.mean() == pytest.approx(200, rel=0.1)


def test_appending_a_model_leaves_the_others_arrivals_unchanged():
    s = parse_schedule("0:100,10~300")
    base = scheduled_arrivals(s, {"a": 1.0, "b": 2.0}, 20.0, cv=2.0, seed=9)
    # Shares are normalised, so the schedule grows by the new model's weight to keep a's and b's rates.
    grown = parse_schedule("0:150,10~450")
    more = scheduled_arrivals(grown, {"a": 1.0, "b": 2.0, "c": 1.5}, 20.0, cv=2.0, seed=9)
    assert more.per_model_counts()["c"] > 0
    for i, name in enumerate(base.names):
        j = more.names.index(name)
        np.testing.assert_allclose(more.times_s[more.models == j], base.times_s[base.models == i],
                                   rtol=1e-12, atol=1e-12)


def test_scheduled_arrivals_rejects_bad_shares():
    s = parse_schedule("0:10")
    with pytest.raises(WorkloadError, match="sum to more than 0"):
        scheduled_arrivals(s, {"a": 0.0}, 10.0)
    with pytest.raises(WorkloadError, match="share of 'a'"):
        scheduled_arrivals(s, {"a": -1.0, "b": 2.0}, 10.0)


# --- Azure-like arrivals ----------------------------------------------------------------------

def test_synthetic_azure_is_deterministic_and_heavy_tailed():
    names = [f"f{i}" for i in range(1000)]
    a = synthetic_azure(names, 120.0, 200.0, seed=1)
    b = synthetic_azure(names, 120.0, 200.0, seed=1)
    c = synthetic_azure(names, 120.0, 200.0, seed=2)
    assert np.array_equal(a.times_s, b.times_s) and np.array_equal(a.models, b.models)
    assert not (a.count() == c.count() and np.array_equal(a.times_s, c.times_s))
    assert np.all(np.diff(a.times_s) >= 0) and a.times_s[-1] < 120.0
    totals = np.sort(np.array(list(a.per_model_counts().values())))[::-1]
    assert totals[: len(names) // 10].sum() > 0.5 * totals.sum()


def test_synthetic_azure_total_matches_the_rate():
    names = [f"f{i}" for i in range(200)]
    duration, rps = 600.0, 100.0
    expected = rps * duration
    # Without bursts the total is Poisson.
    steady = synthetic_azure(names, duration, rps, seed=3, burst_cv=0.0)
    assert abs(steady.count() - expected) < SIGMAS * math.sqrt(expected)
    # Equal popularity: the bursts of 200 models x 10 minutes average out to ~1.5 / sqrt(2000).
    bursty = synthetic_azure(names, duration, rps, seed=3, popularity_sigma=0.0)
    assert bursty.count() == pytest.approx(expected, rel=SIGMAS * 1.5 / math.sqrt(2000))
    # Default popularity: a few models carry most requests, so the total varies more.
    assert synthetic_azure(names, duration, rps, seed=3).count() == pytest.approx(expected, rel=0.3)


def test_synthetic_azure_minute_rates_are_lognormal_with_the_burst_cv():
    names = [f"f{i}" for i in range(100)]
    burst_cv = 1.5
    a = synthetic_azure(names, 600.0, 2000.0, seed=4, popularity_sigma=0.0, burst_cv=burst_cv)
    cells = np.zeros((len(names), 10))
    np.add.at(cells, (a.models, (a.times_s // 60).astype(int)), 1)
    log_ratio = np.log(cells / (20.0 * 60))  # each model's mean: 20 rps
    assert log_ratio.std() == pytest.approx(math.sqrt(math.log1p(burst_cv ** 2)), rel=0.1)


def test_synthetic_azure_idle_minutes_are_silent_and_keep_the_mean():
    names = [f"f{i}" for i in range(100)]
    duration, rps = 600.0, 3000.0
    a = synthetic_azure(names, duration, rps, seed=5, popularity_sigma=0.0, burst_cv=0.0,
                        idle_fraction=0.5)
    cells = np.zeros((len(names), 10))
    np.add.at(cells, (a.models, (a.times_s // 60).astype(int)), 1)
    assert np.mean(cells == 0) == pytest.approx(0.5, abs=SIGMAS * 0.5 / math.sqrt(cells.size))
    # Active minutes run at twice the mean (30 rps -> 3,600 per minute).
    assert cells[cells > 0].mean() == pytest.approx(3600, rel=0.01)
    assert a.count() == pytest.approx(rps * duration, rel=SIGMAS * 0.5 / math.sqrt(cells.size))
    with pytest.raises(WorkloadError, match="idle_fraction"):
        synthetic_azure(names, duration, rps, idle_fraction=1.0)


# --- trace files ------------------------------------------------------------------------------

def test_a_trace_round_trips_exactly(tmp_path):
    a = scheduled_arrivals(parse_schedule("0:50"), {"x": 1.0, "odd, \"name\"": 2.0, "z": 0.5}, 20.0,
                           cv=2.0, seed=11)
    path = tmp_path / "trace.csv"
    write_trace(a, path)
    b = load_trace(path, known_models=a.names)
    assert np.array_equal(a.times_s, b.times_s)
    assert [a.names[i] for i in a.models] == [b.names[i] for i in b.models]
    assert b.per_model_counts() == a.per_model_counts()
    assert b.duration_s > a.times_s[-1] and b.duration_s == np.nextafter(a.times_s[-1], np.inf)


def test_unsorted_csv_and_jsonl_traces_are_sorted_stably(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("model,time_s\nb,2.5\na,1\n\nc,1\n")
    a = load_trace(csv_path)
    assert a.times_s.tolist() == [1.0, 1.0, 2.5]
    assert a.names == ("b", "a", "c") and a.models.tolist() == [1, 2, 0]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"time_s": 3, "model": "b"}\n\n{"model": "a", "time_s": 0.5}\n')
    b = load_trace(jsonl)
    assert b.times_s.tolist() == [0.5, 3.0] and [b.names[i] for i in b.models] == ["a", "b"]


@pytest.mark.parametrize("name, text, message", [
    ("bad_header.csv", "time,model\n1,a\n", r"line 1: unexpected column\(s\) 'time'"),
    ("missing.csv", "time_s\n1\n", r"line 1: header 'time_s', expected 'time_s,model'"),
    ("extra.csv", "time_s,model,gpu\n1,a,x\n", r"line 1: unexpected column\(s\) 'gpu'"),
    ("fields.csv", "time_s,model\n1,a\n2,b,c\n", r"line 3: expected 2 fields"),
    ("bad_time.csv", "time_s,model\n1,a\nsoon,b\n", r"line 3: time_s must be a number of seconds, got 'soon'"),
    ("negative.csv", "time_s,model\n1,a\n\n-0.5,b\n", r"line 4: time_s must be >= 0"),
    ("inf.csv", "time_s,model\ninf,a\n", r"line 2: time_s must be finite"),
    ("no_model.csv", "time_s,model\n1,\n", r"line 2: model must be a non-empty name"),
    ("empty.csv", "time_s,model\n", r"line 1: no arrivals"),
    ("blank.csv", "", r"line 1: empty file"),
    ("bad.jsonl", '{"time_s": 1, "model": "a"}\n{"time_s": 2, "model": \n', r"line 2: not valid JSON"),
    ("list.jsonl", '[1, "a"]\n', r"line 1: expected an object"),
    ("key.jsonl", '{"time_s": 1, "model": "a", "gpu": 0}\n', r"line 1: .*unexpected \['gpu'\]"),
    ("str_time.jsonl", '{"time_s": "1", "model": "a"}\n', r"line 1: time_s must be a number"),
    ("neg.json-lines", '{"time_s": -1, "model": "a"}\n', r"line 1: time_s must be >= 0"),
    ("empty.jsonl", "\n\n", r"line 1: no arrivals"),
])
def test_trace_errors_name_the_path_and_line(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message) as e:
        load_trace(path)
    assert str(e.value).startswith(str(path))


def test_unknown_models_are_listed_with_their_count(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time_s,model\n0,a\n" + "".join(f"{i},u{i}\n" for i in range(1, 8)))
    assert load_trace(path, known_models=["a"] + [f"u{i}" for i in range(1, 8)]).count() == 8
    with pytest.raises(WorkloadError, match=r"line 3: 7 unknown model name\(s\).*'u1' \(line 3\), "
                                            r"'u2' \(line 4\).*'u5' \(line 7\) and 2 more") as e:
        load_trace(path, known_models={"a"})
    assert "u6" not in str(e.value)


def test_unknown_extension_is_an_error(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text("time_s,model\n1,a\n")
    with pytest.raises(WorkloadError, match=r"trace\.txt: unknown trace format '\.txt'"):
        load_trace(path)


def test_write_trace_needs_a_csv_path_and_arrivals(tmp_path):
    a = Arrivals(np.array([0.5]), np.array([0], dtype=np.int32), ("a",), 1.0)
    with pytest.raises(WorkloadError, match="must end in '.csv'"):
        write_trace(a, tmp_path / "t.jsonl")
    empty = Arrivals(np.zeros(0), np.zeros(0, dtype=np.int32), ("a",), 1.0)
    with pytest.raises(WorkloadError, match="no arrivals"):
        write_trace(empty, tmp_path / "t.csv")


def test_arrivals_checks_its_contract():
    with pytest.raises(WorkloadError, match="sorted"):
        Arrivals(np.array([0.2, 0.1]), np.array([0, 0]), ("a",), 1.0)
    with pytest.raises(WorkloadError, match=r"\[0, 1.0\)"):
        Arrivals(np.array([0.2, 1.0]), np.array([0, 0]), ("a",), 1.0)
    with pytest.raises(WorkloadError, match="model indices"):
        Arrivals(np.array([0.2]), np.array([1]), ("a",), 1.0)
    assert Arrivals(np.array([0.1, 0.2]), np.array([1, 1]), ("a", "b"), 1.0).per_model_counts() == {
        "a": 0, "b": 2}


def test_a_cv_per_model_gives_each_model_its_own_burstiness_and_names_a_missing_one():
    from nexus.simulate.workload import WorkloadError, parse_schedule, scheduled_arrivals

    shares = {"smooth": 0.5, "bursty": 0.5}
    arrivals = scheduled_arrivals(parse_schedule("0:400"), shares, 200.0, cv={"smooth": 1.0, "bursty": 4.0}, seed=3)
    dispersion = {}
    for j, name in enumerate(arrivals.names):
        counts = np.bincount(arrivals.times_s[arrivals.models == j].astype(int), minlength=200)
        dispersion[name] = counts.var() / counts.mean()
    assert dispersion["smooth"] < 2 < 5 < dispersion["bursty"]
    with pytest.raises(WorkloadError, match="no coefficient of variation for 'bursty'"):
        scheduled_arrivals(parse_schedule("0:400"), shares, 10.0, cv={"smooth": 1.0})
