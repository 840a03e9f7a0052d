"""Leader and standby on a real PostgreSQL server: schedulers sharing one database, exactly one leads,
the standby refuses with the leader's address, takes over when the leader is killed or paused, and a
paused leader that wakes up exits without pushing a table (the fence)."""

from __future__ import annotations

import time

import grpc
import pytest

from common.pb import control, control_grpc
from globalsched.database.lease import PLAN_EPOCHS_PER_LEASE, LeaderLease, plan_epoch_base
from tests.conftest import NexusProcess, nexus_cli


def _scheduler(tmp_path, name: str, url: str, lease_s: float = 1.5) -> NexusProcess:
    return NexusProcess(tmp_path / f"{name}.log", "scheduler", "--listen", "127.0.0.1:0", "--database", url,
                        "--data-dir", str(tmp_path / name), "--metrics-listen", "", "--leader-lease-s", str(lease_s))


def _role(p: NexusProcess) -> str:
    return p.info.get("role", "")


def _list_models(address: str) -> tuple[str, str, dict]:
    """(status code name, details, trailing metadata) of ListModels at ``address``."""
    with grpc.insecure_channel(address) as channel:
        try:
            control_grpc.SchedulerStub(channel).ListModels(control.ListModelsRequest(), timeout=5)
            return "OK", "", {}
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or "", dict(exc.trailing_metadata() or ())


def _wait_leads(address: str, timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if _list_models(address)[0] == "OK":
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{address} did not lead within {timeout_s} s")


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


@pytest.mark.slow
def test_one_leads_the_standby_names_it_and_takes_over_when_it_is_killed(pg_url, tmp_path):
    first = _scheduler(tmp_path, "one", pg_url)
    second = _scheduler(tmp_path, "two", pg_url)
    try:
        assert {_role(first), _role(second)} == {"leader", "standby"}
        leader, standby = (first, second) if _role(first) == "leader" else (second, first)
        _wait_leads(leader.address)
        code, details, metadata = _list_models(standby.address)
        assert code == "UNAVAILABLE" and details == f"this scheduler is a standby; the leader is {leader.address}"
        assert metadata.get("nexus-leader") == leader.address
        refused = nexus_cli("models", "list", "--scheduler", standby.address)
        assert refused.returncode != 0 and "standby; the leader is" in refused.stderr
        leader.kill()
        took_s = _wait_leads(standby.address)
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
        _wait_leads(leader.address)
        leader.pause()
        took_s = _wait_leads(standby.address)
        print(f"takeover after SIGSTOP: {took_s:.2f} s")
        leader.resume()
        assert leader.proc.wait(timeout=30) == 3
        log = leader.logs()
        assert "lost the leadership (lease epoch 1)" in log
        assert "re-planned" not in log.split("lost the leadership")[-1]
        assert _list_models(standby.address)[0] == "OK"
    finally:
        first.stop()
        second.stop()


@pytest.mark.slow
def test_a_cleanly_stopped_leader_hands_over_at_once(pg_url, tmp_path):
    first = _scheduler(tmp_path, "one", pg_url, lease_s=30)
    second = _scheduler(tmp_path, "two", pg_url, lease_s=30)
    try:
        leader, standby = (first, second) if _role(first) == "leader" else (second, first)
        _wait_leads(leader.address)
        assert leader.stop() == 0
        _wait_leads(standby.address, timeout_s=10)      # well inside the 30 s lease: it was released
        assert "released the lease" in leader.logs()
    finally:
        first.stop()
        second.stop()
