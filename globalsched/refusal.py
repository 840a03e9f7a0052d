"""The one way the scheduler's parts refuse a request: :class:`Refused` carries the gRPC status.

The parts (membership, model administration, ...) raise it; the servicer in globalsched/rpc/service.py
turns it into the RPC's status, so the parts need no gRPC context and are callable from tests.
"""

from __future__ import annotations

import grpc


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
