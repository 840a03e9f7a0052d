"""Batch policies and the single-device simulation (pure: simulated time only, nothing sleeps)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.batch_decision import (
    POLICIES, BatchPolicy, EarliestFirst, Pending, PolicyName, Selection, SlidingWindowEarlyDrop, make_policy,
)
from backend.sessions import session_max_batch
from backend.simulate import SimResult, capacity_rps, saturated_batch, simulate
from common.arrivals import arrival_times
from common.batch_decision import saturated_batch as common_saturated_batch
from common.profile import BatchLatency, Profile

ALPHA_MS, BETA_MS, SLO_MS = 1.0, 5.0, 100.0


def linear(b: int) -> float:
    """l(b) = alpha*b + beta: a GPU-like profile (B = 45 at a 100 ms SLO, 900 req/s)."""
    return ALPHA_MS * b + BETA_MS


def queue_of(*deadlines_s: float) -> list[Pending]:
    return [Pending(i, d, 0.0) for i, d in enumerate(deadlines_s)]


def ids(items) -> list[int]:
    return [p.request_id for p in items]


# ---- value types and the registry -----------------------------------------------------------------

def test_pending_payload_takes_no_part_in_equality():
    assert Pending(1, 2.0, 1.0, payload=[1]) == Pending(1, 2.0, 1.0, payload=[2])
    assert hash(Pending(1, 2.0, 1.0, payload="a")) == hash(Pending(1, 2.0, 1.0))


def test_selection_never_runs_and_drops_the_same_request():
    p = Pending(7, 1.0, 0.0)
    with pytest.raises(ValueError, match="both in the batch and dropped"):
        Selection(batch=(p,), dropped=(p,))
    assert Selection() == Selection((), ())


def test_registry_maps_names_to_policies():
    assert set(POLICIES) == {"early_drop", "earliest_first"} == {p.value for p in PolicyName}
    assert isinstance(make_policy("early_drop"), SlidingWindowEarlyDrop)
    assert isinstance(make_policy(PolicyName.EARLIEST_FIRST), EarliestFirst)
    for name, cls in POLICIES.items():
        assert cls.name == name


def test_unknown_policy_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown batch policy 'lifo'; known: early_drop, earliest_first"):
        make_policy("lifo")


@pytest.mark.parametrize("policy", [EarliestFirst(), SlidingWindowEarlyDrop()])
@pytest.mark.parametrize("max_batch", [0, -3, 2.5, True])
def test_policies_reject_bad_max_batch(policy, max_batch):
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        policy.select(queue_of(1.0), 0.0, max_batch, linear)


@pytest.mark.parametrize("policy", [EarliestFirst(), EarliestFirst(drop_expired=False), SlidingWindowEarlyDrop()])
def test_empty_queue_selects_nothing(policy):
    assert policy.select([], 0.0, 8, linear) == Selection()


# ---- EarliestFirst ----------------------------------------------------------------------------------

def test_earliest_first_takes_the_earliest_deadlines_up_to_max_batch():
    queue = queue_of(1.0, 2.0, 3.0, 4.0, 5.0)
    selection = EarliestFirst().select(queue, 0.0, 3, linear)
    assert ids(selection.batch) == [0, 1, 2] and selection.dropped == ()


def test_earliest_first_drops_only_requests_already_past_their_deadline():
    queue = queue_of(0.5, 1.0, 1.0005, 3.0)
    selection = EarliestFirst().select(queue, 1.0, 8, linear)
    # deadline 1.0005 cannot be met with l(2) = 7 ms, but EarliestFirst still runs it: only expiry drops
    assert ids(selection.dropped) == [0, 1] and ids(selection.batch) == [2, 3]


def test_earliest_first_without_drop_runs_even_expired_requests():
    queue = queue_of(0.5, 1.0, 3.0)
    selection = EarliestFirst(drop_expired=False).select(queue, 2.0, 8, linear)
    assert ids(selection.batch) == [0, 1, 2] and selection.dropped == ()


# ---- SlidingWindowEarlyDrop ---------------------------------------------------------------------------

def test_early_drop_runs_a_full_window_when_the_head_can_make_it():
    queue = queue_of(*[1.0] * 10)
    selection = SlidingWindowEarlyDrop().select(queue, 0.0, 4, linear)
    assert ids(selection.batch) == [0, 1, 2, 3] and selection.dropped == ()


def test_early_drop_slides_past_heads_that_would_miss_in_a_full_batch():
    # l(4) = 9 ms. Requests 0 and 1 have 3 ms and 8 ms left: both miss in a batch of 4.
    # Request 1 could make it alone (l(1) = 6 ms) but the window is full: it is dropped, not rescued.
    queue = queue_of(0.003, 0.008, 0.010, 0.020, 0.020, 0.020, 0.020)
    selection = SlidingWindowEarlyDrop().select(queue, 0.0, 4, linear)
    assert ids(selection.dropped) == [0, 1] and ids(selection.batch) == [2, 3, 4, 5]
    assert 0.0 + linear(len(selection.batch)) / 1000 <= min(p.deadline_s for p in selection.batch)


def test_early_drop_shrinks_a_window_that_is_not_full_to_rescue_the_head():
    # Three queued, max_batch 8: l(3) = 8 ms misses the head's 7 ms, l(2) = 7 ms meets it.
    queue = queue_of(0.007, 0.050, 0.050)
    selection = SlidingWindowEarlyDrop().select(queue, 0.0, 8, linear)
    assert ids(selection.batch) == [0, 1] and selection.dropped == ()  # request 2 stays queued


def test_early_drop_drops_everything_when_nothing_can_make_it():
    queue = queue_of(0.001, 0.002, 0.004)
    selection = SlidingWindowEarlyDrop().select(queue, 0.0, 8, linear)
    assert selection.batch == () and ids(selection.dropped) == [0, 1, 2]


def test_early_drop_uses_the_time_it_is_given():
    queue = queue_of(10.010, 10.020)
    assert ids(SlidingWindowEarlyDrop().select(queue, 10.0, 2, linear).batch) == [0, 1]
    assert ids(SlidingWindowEarlyDrop().select(queue, 10.013, 2, linear).batch) == [1]


deadlines = st.lists(st.floats(min_value=0.0, max_value=0.2, allow_nan=False), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(deadlines, st.integers(min_value=1, max_value=16), st.floats(min_value=0.1, max_value=5.0),
       st.floats(min_value=0.5, max_value=20.0))
def test_early_drop_invariants(raw_deadlines, max_batch, alpha, beta):
    def latency(b: int) -> float:
        assert 1 <= b <= max_batch
        return alpha * b + beta

    queue = queue_of(*sorted(raw_deadlines))
    selection = SlidingWindowEarlyDrop().select(queue, 0.0, max_batch, latency)
    k, b = len(selection.dropped), len(selection.batch)
    # dropped is a prefix, the batch follows it, the rest stays queued
    assert list(selection.dropped) + list(selection.batch) == queue[:k + b]
    assert b <= max_batch
    if b:
        # every request in the batch finishes by its deadline
        assert latency(b) / 1000.0 <= queue[k].deadline_s + 1e-12
    else:
        # nothing runs only when nobody can make it even alone
        assert k == len(queue) and all(p.deadline_s * 1000.0 < latency(1) for p in queue)
    for p in selection.dropped:
        assert p.deadline_s * 1000.0 < latency(min(max_batch, len(queue) - p.request_id))


# ---- the simulation ------------------------------------------------------------------------------------

B = saturated_batch(linear, SLO_MS, 256)
CAPACITY = capacity_rps(linear, B)


def test_profile_helpers():
    assert B == 45 and CAPACITY == pytest.approx(900.0)
    with pytest.raises(ValueError, match="below 2\\*l\\(1\\)"):
        saturated_batch(linear, 11.0, 64)


def run(policy: BatchPolicy, load: float, seconds: float = 20.0, seed: int = 1) -> SimResult:
    return simulate(policy, arrival_times(load * CAPACITY, seconds, seed), SLO_MS, linear, B)


def test_early_drop_keeps_goodput_at_capacity_under_2x_overload():
    result = run(SlidingWindowEarlyDrop(), 2.0)
    assert result.goodput_rps >= 0.9 * CAPACITY
    assert result.late == 0  # what runs is on time; the excess is dropped
    assert result.mean_batch > 0.9 * B


def test_no_drop_collapses_under_2x_overload():
    no_drop = run(EarliestFirst(drop_expired=False), 2.0)
    assert no_drop.goodput_rps < 0.2 * CAPACITY
    assert no_drop.dropped == 0 and no_drop.late > 0.9 * no_drop.offered
    expired_only = run(EarliestFirst(), 2.0)
    assert expired_only.goodput_rps < 0.2 * CAPACITY


@pytest.mark.parametrize("alpha, beta, slo", [(0.25, 10.0, 50.0), (2.0, 1.0, 40.0)])
def test_early_drop_holds_for_other_profiles(alpha, beta, slo):
    def latency(b: int) -> float:
        return alpha * b + beta

    batch = saturated_batch(latency, slo, 512)
    capacity = capacity_rps(latency, batch)
    arrivals = arrival_times(2.0 * capacity, 10.0, 3)
    early = simulate(SlidingWindowEarlyDrop(), arrivals, slo, latency, batch)
    fifo = simulate(EarliestFirst(drop_expired=False), arrivals, slo, latency, batch)
    assert early.goodput_rps >= 0.9 * capacity > 3 * fifo.goodput_rps


def test_under_light_load_early_drop_serves_everything_on_time():
    result = run(SlidingWindowEarlyDrop(), 0.5)
    assert result.bad_rate <= 0.01 and result.goodput_rps >= 0.98 * 0.5 * CAPACITY


@pytest.mark.parametrize("policy", [SlidingWindowEarlyDrop(), EarliestFirst(), EarliestFirst(drop_expired=False)])
def test_simulation_accounts_for_every_request(policy):
    result = run(policy, 1.5, seconds=5.0)
    assert result.on_time + result.late + result.dropped == result.offered > 0
    assert result == run(policy, 1.5, seconds=5.0)  # deterministic


def test_simulation_of_no_arrivals():
    result = simulate(SlidingWindowEarlyDrop(), (), SLO_MS, linear, B)
    assert (result.offered, result.on_time, result.goodput_rps, result.bad_rate) == (0, 0, 0.0, 0.0)


def test_single_request_is_served_at_once():
    result = simulate(SlidingWindowEarlyDrop(), (3.0,), SLO_MS, linear, B)
    assert (result.on_time, result.batches, result.latency_p50_ms) == (1, 1, pytest.approx(6.0))


def test_simulation_rejects_bad_arguments():
    with pytest.raises(ValueError, match="non-decreasing"):
        simulate(EarliestFirst(), (0.0, 2.0, 1.0), SLO_MS, linear, B)
    with pytest.raises(ValueError, match="slo_ms must be positive"):
        simulate(EarliestFirst(), (0.0,), 0.0, linear, B)


class _Oversized(BatchPolicy):
    name = PolicyName.EARLIEST_FIRST

    def _select(self, queue, now_s, max_batch, latency_ms):
        return Selection(batch=tuple(queue[: max_batch + 1]))


class _Stranger(BatchPolicy):
    name = PolicyName.EARLIEST_FIRST

    def _select(self, queue, now_s, max_batch, latency_ms):
        return Selection(batch=(Pending(10_000, 1.0, 0.0),))


class _Waiter(BatchPolicy):
    """Waits until 3 requests are queued: stranded requests at the end count as dropped."""

    name = PolicyName.EARLIEST_FIRST

    def _select(self, queue, now_s, max_batch, latency_ms):
        return Selection(batch=tuple(queue[:3])) if len(queue) >= 3 else Selection()


def test_simulation_rejects_misbehaving_policies():
    arrivals = (0.0, 0.001, 0.002, 0.003)
    with pytest.raises(ValueError, match="more than max_batch=2"):
        simulate(_Oversized(), arrivals, SLO_MS, linear, 2)
    with pytest.raises(ValueError, match="not queued"):
        simulate(_Stranger(), arrivals, SLO_MS, linear, 2)


def test_simulation_lets_a_policy_wait_for_arrivals():
    result = simulate(_Waiter(), (0.0, 0.001, 0.002, 0.003), SLO_MS, linear, 8)
    assert (result.on_time, result.dropped, result.batches) == (3, 1, 1)


# ---- duty-cycle batching in the engine (fake clock) -----------------------------------------------


def test_batch_waits_for_the_planned_size_or_one_duty_cycle():
    from common.batch_decision import batch_ready_at

    def latency(b):
        return 10.0 * b + 30.0

    queue = [Pending(i, deadline_s=1.0 + 0.5, arrival_s=1.0 + 0.01 * i) for i in range(3)]
    assert batch_ready_at(queue, 3, 0.1, latency) == float("-inf")           # planned batch there: now
    assert batch_ready_at(queue, 1, 0.1, latency) == float("-inf")           # planned batch 1: eager
    assert abs(batch_ready_at(queue, 5, 0.1, latency) - 1.1) < 1e-9          # oldest waited a duty cycle
    tight = [Pending(0, deadline_s=1.05, arrival_s=1.0)]
    assert abs(batch_ready_at(tight, 5, 0.1, latency) - (1.05 - 0.08)) < 1e-9  # deadline forces the start


@settings(max_examples=300, deadline=None, derandomize=True)
@given(latencies=st.lists(st.floats(0.01, 500, allow_nan=False), min_size=1, max_size=64),
       slo_ms=st.floats(0.01, 2000, allow_nan=False), factor=st.floats(0.05, 20, allow_nan=False))
def test_session_max_batch_bisects_to_the_batch_the_scan_finds(latencies, slo_ms, factor):
    """The engine's bisection of the latency envelope (backend/sessions.py) against the one rule,
    the scan from b = 1 that stops at the first miss."""
    profile = Profile.from_rows(BatchLatency(b + 1, ms) for b, ms in enumerate(sorted(latencies)))
    scan = max(1, common_saturated_batch(lambda b: profile.latency_ms(b) * factor, slo_ms, profile.max_batch))
    assert session_max_batch(profile, slo_ms, factor) == scan
