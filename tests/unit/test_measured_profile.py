"""Measured profiles (issue 18, item 1): robust figures, enough samples, drift, no ratchet."""

from __future__ import annotations

import random

import pytest

from common.measured_profile import (EstimatorConfig, LatencySample, MeasuredProfile, ProfileSource, measured_table,
                                     theil_sen, update_profile)
from common.profile import Profile

TRUTH = Profile.linear(2.0, 10.0, 16, 100.0, 5.0, "cpu")  # l(b) = 10 + 2b
# the uploaded table of that truth: its conservative figure, (mean + std) * 1.15 with 3% noise
TABLE = Profile.linear(2.0 * 1.03 * 1.15, 10.0 * 1.03 * 1.15, 16, 100.0, 5.0, "cpu")


def samples(batches: list[int], n: int, seed: int, scale: float = 1.0, outliers: float = 0.0,
            contended: bool = False) -> list[LatencySample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        for b in batches:
            v = TRUTH.latency_ms(b) * scale * rng.gauss(1.0, 0.03)
            if rng.random() < outliers:
                v *= rng.uniform(3, 10)  # a GC pause, a page fault, a noisy neighbour
            out.append(LatencySample(b, v, contended))
    return out


def test_figures_are_robust_to_outliers() -> None:
    m = MeasuredProfile("cpu").add(samples([1, 4, 8, 16], 200, seed=1, outliers=0.05))
    figs = m.figures()
    assert set(figs) == {1, 4, 8, 16}
    for b, f in figs.items():
        assert f.median_ms == pytest.approx(TRUTH.latency_ms(b), rel=0.02)
        # Nexus's (mean + std) * 1.15 from robust estimates: within 10% of truth * 1.15 despite 5% outliers
        assert f.planning_ms == pytest.approx(TRUTH.latency_ms(b) * 1.03 * 1.15, rel=0.05)
    # the same samples' plain mean + std would have planned 40%+ above the truth
    values = [s.latency_ms for s in samples([16], 200, seed=1, outliers=0.05)]
    mean = sum(values) / len(values)
    std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
    assert (mean + std) * 1.15 > 1.4 * figs[16].planning_ms


def test_unobserved_batches_come_from_the_fit_clamped_and_monotone() -> None:
    assert theil_sen([(1, 3.0), (2, 5.0), (3, 7.0), (4, 9.0), (5, 100.0)]) == (pytest.approx(1.0), pytest.approx(2.0))
    m = MeasuredProfile("cpu").add(samples([2, 4, 8], 60, seed=2))
    table = measured_table(m, TRUTH)
    assert table is not None and table.max_batch == 16 and table.meta["counted_batches"] == [2, 4, 8]
    lats = [table.latency_ms(b) for b in range(1, 17)]
    assert lats == sorted(lats)
    scale = table.latency_ms(8) / TRUTH.latency_ms(8)
    for b in (3, 12, 16):   # between and beyond the counted sizes: the line, at the same margin
        assert table.latency_ms(b) == pytest.approx(TRUTH.latency_ms(b) * scale, rel=0.05)
    assert 0 < table.latency_ms(1) <= table.latency_ms(2)
    assert table.memory_mb(16) == TRUTH.memory_mb(16)  # memory stays the table's


def test_enough_samples_rule() -> None:
    table = TRUTH
    state, upd = update_profile(MeasuredProfile("cpu"), samples([16], 100, seed=3), table)
    assert upd.source is ProfileSource.TABLE and upd.profile is table and not upd.replan  # one size only
    state, upd = update_profile(state, samples([4], 10, seed=4), table)
    assert upd.source is ProfileSource.TABLE  # 10 < min_samples at the second size
    state, upd = update_profile(state, samples([4], 10, seed=5), table)
    assert upd.source is ProfileSource.MEASURED and upd.profile.meta["source"] == "measured"
    single = Profile.linear(2.0, 10.0, 1)
    _, upd = update_profile(MeasuredProfile(), samples([1], 20, seed=6), single)
    assert upd.source is ProfileSource.MEASURED  # a table of batch 1 only needs that size


def test_drift_replaces_a_pessimistic_table_and_noise_does_not_replan() -> None:
    busy = Profile.linear(3.2, 16.0, 16)  # profiled while other work shared the cores: 60% slow
    state, upd = update_profile(MeasuredProfile("cpu"), samples([1, 8, 16], 40, seed=7), busy)
    assert upd.source is ProfileSource.MEASURED and upd.replan and upd.drift > 0.2
    assert upd.profile.latency_ms(16) < 0.8 * busy.latency_ms(16)
    applied = upd.profile
    state, upd = update_profile(state, samples([1, 8, 16], 40, seed=8, scale=1.04), busy)
    assert upd.profile is applied and not upd.replan and upd.drift < 0.15


def test_overload_does_not_ratchet_the_plan() -> None:
    state, upd = update_profile(MeasuredProfile("cpu"), samples([1, 8, 16], 40, seed=9), TABLE)
    applied = upd.profile
    # An overload episode flagged as such: three times slower batches, only at the largest size.
    state, upd = update_profile(state, samples([16], 300, seed=10, scale=3.0, contended=True), TABLE)
    assert upd.profile is applied and not upd.replan
    assert upd.profile.meta["contended_samples"] == 0 and state.contended_samples() == 300
    # Unflagged contention, 60% slower: one update moves the plan by at most 10% ...
    slow = samples([1, 8, 16], 300, seed=11, scale=1.6)
    state, upd = update_profile(state, slow, TABLE)
    assert upd.held_back and all(upd.profile.latency_ms(b) <= applied.latency_ms(b) * 1.1 + 1e-9
                                 for b in range(1, 17))
    state, upd = update_profile(state, samples([1, 8, 16], 300, seed=12, scale=1.6), TABLE)
    assert upd.held_back
    # ... and only corroborated by three updates in a row is the raise taken in full.
    state, upd = update_profile(state, samples([1, 8, 16], 300, seed=13, scale=1.6), TABLE)
    assert not upd.held_back and upd.replan
    assert upd.profile.latency_ms(16) == pytest.approx(applied.latency_ms(16) * 1.6, rel=0.06)
    # Faster again (the contention is gone): applied at once.
    state, upd = update_profile(state, samples([1, 8, 16], 300, seed=14), TABLE)
    assert upd.profile.latency_ms(16) == pytest.approx(applied.latency_ms(16), rel=0.06) and upd.replan


def test_bad_samples_and_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        MeasuredProfile().add([LatencySample(0, 5.0)])
    with pytest.raises(ValueError, match="latency a positive number"):
        MeasuredProfile().add([LatencySample(2, float("nan"))])
    with pytest.raises(ValueError, match="window >= min_samples"):
        EstimatorConfig(window=10, min_samples=20)
    with pytest.raises(ValueError, match="must be positive"):
        EstimatorConfig(drift_threshold=0.0)


def test_contended_samples_bound_a_pessimistic_table_from_above_only() -> None:
    """A table 2x pessimistic plans a small batch, so every batch it serves leaves a queue behind and is
    flagged contended: those samples still show the table too slow (contention only slows a batch),
    so they lower it; contended samples slower than the profile in use never raise it."""
    slow = Profile.linear(4.0, 20.0, 16, 100.0, 5.0, "cpu")            # 2x the truth
    flagged = samples([3, 4, 5], 30, seed=20, scale=1.2, contended=True)  # 20% slowed by the overload
    state, upd = update_profile(MeasuredProfile("cpu"), flagged, slow)
    assert upd.source is ProfileSource.MEASURED and upd.replan
    assert upd.profile.meta["bound_batches"] == [3, 4, 5] and upd.profile.meta["counted_batches"] == [3, 4, 5]
    for b in range(1, 17):  # lowered, never below the truth's conservative figure, never above the table
        assert TRUTH.latency_ms(b) * 1.15 <= upd.profile.latency_ms(b) <= slow.latency_ms(b)
    assert upd.profile.latency_ms(16) < 0.75 * slow.latency_ms(16)    # the plan can grow its batch
    applied = upd.profile
    # An overload three times slower, all flagged: above the profile in use, the bounds tell nothing.
    state, upd = update_profile(state, samples([3, 4, 5, 8], 300, seed=21, scale=3.0, contended=True), slow)
    assert upd.profile is applied and not upd.replan and not upd.held_back
    # Clean samples take over from bounds at their sizes.
    state, upd = update_profile(state, samples([4, 8], 30, seed=22), slow)
    assert upd.profile.meta["counted_batches"] == [4, 8] and upd.profile.meta["bound_batches"] == []
    assert upd.profile.latency_ms(8) == pytest.approx(TRUTH.latency_ms(8) * 1.03 * 1.15, rel=0.08)


def test_bounds_below_the_profile_in_use_only() -> None:
    m = MeasuredProfile("cpu").add(samples([4], 25, seed=23, contended=True))
    assert m.figures() == {} and set(m.bound_figures(TRUTH)) == set()      # at the truth: no bound below it
    assert set(m.bound_figures(Profile.linear(4.0, 20.0, 16))) == {4}
    assert set(m.bound_figures(Profile.linear(4.0, 20.0, 2))) == set()     # beyond the table's sizes
    # a size with enough clean samples has a figure, not a bound
    m = m.add(samples([4], 20, seed=24))
    assert set(m.figures()) == {4} and m.bound_figures(Profile.linear(4.0, 20.0, 16)) == {}


def test_bounds_cap_nothing_without_contended_samples() -> None:
    """Clean samples that show an optimistic table raise it at the sizes they extrapolate to as well
    (the cap at the profile in use applies only while bounds count)."""
    fast = Profile.linear(1.0, 5.0, 16, 100.0, 5.0, "cpu")   # half the truth
    state = MeasuredProfile("cpu")
    for seed in (30, 31, 32):
        state, upd = update_profile(state, samples([2, 4], 30, seed=seed), fast)
    assert not upd.held_back and upd.profile.meta["bound_batches"] == []
    assert upd.profile.latency_ms(16) > 1.5 * fast.latency_ms(16)


def test_a_quick_profile_is_extended_beyond_its_measured_sizes_by_its_last_per_item_step():
    from common.profile import BatchLatency, Profile

    measured = Profile.from_rows([BatchLatency(1, 2.0, 100.0), BatchLatency(2, 3.0, 102.0),
                                  BatchLatency(3, 3.8, 104.0), BatchLatency(4, 4.4, 106.0)], "cpu")
    quick = measured.extended(8)
    assert quick.max_batch == 8 and quick.rows[:4] == measured.rows
    assert [round(quick.latency_ms(b), 6) for b in range(5, 9)] == [5.0, 5.6, 6.2, 6.8]     # l(4) + 0.6 ms per item
    assert [quick.memory_mb(b) for b in range(5, 9)] == [108.0, 110.0, 112.0, 114.0]    # the last step's 2 MB/item
    assert quick.meta["extrapolated_from_batch"] == 4
    quick.validate()
    assert measured.extended(4) is measured and measured.extended(2) is measured   # covered already
