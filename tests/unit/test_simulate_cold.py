"""Cold models in the simulator (issue 26): a fleet larger than the devices' memory keeps the most
recently requested models resident; a request for a cold one is held, reported at once, and served
once the plan that pages it in is in force, as the frontend and scheduler do (frontend/frontend_state.py,
globalsched/planning/residency.py)."""

from __future__ import annotations

import numpy as np

from nexus.simulate.config import SimConfig
from nexus.simulate.models import linear_models
from nexus.simulate.outcomes import Loss, Status
from nexus.simulate.report import summarize
from nexus.simulate.run import Simulation
from nexus.simulate.workload import Arrivals

SLO_MS = 100.0


def fleet(requests: dict[str, list[float]], duration_s: float = 40.0, models: int = 6):
    """``models`` models of 630 MB on one device of 1,300 MB (it holds two), and the given arrivals."""
    fleet_models = linear_models(models, SLO_MS, 0.5, 1.5, 32, memory_mb=630.0)
    names = tuple(m.name for m in fleet_models)
    pairs = sorted((t, names.index(name)) for name, times in requests.items() for t in times)
    arrivals = Arrivals(np.array([t for t, _ in pairs]), np.array([i for _, i in pairs], dtype=np.int32),
                        names, duration_s)
    sim = Simulation(fleet_models, arrivals, SimConfig(backends=1, memory_mb=1300.0, seed=3))
    sim.run()
    return sim, summarize(sim)


def test_a_request_for_a_cold_model_is_held_paged_in_and_answered_while_the_busy_one_stays_resident():
    # resident at the first plan (before any report): m0000 and m0001, by name. m0005 comes before the
    # first routing table, and waits for it, then for its page-in; each later one evicts the least
    # recently used of the others
    busy = list(np.arange(1.0, 40.0, 0.2))
    sim, result = fleet({"m0000": busy, "m0005": [0.3, 30.0], "m0003": [10.0, 35.0], "m0004": [20.0, 20.05]})
    status, cold, latency = sim.outcomes.status, sim.outcomes.cold, sim.outcomes.latency_ms
    names = [sim.arrivals.names[i] for i in sim.arrivals.models]
    times = sim.arrivals.times_s
    # the busy model: every request after the first table within its SLO, none ever found it cold
    mine = np.array([n == "m0000" for n in names])
    assert not cold[mine].any()
    assert np.all(status[mine] == Status.ON_TIME)
    # the cold ones: held (even the one that came before the first table, and waited for it first),
    # paged in and answered, later than the SLO by the page-in, well within the page-in allowance
    for i in np.nonzero(~mine)[0]:
        assert cold[i] and status[i] in (Status.ON_TIME, Status.LATE), (names[i], times[i], Status(status[i]))
        assert latency[i] < SLO_MS + 2000.0
    assert result["cold"]["cold_requests"] == 6 and result["cold"]["first_of_wait"]["requests"] == 5
    assert result["failed"] == 0 and result["lost_to_eviction"] == 0
    assert result["cold"]["page_ins"] == 5          # asked once per wait, not once per request
    # the page-in evicted the least recently used model, never the busy one
    evictions = [e for e in sim.events if e["kind"] == "page-in"]
    assert all("m0000" not in e["text"] for e in evictions)


def test_a_model_evicted_with_requests_queued_has_them_answered_after_its_page_in():
    """Two models alternate in bursts on a device that holds one of them besides the busy one: each
    burst pages its model in and evicts the other; whatever the eviction let go is retried, held for
    the page-in and answered, and counted as let go by an eviction rather than lost."""
    bursts = {"m0001": [], "m0002": []}
    for k in range(8):
        name = "m0001" if k % 2 == 0 else "m0002"
        bursts[name].extend(np.arange(4.0 * k + 2.0, 4.0 * k + 3.0, 0.01))
    sim, result = fleet({"m0000": list(np.arange(1.0, 36.0, 0.05)), **bursts}, duration_s=36.0, models=3)
    assert result["failed"] == 0 and result["lost_to_eviction"] == 0
    assert result["cold"]["first_of_wait"]["requests"] >= 7       # a page-in per burst after the first
    status = sim.outcomes.status
    assert np.all((status == Status.ON_TIME) | (status == Status.LATE))
    assert set(np.unique(sim.outcomes.loss)) <= {Loss.NONE, Loss.EVICTED}
