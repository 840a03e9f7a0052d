"""The request counts of a frontend's other workers, summed into its ModelStatistics.

A frontend started with ``--workers N`` is N processes behind one port (nexus/frontend_workers.py),
and the kernel hands each connection to one of them, so each worker counts only the requests it
served. A client reading ModelStatistics (perf_analyzer subtracts two readings) must see the whole
frontend's counts whichever worker answers: that worker asks its siblings for theirs, each on its own
port, with the metadata :data:`WORKER_SCOPE`, and adds them to its own. A worker asked so answers its
own counts only, and asks no one.

The sums only grow, as Triton's do: a sibling that does not answer (it is restarting) counts with
what it answered last, and one that restarted (its counts went down) has what it had counted kept
in a retired total.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from common import grpc_util
from common.pb import kserve, kserve_grpc
from common.security import Credentials

log = logging.getLogger("nexus.frontend")

WORKER_SCOPE = ("nexus-statistics-scope", "worker")
# The frontend's own per-session counters (FrontendState.counters) that add up over workers.
COUNTERS = ("rows", "success", "success_ns", "fail")
TIMEOUT_S = 5.0

Key = tuple[str, str]          # (model or query name, version)


def asks_worker_scope(metadata) -> bool:
    return tuple(WORKER_SCOPE) in tuple(metadata)


def counts_of(reply: kserve.ModelStatisticsResponse) -> dict[Key, dict[str, int]]:
    """The counters a worker answered in worker scope, by (name, version)."""
    return {(s.name, s.version): {"rows": s.inference_count, "success": s.inference_stats.success.count,
                                  "success_ns": s.inference_stats.success.ns, "fail": s.inference_stats.fail.count}
            for s in reply.model_stats}


class SiblingCounts:
    """The counts of the workers at ``addresses``, kept so that their sum never goes down."""

    def __init__(self, addresses: list[str], creds: Credentials) -> None:
        self._channels = {a: grpc_util.aio_channel(a, creds) for a in addresses}
        self._stubs = {a: kserve_grpc.GRPCInferenceServiceStub(ch) for a, ch in self._channels.items()}
        self._last: dict[str, dict[Key, dict[str, int]]] = {}
        self._retired: dict[Key, dict[str, int]] = {}

    def record(self, address: str, counts: dict[Key, dict[str, int]]) -> None:
        """``counts`` newly answered by ``address``: what it no longer counts, or counts less of (it
        restarted), goes to the retired totals."""
        for key, before in self._last.get(address, {}).items():
            now = counts.get(key)
            if now is None or now["rows"] < before["rows"] or now["success"] < before["success"] \
                    or now["fail"] < before["fail"]:
                retired = self._retired.setdefault(key, dict.fromkeys(COUNTERS, 0))
                for name in COUNTERS:
                    retired[name] += before[name]
        self._last[address] = counts

    def totals(self) -> dict[Key, dict[str, int]]:
        total: dict[Key, dict[str, int]] = {}
        for counts in [*self._last.values(), self._retired]:
            for key, values in counts.items():
                mine = total.setdefault(key, dict.fromkeys(COUNTERS, 0))
                for name in COUNTERS:
                    mine[name] += values[name]
        return total

    async def read(self, request: kserve.ModelStatisticsRequest) -> dict[Key, dict[str, int]]:
        """Ask every sibling now; the summed counts, by (name, version)."""
        addresses = list(self._stubs)
        replies = await asyncio.gather(*(self._stubs[a].ModelStatistics(request, metadata=(WORKER_SCOPE,),
                                                                        timeout=TIMEOUT_S) for a in addresses),
                                       return_exceptions=True)
        for address, reply in zip(addresses, replies):
            if isinstance(reply, grpc.aio.AioRpcError):
                log.info("worker %s did not answer its statistics (%s); its last counts stand in",
                         address, reply.code().name)
            elif isinstance(reply, BaseException):
                raise reply
            else:
                self.record(address, counts_of(reply))
        return self.totals()

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
