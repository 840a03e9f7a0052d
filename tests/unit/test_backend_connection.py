"""A frontend's connection to a backend (frontend/backend_pool.py) against in-process gRPC servers and a
raw framed peer: which stream it opens, its fall-backs, and a hung peer found by the framed keepalive.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from common.exec_frames import FrameKind, FrameReader, FrameWriter
from common.exec_status import ExecStatus
from common.pb import control, control_grpc
from frontend.backend_pool import BackendConnection, BackendGone


class EchoBackend(control_grpc.BackendServicer):
    """Answers every item on the gRPC stream OK; no ``ExecEndpoint`` (a backend from before it)."""

    async def Execute(self, request_iterator, context):
        async for item in request_iterator:
            yield control.ExecResult(request_id=item.request_id, status=control.EXEC_OK, batch_size=1)


class OfferingBackend(EchoBackend):
    def __init__(self, port: int) -> None:
        self.port = port

    async def ExecEndpoint(self, request, context):
        return control.ExecEndpointReply(port=self.port)


async def _grpc_server(servicer) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    control_grpc.add_BackendServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


class SilentPeer(asyncio.Protocol):
    """Accepts the hello, then never says anything again (a stopped process keeps its socket open)."""

    def connection_made(self, transport):
        self.writer, self.reader = FrameWriter(transport), FrameReader()

    def data_received(self, data):
        for kind, _ in self.reader.feed(data):
            if kind is FrameKind.HELLO:
                self.writer.send(FrameKind.ACCEPTED)


def _item(i: int) -> control.ExecItem:
    return control.ExecItem(request_id=i, model="m", budget_us=1_000_000)


async def _one_request(servicer) -> tuple[ExecStatus, str]:
    """One request through a new connection to ``servicer``: (its status, the transport it went on)."""
    server, address = await _grpc_server(servicer)
    conn = BackendConnection(address)
    try:
        reply = await conn.execute(_item(1), timeout_s=10)
        return reply.status, conn.transport
    finally:
        await conn.close()
        await server.stop(0)


def test_a_backend_without_the_framed_channel_is_served_on_its_grpc_stream():
    assert asyncio.run(_one_request(EchoBackend())) == (ExecStatus.OK, "grpc")


def test_an_unreachable_framed_port_falls_back_to_the_grpc_stream_and_says_so(caplog):
    async def main():
        probe = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
        closed_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        assert await _one_request(OfferingBackend(closed_port)) == (ExecStatus.OK, "grpc")
        return closed_port

    with caplog.at_level(logging.WARNING, logger="nexus.frontend"):
        port = asyncio.run(main())
    assert f"(port {port}) failed" in caplog.text and "using its gRPC stream" in caplog.text


def test_a_refused_hello_falls_back_to_the_grpc_stream(caplog):
    class Refusing(asyncio.Protocol):
        def connection_made(self, transport):
            FrameWriter(transport).send(FrameKind.DENIED, b"wrong cluster token")

    async def main():
        peer = await asyncio.get_running_loop().create_server(Refusing, "127.0.0.1", 0)
        try:
            assert await _one_request(OfferingBackend(peer.sockets[0].getsockname()[1])) == (ExecStatus.OK, "grpc")
        finally:
            peer.close()

    with caplog.at_level(logging.WARNING, logger="nexus.frontend"):
        asyncio.run(main())
    assert "refused: wrong cluster token" in caplog.text


def test_a_hung_framed_peer_is_dropped_by_the_keepalive_and_its_requests_fail(caplog):
    broken = []

    async def main():
        peer = await asyncio.get_running_loop().create_server(SilentPeer, "127.0.0.1", 0)
        server, address = await _grpc_server(OfferingBackend(peer.sockets[0].getsockname()[1]))
        conn = BackendConnection(address, on_broken=broken.append)
        try:
            with pytest.raises(BackendGone):
                await conn.execute(_item(1), timeout_s=60)     # long before this: the ping goes unanswered
            assert conn.transport == "framed"
        finally:
            await conn.close()
            await server.stop(0)
            peer.close()
        return address

    with caplog.at_level(logging.WARNING, logger="nexus.frontend"):
        address = asyncio.run(main())
    assert broken == [address]
    assert "no answer to a ping" in caplog.text
