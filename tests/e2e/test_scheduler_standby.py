"""Leader and standby on a real PostgreSQL server: schedulers sharing one database, exactly one leads,
the standby refuses with the leader's address, takes over when the leader is killed or paused, and a
paused leader that wakes up exits without pushing a table (the fence)."""

from __future__ import annotations

import json
import time

import pytest

from common.config import BackendConfig, ConfigError, FrontendConfig, SchedulerConfig, scheduler_addresses
from common.scheduler_connection import next_scheduler
from globalsched.planning.algorithms.replan import ReplanState
from globalsched.planning.plan_device_type import TypeState
from globalsched.planning.planner import PlannerState, adopted_state
from globalsched.planning.scaling_policy import ScalingState, TypeHistory
from globalsched.state.database.connection import PostgresConnection
from globalsched.state.database.lease import PLAN_EPOCHS_PER_LEASE, LeaderLease, plan_epoch_base
from globalsched.state.database.plan_store import PlanStore
from harness.cluster import Cluster, Node
from harness.ports import free_port
from tests.components import list_models_status, wait_for, wait_leads
from tests.e2e.load_under_faults import DEVICE, FAST, FAST_SLO_MS, ok_in_a_row_since, steady_load, upload
from tests.conftest import NexusProcess, nexus_cli


def _argv(tmp_path, name: str, url: str, lease_s: float = 1.5) -> list[str]:
    return ["scheduler", "--listen", "127.0.0.1:0", "--database", url, "--data-dir", str(tmp_path / name),
            "--metrics-listen", "", "--leader-lease-s", str(lease_s)]


def _scheduler(tmp_path, name: str, url: str, lease_s: float = 1.5) -> NexusProcess:
    return NexusProcess(tmp_path / f"{name}.log", *_argv(tmp_path, name, url, lease_s))


def _role(p: NexusProcess) -> str:
    return p.info.get("role", "")


def _standby_refusal(address: str, timeout_s: float = 10.0) -> tuple[str, str, dict]:
    """:func:`list_models_status` at a standby once it has read the lease's holder: it polls the lease every
    0.2 s, and until its first read finds the leader's row it says the leader is not known yet."""
    start = time.monotonic()
    while True:
        refusal = list_models_status(address)
        if "not known yet" not in refusal[1] or time.monotonic() - start > timeout_s:
            return refusal
        time.sleep(0.05)


def test_lease_epochs_fence_plan_epochs(pg_url):
    a = LeaderLease(pg_url, "a", "a:1", ttl_s=30)
    b = LeaderLease(pg_url, "b", "b:1", ttl_s=30)
    try:
        assert a.try_acquire() == 1 and a.holds()
        assert b.try_acquire() is None                  # held and alive: not free
        assert b.current().address == "a:1" and not b.current().expired
        assert a.renew()
        a.release()
        assert not a.holds()
        assert b.try_acquire() == 2 and b.holds()
        a.epoch = 1                                      # the old leader renews its stale term: refused
        assert not a.renew() and not a.holds()
        assert plan_epoch_base(2) > plan_epoch_base(1) + int(time.time() * 1000)
        assert PLAN_EPOCHS_PER_LEASE > int(time.time() * 1000) * 5
    finally:
        a.close()
        b.close()


def test_nodes_follow_the_named_leader_within_their_list_else_the_next_address():
    addresses = ("a:1", "b:1", "c:1")
    assert next_scheduler(addresses, "a:1", "c:1") == "c:1"           # the standby named the leader
    assert next_scheduler(addresses, "a:1", "") == "b:1"              # unreachable: the next one
    assert next_scheduler(addresses, "c:1", "") == "a:1"
    assert next_scheduler(addresses, "a:1", "evil:1") == "b:1"        # never an address not given
    assert next_scheduler(addresses, "a:1", "a:1") == "b:1"
    assert next_scheduler(("a:1",), "a:1", "b:1") == "a:1"
    assert scheduler_addresses(" a:1, b:1 ,") == ("a:1", "b:1")
    assert BackendConfig(scheduler="a:1,b:2").validate() is None
    with pytest.raises(ConfigError, match="--scheduler"):
        BackendConfig(scheduler="a:1,nonsense").validate()
    with pytest.raises(ConfigError, match="--scheduler: give HOST:PORT"):
        FrontendConfig(scheduler=" , ").validate()


def test_a_shared_scheduler_needs_an_address_the_others_can_dial_and_a_positive_lease():
    url = "postgresql://nexus@db:5432/nexus"
    with pytest.raises(ConfigError, match="--advertise: with --database, .* give --advertise HOST:PORT"):
        SchedulerConfig(listen="0.0.0.0:8100", database=url).validate()
    SchedulerConfig(listen="0.0.0.0:8100", database=url, advertise="10.0.0.5:8100").validate()
    SchedulerConfig(listen="0.0.0.0:8100").validate()                 # one scheduler: no one to send there
    with pytest.raises(ConfigError, match="--leader-lease-s"):
        SchedulerConfig(database=url, leader_lease_s=0).validate()


def test_an_adopted_plan_starts_its_cooldowns_again(pg_url):
    old = PlannerState(last_plan_s=5.0, first_requests_s={"m": 1.0}, surge_floors={"m": (40.0, 4.0)},
                       drop_ceilings={"q": (3.0, 4.5)}, types={"t4": TypeState(replan=ReplanState(last_replan_s=5.0, moved_at_s=(("m", 3.0),)))})
    new = adopted_state(old, 1000.0)
    assert new.last_plan_s == 1000.0 and new.first_requests_s == {"m": 1000.0}
    assert new.surge_floors == {"m": (40.0, 1000.0)} and new.drop_ceilings == {"q": (3.0, 1000.0)}
    assert new.types["t4"].replan.last_replan_s == 1000.0 and new.types["t4"].replan.moved_at_s == (("m", 1000.0),)
    assert adopted_state(PlannerState(), 7.0) == PlannerState()
    # the store: fenced by the lease epoch
    lease = LeaderLease(pg_url, "a", "a:1", ttl_s=30)
    store = PlanStore(PostgresConnection(pg_url))
    try:
        assert store.load() is None
        assert not store.save(old, 1)                   # nobody holds epoch 1 yet
        assert lease.try_acquire() == 1
        assert store.save(old, 1) and store.load() == old
        assert not store.save(PlannerState(), 2) and store.load() == old      # not the lease's epoch
        store.db.execute("UPDATE plan_in_force SET release = 'another'")
        assert store.load() is None                     # another release's: planned afresh
        store.db.execute("UPDATE plan_in_force SET release = ?, state = ?", (store.release, b"not a pickle"))
        assert store.load() is None                     # unreadable: planned afresh
        # the scaling history: on the reader's clock, as much time ago as it was on the writer's
        history = ScalingState({"t4": TypeHistory(needs=((95.0, 3), (99.0, 2)), last_down_s=90.0, desired=3)})
        assert store.save_scaling(history, 1, 100.0) and not store.save_scaling(history, 2, 100.0)
        moved = store.load_scaling(5000.0)
        assert moved.types["t4"].desired == 3
        assert [n for _, n in moved.types["t4"].needs] == [3, 2]
        assert moved.types["t4"].needs[0][0] == pytest.approx(4995.0, abs=1.0)
        assert moved.types["t4"].last_down_s == pytest.approx(4990.0, abs=1.0)
    finally:
        lease.close()
        store.db.close()


@pytest.mark.slow
def test_one_leads_the_standby_names_it_and_takes_over_when_it_is_killed(pg_url, tmp_path):
    first, second = [Node(name, _argv(tmp_path, name, pg_url), env={"NEXUS_LOG": "INFO"},     # started at once
                          log_path=tmp_path / f"{name}.log") for name in ("one", "two")]
    try:
        first.wait_ready(60)
        second.wait_ready(60)
        assert {_role(first), _role(second)} == {"leader", "standby"}
        leader, standby = (first, second) if _role(first) == "leader" else (second, first)
        wait_leads(leader.address)
        code, details, metadata = _standby_refusal(standby.address)
        assert code == "UNAVAILABLE" and details == f"this scheduler is a standby; the leader is {leader.address}"
        assert metadata.get("nexus-leader") == leader.address
        refused = nexus_cli("models", "list", "--scheduler", standby.address)
        assert refused.returncode != 0
        assert f"{standby.address}: this scheduler is a standby; the leader is {leader.address}" in refused.stderr
        assert "no scheduler took" not in refused.stderr       # a leader outside the list: asking again is no use
        status = nexus_cli("status", "--json", "--scheduler", f"{standby.address},{leader.address}")
        assert status.returncode == 0 and json.loads(status.stdout)["leader"] == leader.address, status.stderr
        leader.kill()
        took_s = wait_leads(standby.address)
        assert "leads, lease epoch 2" in standby.logs()
        print(f"takeover after kill -9: {took_s:.2f} s")
    finally:
        first.stop()
        second.stop()


@pytest.mark.slow
def test_a_paused_leader_is_replaced_and_exits_when_it_wakes(pg_url, tmp_path):
    first = _scheduler(tmp_path, "one", pg_url, lease_s=1.0)
    second = _scheduler(tmp_path, "two", pg_url, lease_s=1.0)
    try:
        leader, standby = (first, second) if _role(first) == "leader" else (second, first)
        wait_leads(leader.address)
        leader.pause()
        took_s = wait_leads(standby.address)
        print(f"takeover after SIGSTOP: {took_s:.2f} s")
        leader.resume()
        assert leader.proc.wait(timeout=30) == 3
        log = leader.logs()
        assert "lost the leadership (lease epoch 1)" in log
        assert "re-planned" not in log.split("lost the leadership")[-1]
        assert list_models_status(standby.address)[0] == "OK"
    finally:
        first.stop()
        second.stop()


@pytest.mark.slow
def test_a_cleanly_stopped_leader_hands_over_at_once(pg_url, tmp_path):
    first = _scheduler(tmp_path, "one", pg_url, lease_s=30)
    second = _scheduler(tmp_path, "two", pg_url, lease_s=30)
    try:
        leader, standby = (first, second) if _role(first) == "leader" else (second, first)
        wait_leads(leader.address)
        assert leader.stop() == 0
        wait_leads(standby.address, timeout_s=10)      # well inside the 30 s lease: it was released
        assert "released the lease" in leader.logs()
    finally:
        first.stop()
        second.stop()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_losing_the_leader_under_load_fails_nothing_moves_nothing_and_the_next_upload_succeeds(pg_url, tmp_path,
                                                                                             fault):
    """Backends and the frontend are given both schedulers, the standby first: they follow the leader.
    The leader is killed (kill -9), or paused for 10 s and then resumed: the standby adopts the plan in
    force (no session moves, no request fails), and a resumed old leader exits without pushing."""

    a, b = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    both = f"{b},{a}"
    cluster = Cluster(tmp_path / "cluster", backends=2, device=DEVICE,
                      scheduler={"listen": a, "database": pg_url, "spare_replicas": False, "metrics_listen": "",
                                 "device_headroom": 0.0},   # desired = the plan's 2 devices, as adopted below
                      backend={"scheduler": both}, frontend={"scheduler": both, "report_interval_s": 0.5}).start()
    standby = None
    try:
        standby = NexusProcess(tmp_path / "standby.log", "scheduler", "--listen", b, "--database", pg_url,
                               "--data-dir", str(tmp_path / "standby"), "--metrics-listen", "",
                               "--no-spare-replicas", "--device-headroom", "0")
        assert _role(standby) == "standby"
        cluster.scheduler.address = both                      # admin calls follow the leader too
        upload(cluster, tmp_path, "steady", FAST, FAST_SLO_MS, "--min-replicas", "2")
        # Ready means one replica answers; the second may still be loading its session.
        wait_for(lambda: len(cluster.serving("steady")) == 2, what="both replicas loaded")
        serving = {n.name for n in cluster.serving("steady")}
        load = steady_load(cluster, "steady", 50)
        wait_for(lambda: ok_in_a_row_since(load, 0.0), what="the load answered")
        old = cluster.scheduler
        old.kill() if fault == "kill" else old.pause()
        paused_at = time.monotonic()
        took_s = wait_leads(b)
        print(f"takeover under load after {fault}: {took_s:.2f} s")
        upload(cluster, tmp_path, "after", FAST, FAST_SLO_MS)          # through "b,a": the new leader
        time.sleep(8.0)                  # the new leader plans with its own rate reports meanwhile
        if fault == "pause":
            time.sleep(max(10.0 - (time.monotonic() - paused_at), 0.0))
            old.resume()
            assert old.proc.wait(timeout=30) == 3
            woke = old.logs().split("lost the leadership")[-1]
            assert "re-planned" not in woke and "push" not in woke, woke
        since = time.monotonic()
        wait_for(lambda: ok_in_a_row_since(load, since), what="25 requests after the takeover answered OK")
        codes = load.stop().samples.status_counts()
        print("takeover:", codes)
        assert set(codes) == {"OK"}, codes
        log = standby.logs()
        assert "adopted the plan in force: 2 backends" in log and "every backend registered again" in log, log[-3000:]
        assert "adopted the scaling history: gtx1080ti desired 2" in log, log[-3000:]
        assert {n.name for n in cluster.serving("steady")} == serving        # nothing moved
    finally:
        if standby is not None:
            standby.stop()
        cluster.stop()


def test_every_scheduler_of_a_cluster_must_hold_its_token_and_a_rotation_forgets_it(pg_url, tmp_path):
    a, b = tmp_path / "a.token", tmp_path / "b.token"
    a.write_text("a" * 64 + "\n")
    b.write_text("b" * 64 + "\n")
    first = NexusProcess(tmp_path / "first.log", "scheduler", "--listen", "127.0.0.1:0", "--database", pg_url,
                         "--data-dir", str(tmp_path / "first"), "--metrics-listen", "", "--token-file", str(a))
    try:
        for extra, has in ((["--token-file", str(b)], "a token with fingerprint"), ([], "has no token")):
            proc = nexus_cli("scheduler", "--listen", "127.0.0.1:0", "--database", pg_url, "--metrics-listen", "",
                             "--data-dir", str(tmp_path / "other"), *extra, timeout_s=60)
            assert proc.returncode != 0 and "NEXUS-READY" not in proc.stdout
            assert has in proc.stderr and "give every scheduler the same --token-file" in proc.stderr, proc.stderr
            assert "a" * 64 not in proc.stderr and "b" * 64 not in proc.stderr
    finally:
        first.stop()
    forgot = nexus_cli("db", "forget-token", "--database", pg_url)
    assert forgot.returncode == 0 and "forgot the cluster token's fingerprint" in forgot.stdout
    rotated = NexusProcess(tmp_path / "rotated.log", "scheduler", "--listen", "127.0.0.1:0", "--database", pg_url,
                           "--data-dir", str(tmp_path / "rotated"), "--metrics-listen", "", "--token-file", str(b))
    rotated.stop()
    bad = nexus_cli("db", "forget-token", "--database", "postgresql://u:pw@h/d")
    assert bad.returncode == 2 and "carries a password" in bad.stderr
    gone = nexus_cli("db", "forget-token", "--database", "postgresql://nexus@127.0.0.1:1/nexus")
    assert gone.returncode == 1 and "cannot reach the database postgresql://nexus@127.0.0.1:1/nexus" in gone.stderr
