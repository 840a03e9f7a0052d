"""The idle scheduler's work follows events, not time (issue 29), in process: the latency split is
computed once per distinct input, an Attach stream sends an event only for a new epoch or its end,
and a frontend's quiet reports are news only while its windows still change.
tests/e2e/test_scheduler_idle_cpu.py measures a real scheduler's idle CPU."""

from __future__ import annotations

import asyncio
import copy
import json
import time

from common.pb import control
from common.profile import Profile
from common.query_def import parse_query
from common.sample_queries import SAMPLE_QUERIES
from common.config import SchedulerConfig
from common import grpc_util
from globalsched.planning.algorithms.config import PlannerConfig
from globalsched.state.failure_detector import DetectorState
from globalsched.state.membership import Membership, Node
from globalsched.planning.query_sessions import plan_query_sessions, query_split
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.state.rate_reports import Workload


def _traffic_inputs():
    q = parse_query(json.dumps(copy.deepcopy(SAMPLE_QUERIES["traffic"])))
    profiles = {m: {"gpu": Profile.linear(a, b, 64)} for m, a, b in
                (("detector", 2.0, 10.0), ("vehicle_cls", 1.0, 5.0), ("face_cls", 1.0, 5.0))}
    return {"traffic": q}, profiles


def test_the_latency_split_is_computed_once_per_distinct_input():
    queries, profiles = _traffic_inputs()
    config = PlannerConfig(burst_sigma=1.5, network_ms=5.0)
    query_split.cache_clear()
    first = plan_query_sessions(queries, {"traffic": 20.0}, {}, profiles, ["gpu"], "dp", config=config)
    again = plan_query_sessions(queries, {"traffic": 20.0}, {}, profiles, ["gpu"], "dp", config=config)
    assert first == again
    assert query_split.cache_info().hits == 1 and query_split.cache_info().misses == 1
    # Another rate (or gamma, profile, config) is another split.
    other = plan_query_sessions(queries, {"traffic": 200.0}, {}, profiles, ["gpu"], "dp", config=config)
    assert query_split.cache_info().misses == 2 and other[0] != first[0]


def test_a_query_split_prices_the_burst_room_of_its_device_types_plan():
    queries, profiles = _traffic_inputs()
    config = PlannerConfig(network_ms=5.0)
    plain = plan_query_sessions(queries, {"traffic": 20.0}, {}, profiles, ["gpu"], "dp", config=config)
    typed = plan_query_sessions(queries, {"traffic": 20.0}, {}, profiles, ["gpu"], "dp", config=config,
                                burst_sigmas={"gpu": 1.5})
    with_room = plan_query_sessions(queries, {"traffic": 20.0}, {}, profiles, ["gpu"], "dp",
                                    config=PlannerConfig(network_ms=5.0, burst_sigma=1.5))
    assert typed == with_room and typed != plain
    other_type = plan_query_sessions(queries, {"traffic": 20.0}, {}, profiles, ["gpu"], "dp", config=config,
                                     burst_sigmas={"cpu": 1.5})
    assert other_type == plain


def test_an_attach_stream_sends_one_event_and_ends_when_the_node_goes():
    async def main():
        trigger = ReplanTrigger(epoch=7)
        membership = Membership(SchedulerConfig(), grpc_util.NO_CREDENTIALS, Workload(), trigger)
        membership.nodes["be-1"] = Node("be-1", control.NODE_KIND_BACKEND, "127.0.0.1:1")
        events = membership.attach("be-1")
        assert (await events.__anext__()).epoch == 7
        following = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0.05)
        assert not following.done()                 # no keep-alive while nothing changes
        trigger.epoch = 8
        await asyncio.sleep(0.05)
        assert not following.done()                 # nor a message per plan: no node reads them
        await membership.remove_node("be-1", "test")
        try:
            await asyncio.wait_for(following, 1)
            raise AssertionError("the stream goes on after its node was removed")
        except StopAsyncIteration:
            pass

    asyncio.run(main())


def test_a_stream_that_ends_just_after_the_schedulers_own_pause_removes_nobody():
    async def main():
        membership = Membership(SchedulerConfig(), grpc_util.NO_CREDENTIALS, Workload(), ReplanTrigger(epoch=1))
        for name in ("be-1", "be-2"):
            membership.nodes[name] = Node(name, control.NODE_KIND_BACKEND, "127.0.0.1:1")
        # the reaper's last check was 12 s ago: the scheduler was stopped, and its own keepalive may end
        # the stream of a healthy node as it resumes
        membership.detector_state = DetectorState(last_check_s=time.monotonic() - 12.0)
        events = membership.attach("be-1")
        await events.__anext__()
        await events.aclose()                       # the stream ends
        assert "be-1" in membership.nodes
        # on time: a stream's end is the node's, and removes it at once
        membership.detector_state = DetectorState(last_check_s=time.monotonic())
        events = membership.attach("be-2")
        await events.__anext__()
        await events.aclose()
        assert "be-2" not in membership.nodes

    asyncio.run(main())


def _report(workload: Workload, now: float, requests: int = 0, node: str = "fe") -> bool:
    return workload.report(control.WorkloadReport(node_id=node, rates=[control.SessionRate(
        model="m", rate_rps=requests / 2.0, requests=requests, window_ms=2000)]), now)


def test_quiet_reports_are_news_only_while_the_planners_inputs_still_change():
    w = Workload()
    news = [_report(w, t) for t in (0.0, 2.0, 4.0, 6.0, 8.0, 10.0, 12.0)]
    # the first report, then quiet ones while the window fills (its length is the noise judged by)
    assert news == [True, True, True, True, False, False, False]   # full at 8 s: reports since -2 s
    assert _report(w, 14.0, requests=30)            # traffic
    # quiet again: news until the traffic's counts have left the window
    news = [_report(w, t) for t in (16.0, 18.0, 20.0, 22.0, 24.0, 26.0)]
    assert news[0] and news[-1] is False
    # a new model reported is news; another frontend is judged on its own
    assert w.report(control.WorkloadReport(node_id="fe", rates=[control.SessionRate(model="m", window_ms=2000),
                                                                control.SessionRate(model="n", window_ms=2000)]), 28.0)
    assert _report(w, 28.0, node="fe-2")
    w.forget("fe")
    assert _report(w, 30.0)
