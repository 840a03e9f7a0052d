"""``--leader-election kubernetes``: the scheduler's Lease client against a stand-in for the API server's
Lease endpoints over HTTPS (tests/kube_lease_server.py: tokens, 404/409, resourceVersion), with the
database fencing each term; then two real schedulers electing through it."""

from __future__ import annotations

import pytest

from common.config import ConfigError, SchedulerConfig
from globalsched.leadership.kube_lease import LEASE_NAME, KubeApi, KubeApiError, KubeConflict, KubernetesLease
from harness.cluster import Node
from tests.certs import make_pki
from tests.components import wait_leads
from tests.conftest import nexus_cli
from tests.kube_lease_server import LeaseServer

TOKEN = "service-account-token"


@pytest.fixture
def api_server(tmp_path):
    pki = make_pki(tmp_path / "pki")
    server = LeaseServer(str(pki.cert), str(pki.key), TOKEN)
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(TOKEN)
    (sa / "namespace").write_text("nexus")
    (sa / "ca.crt").write_bytes(pki.ca.read_bytes())
    server.env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(server.port),
                  "NEXUS_KUBE_SERVICEACCOUNT_DIR": str(sa)}
    yield server
    server.stop()


def _api(server, monkeypatch) -> KubeApi:
    for k, v in server.env.items():
        monkeypatch.setenv(k, v)
    return KubeApi.in_cluster()


def test_one_candidate_holds_the_lease_and_the_next_takes_it_when_it_lapses(api_server, pg_url, monkeypatch):
    now = [0.0]
    clock = lambda: now[0]          # noqa: E731  (the candidates' observation clock, driven here)
    a = KubernetesLease(pg_url, "a", "a:8100", 1.0, _api(api_server, monkeypatch), clock=clock)
    b = KubernetesLease(pg_url, "b", "b:8100", 1.0, _api(api_server, monkeypatch), clock=clock)
    try:
        assert a.try_acquire() == 1 and a.holds()
        assert b.try_acquire() is None                      # held: b observes it now
        holder = b.current()
        assert (holder.holder, holder.address, holder.expired) == ("a", "a:8100", False)
        now[0] = 0.5
        assert a.renew()
        now[0] = 1.2                                        # b sees a's renewal now: held for another second
        assert b.try_acquire() is None
        now[0] = 2.5                                        # no renewal seen for 1.3 s: lapsed
        assert not a.holds()
        assert b.try_acquire() == 2 and b.holds()
        lease = api_server.leases[("nexus", LEASE_NAME)]
        assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
        assert not a.renew() and not a.holds()              # the old leader's term is over
        b.release()
        c = KubernetesLease(pg_url, "c", "c:8100", 1.0, _api(api_server, monkeypatch), clock=clock)
        assert c.try_acquire() == 3                         # released: no wait
        c.close()
    finally:
        a.close()
        b.close()


def test_a_stale_write_is_refused_and_the_api_errors_say_why(api_server, pg_url, monkeypatch):
    api = _api(api_server, monkeypatch)
    lease = KubernetesLease(pg_url, "a", "a:8100", 1.0, api)
    try:
        assert lease.try_acquire() == 1
        stale = api.get_lease()
        assert lease.renew()                                # bumps the resourceVersion
        with pytest.raises(KubeConflict):
            api.replace_lease(stale)
    finally:
        lease.close()
    wrong = KubeApi(api.server, "not-the-token", "nexus", api.context and str(
        api_server.env["NEXUS_KUBE_SERVICEACCOUNT_DIR"] + "/ca.crt"))
    with pytest.raises(KubeApiError, match="HTTP 401"):
        wrong.get_lease()
    gone = KubeApi("https://127.0.0.1:1", TOKEN, "nexus", None)
    with pytest.raises(KubeApiError, match="cannot reach the API server https://127.0.0.1:1"):
        gone.get_lease()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(KubeApiError, match="not in a Kubernetes pod"):
        KubeApi.in_cluster()
    with pytest.raises(ConfigError, match="--leader-election kubernetes: needs --database"):
        SchedulerConfig(leader_election="kubernetes").validate()


@pytest.mark.slow
def test_two_schedulers_elect_through_a_kubernetes_lease_and_the_standby_takes_over(api_server, pg_url, tmp_path):
    argv = ["scheduler", "--listen", "127.0.0.1:0", "--database", pg_url, "--leader-election", "kubernetes",
            "--leader-lease-s", "1", "--metrics-listen", ""]
    nodes = [Node(name, [*argv, "--data-dir", str(tmp_path / name)], env={**api_server.env, "NEXUS_LOG": "INFO"},
                  log_path=tmp_path / f"{name}.log") for name in ("one", "two")]
    try:
        for n in nodes:
            n.wait_ready(60)
        roles = {n.info.get("role") for n in nodes}
        assert roles == {"leader", "standby"}
        leader, standby = nodes if nodes[0].info["role"] == "leader" else nodes[::-1]
        assert api_server.leases[("nexus", LEASE_NAME)]["metadata"]["annotations"][
            "nexus.serving/leader-address"] == leader.address
        leader.kill()
        took_s = wait_leads(standby.address)
        assert "leads, lease epoch 2" in standby.logs()
        print(f"takeover through the Kubernetes Lease: {took_s:.2f} s")
    finally:
        for n in nodes:
            n.stop()
    outside = nexus_cli("scheduler", "--listen", "127.0.0.1:0", "--database", pg_url, "--leader-election",
                        "kubernetes", "--data-dir", str(tmp_path / "outside"), "--metrics-listen", "", timeout_s=60)
    assert outside.returncode != 0 and "not in a Kubernetes pod" in outside.stderr
