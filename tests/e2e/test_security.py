"""TLS, mutual TLS, the cluster token and Triton's restricted repository header, on real processes.

Certificates are made at test time with openssl (tests/certs.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import stat
import subprocess
import sys

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from common import grpc_util
from common.config import ConfigError, FrontendConfig
from common.exec_frames import HEADER, FrameKind, hello
from common.pb import control, control_grpc, kserve, kserve_grpc
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.security import Credentials, ProtocolAccess, parse_restricted_header
from frontend.frontend_state import FrontendState
from frontend.kserve import KServeService
from tests.certs import make_pki
from tests.components import wait_for
from tests.conftest import NexusProcess as Proc, nexus_cli, start_serve


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def rogue_pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("rogue-pki"), name="rogue")


# ---- mutual TLS, in process ------------------------------------------------------------------------


def test_mutual_tls_port_takes_only_peers_with_a_certificate_from_the_ca(pki, rogue_pki):
    node = Credentials.load(_security(pki))
    rogue = Credentials.load(_security(rogue_pki))

    async def main():
        server = grpc_util.server(node)
        control_grpc.add_BackendServicer_to_server(_Stats(), server)
        address = grpc_util.bind(server, "127.0.0.1:0", node, require_client_cert=True)
        await server.start()
        outcomes = {}
        try:
            for label, creds in (("peer", node), ("ca only", Credentials(ca=node.ca)),
                                 ("rogue cert", Credentials(ca=node.ca, cert=rogue.cert, key=rogue.key)),
                                 ("plaintext", Credentials())):
                async with grpc_util.aio_channel(address, creds) as ch:
                    try:
                        await control_grpc.BackendStub(ch).Stats(control.BackendStatsRequest(), timeout=5)
                        outcomes[label] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        outcomes[label] = exc.code().name
        finally:
            await server.stop(0)
        return outcomes

    outcomes = asyncio.run(main())
    assert outcomes == {"peer": "OK", "ca only": "UNAVAILABLE", "rogue cert": "UNAVAILABLE", "plaintext": "UNAVAILABLE"}


def _security(pki):
    from common.config import SecurityConfig
    return SecurityConfig(tls_cert=str(pki.cert), tls_key=str(pki.key), tls_ca=str(pki.ca))


class _Stats(control_grpc.BackendServicer):
    async def Stats(self, request, context):
        return control.BackendStats(node_id="be-test")


# ---- the restricted repository header, in process ---------------------------------------------------


class _Scheduler:
    """Stands in for the scheduler stub behind the frontend's repository calls: counts the unloads."""

    def __init__(self) -> None:
        self.unloads = 0

    async def UnloadModel(self, request, timeout=None):
        self.unloads += 1
        return control.UnloadReply()


def test_restricted_repository_header_like_tritons_restricted_protocol():
    async def main():
        scheduler = _Scheduler()
        access = ProtocolAccess(parse_restricted_header("admin-key=s3cret"))
        server = grpc_util.server()
        kserve_grpc.add_GRPCInferenceServiceServicer_to_server(KServeService(FrontendState(), scheduler, access),
                                                               server)
        address = grpc_util.bind(server, "127.0.0.1:0")
        await server.start()
        outcomes = {}
        try:
            async with grpc_util.aio_channel(address) as ch:
                stub = kserve_grpc.GRPCInferenceServiceStub(ch)
                for label, metadata in (("none", ()), ("wrong", (("triton-grpc-protocol-admin-key", "nope"),)),
                                        ("unprefixed", (("admin-key", "s3cret"),)),
                                        ("right", (("triton-grpc-protocol-admin-key", "s3cret"),))):
                    try:
                        await stub.RepositoryModelUnload(kserve.RepositoryModelUnloadRequest(model_name="m"),
                                                         metadata=metadata, timeout=5)
                        outcomes[label] = "OK"
                    except grpc.aio.AioRpcError as exc:
                        outcomes[label] = (exc.code().name, exc.details())
                live = (await stub.ServerLive(kserve.ServerLiveRequest(), timeout=5)).live   # not restricted
        finally:
            await server.stop(0)
        return outcomes, scheduler.unloads, live

    outcomes, unloads, live = asyncio.run(main())
    assert outcomes["right"] == "OK" and unloads == 1 and live
    for label in ("none", "wrong", "unprefixed"):
        code, details = outcomes[label]
        assert code == "UNAVAILABLE" and "restricted" in details and "triton-grpc-protocol-admin-key" in details


@pytest.mark.parametrize("value, message", [("nokey", "expected KEY=VALUE"), ("=v", "expected KEY=VALUE"),
                                            ("k=", "expected KEY=VALUE"), ("a b=v", "header key .a b.: only letters")])
def test_restricted_header_flag_is_validated(value, message):
    with pytest.raises(ConfigError, match=f"--restricted-repository-header: {message}"):
        FrontendConfig(restricted_repository_header=value).validate()


# ---- a cluster of separate processes over mutual TLS with a token -----------------------------------


@pytest.mark.slow
def test_tls_cluster_with_token_serves_tritonclient_and_refuses_strangers(tmp_path, pki, rogue_pki):
    token = tmp_path / "token"
    token.write_text("the-cluster-token\n")
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    secure = [*pki.flags(), "--token-file", str(token)]
    procs = []
    try:
        scheduler = Proc(tmp_path / "scheduler.log", "scheduler", *secure, "--listen", "127.0.0.1:0",
                         "--data-dir", str(tmp_path / "db"))
        procs.append(scheduler)
        backend = Proc(tmp_path / "backend.log", "backend", *secure, "--scheduler", scheduler.address,
                       "--listen", "127.0.0.1:0", "--threads", "1")
        procs.append(backend)
        frontend = Proc(tmp_path / "frontend.log", "frontend", *secure, "--scheduler", scheduler.address,
                        "--listen", "127.0.0.1:0", "--restricted-repository-header", "admin=s3cret")
        procs.append(frontend)
        # Strangers: a backend with the right certificate but a wrong token, and one with no token.
        rogue = Proc(tmp_path / "rogue.log", "backend", *pki.flags(), "--token-file", str(wrong),
                     "--scheduler", scheduler.address, "--listen", "127.0.0.1:0", "--threads", "1")
        procs.append(rogue)
        tokenless = Proc(tmp_path / "tokenless.log", "backend", *pki.flags(), "--scheduler", scheduler.address,
                         "--listen", "127.0.0.1:0", "--threads", "1", env={"NEXUS_TOKEN": ""})
        procs.append(tokenless)

        model = tmp_path / "mlp.onnx"
        model.write_bytes(model_bytes(mlp_small()))
        profile = tmp_path / "profile.json"
        profile.write_text(Profile.linear(0.2, 1.0, 32, memory_base_mb=5, device_type="cpu").to_json())
        upload = ["models", "upload", str(model), "--name", "mlp", "--profile", str(profile), "--slo-ms", "1000",
                  "--scheduler", scheduler.address, "--tls-ca", str(pki.ca)]
        missing = nexus_cli(*upload)
        assert missing.returncode == 2 and "missing cluster token" in missing.stderr
        refused = nexus_cli(*upload, "--token-file", str(wrong))
        assert refused.returncode == 2 and "wrong cluster token" in refused.stderr
        plaintext = nexus_cli("models", "list", "--scheduler", scheduler.address, "--token-file", str(token))
        assert plaintext.returncode == 2 and "cannot reach the scheduler" in plaintext.stderr
        up = nexus_cli(*upload, "--token-file", str(token))
        assert up.returncode == 0, up.stderr
        listed = nexus_cli("models", "list", "--scheduler", scheduler.address, "--tls-ca", str(pki.ca),
                           "--token-file", str(token))
        assert listed.returncode == 0 and "mlp" in listed.stdout

        client = grpcclient.InferenceServerClient(frontend.address, ssl=True, root_certificates=str(pki.ca))
        wait_for(lambda: _ready(client, "mlp"), timeout_s=90, what="mlp ready over TLS")
        x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
        inp = grpcclient.InferInput("input", [3, 64], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("mlp", [inp])
        assert result.as_numpy(result.get_response().outputs[0].name).shape == (3, 10)
        bench = nexus_cli("bench", "--frontend", frontend.address, "--tls-ca", str(pki.ca), "--model", "mlp",
                          "--rate", "20", "--duration-s", "1", "--slo-ms", "1000", "--json", "--quiet")
        assert bench.returncode == 0 and json.loads(bench.stdout)["ok"] > 0, bench.stderr

        # The frontend reaches the backend on its framed execute channel, over mutual TLS; plain text
        # there, and TLS with another CA's certificate, get no answer.
        assert f"requests to backend {backend.address} go on its framed execute channel" in frontend.logs()
        with grpc_util.channel(backend.address, Credentials(ca=pki.ca.read_bytes(), cert=pki.cert.read_bytes(),
                                                            key=pki.key.read_bytes(), token="the-cluster-token")) as ch:
            exec_port = control_grpc.BackendStub(ch).ExecEndpoint(control.ExecEndpointRequest(), timeout=10).port
        assert exec_port > 0
        assert not _framed_hello_accepted(exec_port, "the-cluster-token", None)
        assert not _framed_hello_accepted(exec_port, "the-cluster-token", _client_tls(pki.ca, rogue_pki))
        assert not _framed_hello_accepted(exec_port, "the-cluster-token", _client_tls(rogue_pki.ca, pki))
        assert _framed_hello_accepted(exec_port, "the-cluster-token", _client_tls(pki.ca, pki))

        # Plain text on the TLS port, and TLS verified against another CA, are refused.
        with pytest.raises(InferenceServerException) as e:
            grpcclient.InferenceServerClient(frontend.address).is_server_live()
        assert "UNAVAILABLE" in str(e.value.status())
        with pytest.raises(InferenceServerException):
            grpcclient.InferenceServerClient(frontend.address, ssl=True,
                                             root_certificates=str(rogue_pki.ca)).is_server_live()

        # Triton's restricted protocol on the repository calls.
        with pytest.raises(InferenceServerException) as e:
            client.unload_model("mlp")
        assert "restricted" in e.value.message() and "triton-grpc-protocol-admin" in e.value.message()
        assert _ready(client, "mlp")

        # The strangers were told why and never joined: the scheduler announced only the real nodes.
        wait_for(lambda: "wrong cluster token" in rogue.logs(), timeout_s=90, what="the rogue backend to be refused")
        wait_for(lambda: "missing cluster token" in tokenless.logs(), timeout_s=90, what="the tokenless backend to be refused")
        joined = scheduler.logs()
        assert f"registered at {backend.address}" in joined and f"registered at {frontend.address}" in joined
        assert rogue.address not in joined and tokenless.address not in joined
        for p in procs:
            assert "Traceback" not in p.logs(), p.log_path
    finally:
        for p in reversed(procs):
            p.stop()


def _client_tls(ca, pki) -> ssl.SSLContext:
    """TLS that trusts ``ca`` and presents ``pki``'s certificate (its SAN names 127.0.0.1)."""
    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(pki.cert), str(pki.key))
    return context


def _framed_hello_accepted(port: int, token: str, context: ssl.SSLContext | None) -> bool:
    """Whether a hello on the framed execute channel is ACCEPTED (any failure to get there: False)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            sock = context.wrap_socket(raw, server_hostname="127.0.0.1") if context else raw
            sock.sendall(HEADER.pack(len(hello(token)), FrameKind.HELLO) + hello(token))
            reply = sock.recv(HEADER.size)
            return len(reply) == HEADER.size and HEADER.unpack(reply)[1] == FrameKind.ACCEPTED
    except (OSError, ssl.SSLError):
        return False


def _ready(client, model: str) -> bool:
    try:
        return client.is_model_ready(model)
    except InferenceServerException:
        return False


@pytest.mark.slow
def test_serve_makes_a_private_token_and_passes_tls_to_its_components(tmp_path, pki):
    data = tmp_path / "data"
    cluster = start_serve(data, "--no-samples", "--backends", "0", *pki.flags())
    try:
        token_file = data / "token"
        assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert len(token_file.read_text().strip()) >= 32
        tls = ["--scheduler", cluster.scheduler, "--tls-ca", str(pki.ca)]
        refused = subprocess.run([sys.executable, "-m", "nexus", "models", "list", *tls],
                                 capture_output=True, text=True, timeout=60, cwd=tmp_path,
                                 env={k: v for k, v in os.environ.items() if k != "NEXUS_TOKEN"})
        assert refused.returncode == 2 and "missing cluster token" in refused.stderr
        ok = nexus_cli("models", "list", *tls, "--token-file", str(token_file))
        assert ok.returncode == 0, ok.stderr
        assert grpcclient.InferenceServerClient(cluster.frontend, ssl=True,
                                                root_certificates=str(pki.ca)).is_server_live()
        with pytest.raises(InferenceServerException):
            grpcclient.InferenceServerClient(cluster.frontend).is_server_live()
        # Without a restricted header, KServe's repository calls need the cluster token.
        client = grpcclient.InferenceServerClient(cluster.frontend, ssl=True, root_certificates=str(pki.ca))
        with pytest.raises(InferenceServerException) as e:
            client.unload_model("absent")
        assert "UNAUTHENTICATED" in str(e.value.status()) and "missing cluster token" in e.value.message()
        with pytest.raises(InferenceServerException) as e:       # past the guard: the scheduler answers
            client.unload_model("absent", headers={"authorization": f"Bearer {cluster.token}"})
        assert "NOT_FOUND" in str(e.value.status())
    finally:
        cluster.stop()


def test_serve_refuses_a_certificate_without_its_ca(tmp_path, pki):
    result = nexus_cli("serve", "--data-dir", str(tmp_path), "--tls-cert", str(pki.cert), "--tls-key", str(pki.key),
                       timeout_s=60)
    assert result.returncode == 2 and "--tls-cert needs --tls-ca" in result.stderr


def test_client_commands_name_an_unreadable_ca(tmp_path):
    result = nexus_cli("models", "list", "--tls-ca", str(tmp_path / "absent.pem"))
    assert result.returncode == 2 and "--tls-ca: no such file" in result.stderr
