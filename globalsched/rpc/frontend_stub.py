"""The scheduler's stub for a frontend: a routing table goes to every frontend, serialized once.

A routing table names every session (2,400 at the fleet benchmark's size, benchmarks/elastic.md), and
each frontend's call serialized it again when the call started, all of them in one turn of the event
loop: ten frontends' copies held the scheduler's loop tens of milliseconds at every table, and the
early tables of a make step come every quarter of a second. The stub's serializer keeps the bytes of
the last table it serialized and gives them again for the same message object.

A table is not changed once sent (the distribution builds each new one: globalsched/actuators/distribution.py).
"""

from __future__ import annotations

from common.pb import control, control_grpc

UPDATE_ROUTING_TABLE = "/nexus.control.Frontend/UpdateRoutingTable"


class LastSerialized:
    """A request serializer that serializes a message once while it is the last one given."""

    def __init__(self) -> None:
        self.message: object = None
        self.body = b""
        self.serialized = 0         # how many times it serialized (the rest were given again)

    def __call__(self, message) -> bytes:
        if message is not self.message:
            self.body = message.SerializeToString()
            self.message = message
            self.serialized += 1
        return self.body


ROUTING_TABLE_BYTES = LastSerialized()     # one for every frontend: they are sent the same table in turn


def frontend_stub(channel) -> control_grpc.FrontendStub:
    stub = control_grpc.FrontendStub(channel)
    stub.UpdateRoutingTable = channel.unary_unary(UPDATE_ROUTING_TABLE, request_serializer=ROUTING_TABLE_BYTES,
                                                  response_deserializer=control.RoutingTableReply.FromString,
                                                  _registered_method=True)
    return stub
