"""Configuration round trips, address parsing, and the cluster token checked by a real grpc.aio server."""

from __future__ import annotations

import argparse
import asyncio
import os
import stat

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import grpc_util
from common.config import (BackendConfig, BatchStart, ConfigError, FrontendConfig, SchedulerConfig, SecurityConfig,
                           add_arguments, from_args, join_host_port, split_host_port, to_argv)
from common.health import LIVENESS, Health
from common.pb import control, control_grpc
from common.security import Credentials, SecurityError, ensure_token_file, read_token


def _parse(cls, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return from_args(cls, parser.parse_args(argv))


@pytest.mark.parametrize("config", [
    SchedulerConfig(listen="0.0.0.0:8100", epoch_s=3.0, security=SecurityConfig(token_file=__file__)),
    BackendConfig(device="emulated:gtx1080ti", threads=2, batch_start=BatchStart.DUTY_CYCLE, prefix_batching=False,
                  advertise="[fd00::2]:9000", drain_grace_s=3.0),
    FrontendConfig(listen="[::]:8001", advertise="10.0.0.3:8001", exec_path="unary"),
    FrontendConfig(),
])
def test_to_argv_rebuilds_the_same_config(config):
    argv = to_argv(config)
    assert _parse(type(config), argv) == config
    assert to_argv(type(config)()) == []        # defaults need no flags


def test_security_flags_are_flat_and_nested_in_the_config(tmp_path):
    token = tmp_path / "token"
    token.write_text("abc\n")
    config = _parse(BackendConfig, ["--token-file", str(token)])
    assert config.security == SecurityConfig(token_file=str(token))
    assert Credentials.load(config.security, environ={}).token == "abc"


@pytest.mark.parametrize("value, expected", [
    ("127.0.0.1:80", ("127.0.0.1", 80)), ("[::1]:9000", ("::1", 9000)), ("[::]:0", ("::", 0)),
    ("node-3.svc:8001", ("node-3.svc", 8001)),
])
def test_split_host_port(value, expected):
    assert split_host_port(value) == expected
    assert join_host_port(*expected) == value


@pytest.mark.parametrize("value, message", [
    ("localhost", "expected HOST:PORT"), (":80", "expected HOST:PORT"), ("h:99999", "expected HOST:PORT"),
    ("::1:80", "needs brackets"), ("[::1:80", "expected"),
])
def test_split_host_port_refuses_malformed_addresses(value, message):
    with pytest.raises(ValueError, match=message):
        split_host_port(value)


@pytest.mark.parametrize("cls, argv, message", [
    (BackendConfig, ["--advertise", "0.0.0.0:9000"], "--advertise: peers cannot dial"),
    (FrontendConfig, ["--advertise", "[::]:8001"], "--advertise: peers cannot dial"),
    (FrontendConfig, ["--advertise", "10.0.0.1:0"], "--advertise: peers cannot dial"),
    (BackendConfig, ["--advertise", "nohost"], "--advertise: expected HOST:PORT"),
    (BackendConfig, ["--tls-cert", __file__], "--tls-cert and --tls-key go together"),
    (SchedulerConfig, ["--tls-ca", "/no/such/ca.pem"], "--tls-ca: no such file"),
    (FrontendConfig, ["--drain-grace-s", "0"], "--drain-grace-s: must be positive"),
])
def test_bad_flags_name_the_flag(cls, argv, message):
    with pytest.raises(ConfigError, match=message):
        _parse(cls, argv)


def test_token_file_is_created_private_and_kept(tmp_path):
    path = tmp_path / "data" / "token"
    first = ensure_token_file(path)
    assert len(first) >= 32
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ensure_token_file(path) == first


def test_empty_or_unreadable_token_files_are_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(SecurityError, match="the file is empty"):
        read_token(empty)
    with pytest.raises(SecurityError, match="--token-file"):
        read_token(tmp_path / "missing")


def test_a_token_file_that_is_no_regular_file_gets_a_precise_error(tmp_path):
    """/dev/null exists and reads empty; a folder is no file: neither is "no such file"."""
    from nexus.client_flags import ClientFlagError, client_credentials

    for path, message in (("/dev/null", "--token-file /dev/null: the file is empty"),
                          (str(tmp_path), f"--token-file: '{tmp_path}' is a directory, not a file"),
                          (str(tmp_path / "absent"), "--token-file: no such file")):
        args = argparse.Namespace(tls_ca="", token_file=path, scheduler="127.0.0.1:8100")
        with pytest.raises(ClientFlagError) as refused:
            client_credentials(args)
        assert message in str(refused.value)


def test_token_comes_from_the_environment_when_no_file_is_given():
    assert Credentials.load(SecurityConfig(), environ={"NEXUS_TOKEN": " t0k \n"}).token == "t0k"
    assert Credentials.load(SecurityConfig(), environ={}).token is None
    assert "t0k" not in repr(Credentials(token="t0k"))


class _Scheduler(control_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def ListModels(self, request, context):
        self.calls += 1
        return control.ListModelsReply()

    async def DownloadModel(self, request, context):
        self.calls += 1
        yield control.DownloadChunk(data=b"x")


def test_token_guard_refuses_missing_and_wrong_tokens_and_leaves_health_open():
    async def main():
        servicer = _Scheduler()
        server = grpc_util.server(Credentials(token="right"))
        control_grpc.add_SchedulerServicer_to_server(servicer, server)
        health = await Health.attach(server)
        address = grpc_util.bind(server, "127.0.0.1:0")
        await server.start()
        outcomes = {}
        try:
            for label, token in (("missing", None), ("wrong", "nope"), ("right", "right")):
                async with grpc_util.aio_channel(address, Credentials(token=token)) as ch:
                    stub = control_grpc.SchedulerStub(ch)
                    try:
                        await stub.ListModels(control.ListModelsRequest(), timeout=5)
                        chunks = [c async for c in stub.DownloadModel(control.DownloadRequest(), timeout=5)]
                        outcomes[label] = ("OK", len(chunks))
                    except grpc.aio.AioRpcError as exc:
                        outcomes[label] = (exc.code().name, exc.details())
            async with grpc_util.aio_channel(address) as ch:
                check = health_pb2_grpc.HealthStub(ch).Check
                before = (await check(health_pb2.HealthCheckRequest(service=""))).status
                await health.set_ready(True)
                after = (await check(health_pb2.HealthCheckRequest(service=""))).status
                await health.start_draining()
                draining = (await check(health_pb2.HealthCheckRequest(service=""))).status
                live = (await check(health_pb2.HealthCheckRequest(service=LIVENESS))).status
        finally:
            await server.stop(0)
        return servicer.calls, outcomes, (before, after, draining, live)

    calls, outcomes, statuses = asyncio.run(main())
    assert outcomes["missing"][0] == "UNAUTHENTICATED" and outcomes["missing"][1].startswith("missing cluster token")
    assert outcomes["wrong"][0] == "UNAUTHENTICATED" and outcomes["wrong"][1].startswith("wrong cluster token")
    assert outcomes["right"] == ("OK", 1)
    assert calls == 2                       # the refused calls never reached the handlers
    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert statuses == (N, S, N, S)
