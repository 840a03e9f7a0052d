"""The scheduler's frontend stub (globalsched/rpc/frontend_stub.py) over real gRPC: a routing table sent
to several frontends is serialized once, each frontend receives it whole, and a new table is
serialized anew."""

from __future__ import annotations

import asyncio

import grpc

from common.pb import control, control_grpc
from globalsched.rpc.frontend_stub import ROUTING_TABLE_BYTES, frontend_stub


class Frontend(control_grpc.FrontendServicer):
    def __init__(self) -> None:
        self.tables: list[control.RoutingTable] = []

    async def UpdateRoutingTable(self, request, context):
        self.tables.append(request)
        return control.RoutingTableReply()


def _table(epoch: int) -> control.RoutingTable:
    routes = [control.ModelRoute(session=f"m{i}", model=control.ModelDesc(name=f"m{i}")) for i in range(50)]
    return control.RoutingTable(epoch=epoch, routes=routes)


def test_a_table_sent_to_every_frontend_is_serialized_once():
    async def main():
        frontends, servers, channels = [Frontend() for _ in range(3)], [], []
        try:
            for fe in frontends:
                server = grpc.aio.server()
                control_grpc.add_FrontendServicer_to_server(fe, server)
                port = server.add_insecure_port("127.0.0.1:0")
                await server.start()
                servers.append(server)
                channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
            stubs = [frontend_stub(c) for c in channels]
            before = ROUTING_TABLE_BYTES.serialized
            first = _table(7)
            await asyncio.gather(*(s.UpdateRoutingTable(first, timeout=10) for s in stubs))
            once = ROUTING_TABLE_BYTES.serialized - before
            second = _table(8)
            await asyncio.gather(*(s.UpdateRoutingTable(second, timeout=10) for s in stubs))
            return frontends, once, ROUTING_TABLE_BYTES.serialized - before
        finally:
            for c in channels:
                await c.close()
            for s in servers:
                await s.stop(None)

    frontends, once, twice = asyncio.run(main())
    assert once == 1 and twice == 2
    for fe in frontends:
        assert [t.epoch for t in fe.tables] == [7, 8]
        assert fe.tables[0] == _table(7) and fe.tables[1] == _table(8)
