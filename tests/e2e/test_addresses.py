"""Addresses across hosts: a node listening on a wildcard address is registered at the address the
scheduler sees it call from (IPv4 and IPv6), --advertise overrides it, identity is a generated id,
and a node the scheduler cannot dial back gets a clear error at registration."""

from __future__ import annotations

import os
import subprocess
import time

import grpc
import pytest

from common.config import BackendConfig, SchedulerConfig
from common.pb import control, control_grpc
from globalsched.state.membership import advertised_address, peer_host
from nexus.launcher import launch


@pytest.mark.parametrize("peer, host", [
    ("ipv4:10.1.2.3:41234", "10.1.2.3"),
    ("ipv6:[fd00::7]:41234", "fd00::7"),
    ("ipv6:%5Bfd00::7%5D:41234", "fd00::7"),
    ("ipv6:[::ffff:10.1.2.3]:5000", "10.1.2.3"),
])
def test_peer_host(peer, host):
    assert peer_host(peer) == host


def test_peer_without_an_address_is_refused():
    with pytest.raises(ValueError, match="cannot tell the address"):
        peer_host("unix:/tmp/sock")


@pytest.mark.parametrize("address, peer, expected", [
    ("0.0.0.0:9000", "ipv4:10.1.2.3:41234", "10.1.2.3:9000"),
    ("[::]:9000", "ipv6:[fd00::7]:41234", "[fd00::7]:9000"),
    ("[::]:9000", "ipv4:10.1.2.3:41234", "10.1.2.3:9000"),
    ("10.9.9.9:9000", "ipv4:10.1.2.3:41234", "10.9.9.9:9000"),     # an explicit host (or --advertise) stands
    ("[fd00::9]:9000", "ipv4:10.1.2.3:41234", "[fd00::9]:9000"),
])
def test_advertised_address(address, peer, expected):
    assert advertised_address(address, peer) == expected


@pytest.mark.parametrize("address, match", [("nohost", "HOST:PORT"), ("fd00::1:9000", "brackets"),
                                            ("10.0.0.1:0", "no port")])
def test_bad_advertised_address(address, match):
    with pytest.raises(ValueError, match=match):
        advertised_address(address, "ipv4:10.1.2.3:41234")


def _env() -> dict:
    return dict(os.environ, NEXUS_LOG="INFO")


@pytest.fixture
def scheduler(tmp_path):
    child = launch(SchedulerConfig(listen="[::]:0", data_dir=tmp_path / "db"), env=_env(),
                   stderr=subprocess.DEVNULL)
    child.wait_ready(60)
    yield child.address.rpartition(":")[2]
    child.stop()


def _registered_line(log_path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text().splitlines():
            if "registered as" in line or "registration refused" in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no registration line in {log_path.read_text()}")


@pytest.mark.slow
@pytest.mark.parametrize("scheduler_host, listen, seen_as", [
    ("127.0.0.1", "0.0.0.0:0", "127.0.0.1"),
    ("[::1]", "[::]:0", "[::1]"),
])
def test_a_wildcard_listener_is_registered_where_the_scheduler_sees_it(tmp_path, scheduler, scheduler_host,
                                                                      listen, seen_as):
    log_path = tmp_path / "backend.log"
    with open(log_path, "w") as log:
        backend = launch(BackendConfig(scheduler=f"{scheduler_host}:{scheduler}", listen=listen, device="emulated:t4"),
                         env=_env(), stderr=log)
        try:
            port = backend.wait_ready(60).rpartition(":")[2]
            line = _registered_line(log_path)
        finally:
            backend.stop()
    assert f"peers reach it at {seen_as}:{port}" in line
    node_id = line.split("registered as ")[1].split(";")[0]
    assert node_id.startswith("be-") and port not in node_id and "0.0.0.0" not in node_id


@pytest.mark.slow
def test_a_node_the_scheduler_cannot_reach_gets_a_clear_error(tmp_path, scheduler):
    log_path = tmp_path / "backend.log"
    with open(log_path, "w") as log:
        backend = launch(BackendConfig(scheduler=f"127.0.0.1:{scheduler}", listen="127.0.0.1:0",
                                       advertise="127.0.0.1:1", device="emulated:t4"), env=_env(), stderr=log)
        try:
            backend.wait_ready(60)
            line = _registered_line(log_path)
            assert backend.running()
        finally:
            backend.stop()
    assert "ERROR registration refused: the scheduler cannot reach this backend at 127.0.0.1:1" in line
    assert "--advertise" in line


@pytest.mark.slow
def test_register_rpc_answers_failed_precondition_naming_the_address(scheduler):
    with grpc.insecure_channel(f"127.0.0.1:{scheduler}") as channel:
        stub = control_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(control.RegisterRequest(kind=control.NODE_KIND_BACKEND, address="0.0.0.0:1"), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "127.0.0.1:1" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(control.RegisterRequest(kind=control.NODE_KIND_BACKEND, address="fd00::1:9"), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # leaving when unknown (never registered, or left already) is a no-op
        assert stub.Leave(control.LeaveRequest(node_id="be-unknown"), timeout=10).sessions_moved == 0
        # the scheduler is unharmed
        assert stub.ListModels(control.ListModelsRequest(), timeout=10).models == []

