"""The connection a node (backend, frontend) keeps to the leading scheduler among several.

``--scheduler a,b,c`` names every scheduler of the cluster. A :class:`SchedulerConnection` behaves as
the Scheduler stub of the one it currently talks to. When a unary call there fails UNAVAILABLE, it
moves on for the next call: to the leader a standby named (its ``nexus-leader`` trailing metadata),
when that is one of the given addresses, else to the next address in the list. The failed call still
raises: callers retry as they always did (registration, the workload report), and their retry goes
to the new address. A leader is only ever followed within the given list, so a node never sends its
cluster token to an address its operator did not name.

Streaming calls (Attach, DownloadModel) go to the current address; when one breaks, the caller's next
unary call (registering again) finds the leader.

:func:`next_scheduler` is the rule alone, for the admin commands' synchronous calls.
"""

from __future__ import annotations

import logging
from typing import Sequence

import grpc

from common import grpc_util
from common.pb import control, control_grpc
from common.security import Credentials

log = logging.getLogger("nexus.registration")

LEADER_METADATA = "nexus-leader"
_STREAMING = frozenset({"Attach", "DownloadModel", "UploadModel"})


def leader_hint(exc: grpc.RpcError) -> str:
    """The leader a standby named in its refusal ("" when none)."""
    try:
        metadata = exc.trailing_metadata() or ()
    except Exception:
        return ""
    for key, value in metadata:
        if key == LEADER_METADATA:
            return value.decode() if isinstance(value, bytes) else str(value)
    return ""


def next_scheduler(addresses: Sequence[str], failed: str, hint: str) -> str:
    """Where to go after ``failed`` answered UNAVAILABLE (naming ``hint`` as the leader, or not)."""
    if hint and hint in addresses and hint != failed:
        return hint
    if failed not in addresses:
        return addresses[0]
    return addresses[(addresses.index(failed) + 1) % len(addresses)]


class SchedulerConnection:
    def __init__(self, addresses: Sequence[str], creds: Credentials = grpc_util.NO_CREDENTIALS) -> None:
        if not addresses:
            raise ValueError("no scheduler address")
        self.addresses = tuple(addresses)
        self.address = self.addresses[0]
        self._creds = creds
        self._stubs: dict[str, control_grpc.SchedulerStub] = {}
        self._channels: list = []

    def _stub(self, address: str) -> control_grpc.SchedulerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc_util.aio_channel(address, self._creds, to_scheduler=True)
            self._channels.append(channel)
            stub = self._stubs[address] = control_grpc.SchedulerStub(channel)
        return stub

    def __getattr__(self, name: str):
        if not name[:1].isupper():
            raise AttributeError(name)
        address = self.address
        method = getattr(self._stub(address), name)
        if name in _STREAMING:
            return method

        async def call(*args, **kwargs):
            try:
                return await method(*args, **kwargs)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    self._follow(address, leader_hint(exc))
                raise
        return call

    def _follow(self, failed: str, hint: str) -> None:
        if len(self.addresses) == 1 or self.address != failed:
            return
        self.address = next_scheduler(self.addresses, failed, hint)
        log.info("scheduler %s unavailable%s; trying %s", failed, f" (it names {hint} the leader)" if hint else "",
                 self.address)

    async def probe_leader(self, timeout_s: float = 2.0) -> str:
        """Ask the other schedulers who leads, when the current one stopped answering (a hung process
        keeps its connections open, so nothing breaks by itself): an address of the list that now leads
        (its Heartbeat answers) or that a standby names, other than the current one; "" when none does,
        and the current one is waited for. Moves there when found."""
        current = self.address            # other calls meanwhile keep going there until a leader is found
        for address in self.addresses:
            if address == current:
                continue
            try:
                await self._stub(address).Heartbeat(control.HeartbeatRequest(), timeout=timeout_s)
                found = address
            except grpc.aio.AioRpcError as exc:
                hint = leader_hint(exc) if exc.code() == grpc.StatusCode.UNAVAILABLE else ""
                found = hint if hint in self.addresses and hint != current else ""
            if found:
                self.address = found
                log.warning("scheduler %s does not answer and %s leads now; following it", current, found)
                return found
        return ""

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
