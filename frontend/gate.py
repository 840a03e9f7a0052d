"""The KServe calls a frontend has in flight, for draining, and a short hold for calls that arrive
before the frontend's first routing table.

A frontend listens before the scheduler has pushed it a table (the scheduler reaches it on that
port), so a client that dials it at once, as a round-robin client does when a restarted frontend
comes back, would get NOT_FOUND for every model. An inference call that arrives then waits for the
first table, at most ``FIRST_TABLE_WAIT_S`` and never past its own deadline.
"""

from __future__ import annotations

import asyncio

import grpc

KSERVE_PREFIX = "/inference.GRPCInferenceService/"
HELD_METHODS = frozenset({KSERVE_PREFIX + "ModelInfer"})
FIRST_TABLE_WAIT_S = 5.0
ANSWER_MARGIN_S = 0.1     # stop waiting this long before the call's deadline, to answer in time


class RequestGate(grpc.aio.ServerInterceptor):
    def __init__(self, state) -> None:
        self.state = state
        self.in_flight = 0

    async def _first_table(self, context) -> None:
        loop = asyncio.get_running_loop()
        remaining = context.time_remaining()
        wait_s = FIRST_TABLE_WAIT_S if remaining is None else min(FIRST_TABLE_WAIT_S, remaining - ANSWER_MARGIN_S)
        deadline = loop.time() + wait_s
        while self.state.table.epoch == 0 and loop.time() < deadline:
            try:
                await asyncio.wait_for(self.state.table_changed.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None or not details.method.startswith(KSERVE_PREFIX):
            return handler
        inner, held = handler.unary_unary, details.method in HELD_METHODS

        async def counted(request, context):
            self.in_flight += 1
            try:
                if held and self.state.table.epoch == 0:
                    await self._first_table(context)
                return await inner(request, context)
            finally:
                self.in_flight -= 1

        return grpc.unary_unary_rpc_method_handler(counted, request_deserializer=handler.request_deserializer,
                                                   response_serializer=handler.response_serializer)
