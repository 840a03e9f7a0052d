"""The scheduler's admin calls, as the ``nexus`` commands make them: upload and list models, register
and list queries, read the plan's status.

Every call dials ``scheduler`` with the client's :class:`~common.security.Credentials` (TLS CA,
cluster token) and raises :class:`AdminCallError` with a message fit for the operator: the
scheduler's own reason when it refused, "cannot reach the scheduler at ..." when it is not there,
or what is wrong with a local file before anything is sent. Replies are converted to the commands'
types here, at the edge.
"""

from __future__ import annotations

import logging
import pathlib
import time
import uuid
from typing import Iterator, Sequence

import grpc

from common import grpc_util
from common.config import scheduler_addresses
from common.pb import control, control_grpc
from common.late_requests import LateRequests
from common.profile import Profile, ProfileError
from common.scheduler_connection import leader_hint, next_scheduler
from common.security import Credentials
from common.version_policy import VersionPolicy, to_pb as policy_to_pb
from common.warmup_spec import WarmupSample, to_pb as warmup_to_pb
from nexus.status_model import ClusterStatus, from_reply

DEFAULT_SCHEDULER = "127.0.0.1:8100"
RETRY_DELAYS_S = (0.25, 1.0, 2.0)    # an admin call no scheduler took is made again after each of these pauses

log = logging.getLogger("nexus.cli")


class AdminCallError(Exception):
    """An admin call that failed; the message says why (the scheduler's reason, or the local cause)."""


def rpc_error_message(exc: grpc.RpcError, scheduler: str) -> str:
    """What an operator reads for a failed call: the scheduler's reason, or that it cannot be reached."""
    if exc.code() == grpc.StatusCode.UNAVAILABLE and leader_hint(exc):       # a standby: it names the leader
        return f"{scheduler}: {exc.details()} (give it in --scheduler too: a,b)"
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the scheduler at {scheduler} ({exc.details()})"
    return exc.details()


def _call(scheduler: str, creds: Credentials, method: str, request, timeout_s: float = 30.0):
    """One call of the scheduler's ``method``; AdminCallError with the operator's message when it fails.

    ``scheduler`` may list several schedulers (``a,b,c``): the call goes to the first, and where one is
    unavailable, to the leader a standby names (within the list), else to the next. When every one was
    unavailable, the round is made again after each pause of :data:`RETRY_DELAYS_S` (a connection that
    broke, a leader on its way), within ``timeout_s`` in all. Every admin call may be made again: the
    reads and settings are idempotent, and an upload carries its id (:func:`upload_model`).
    ``request`` may be a function making the request (a stream, made again for each try)."""
    return _call_at(scheduler, creds, method, request, timeout_s)[0]


def _call_at(scheduler: str, creds: Credentials, method: str, request, timeout_s: float = 30.0,
             retry_delays_s: Sequence[float] | None = None):
    """:func:`_call`'s reply, and the address of the scheduler that gave it. ``retry_delays_s``: the
    pauses before the rounds after the first (None: :data:`RETRY_DELAYS_S`)."""
    addresses = scheduler_addresses(scheduler) or (scheduler,)
    deadline = time.monotonic() + timeout_s
    pauses = list(RETRY_DELAYS_S if retry_delays_s is None else retry_delays_s)
    address, tried = addresses[0], []
    while True:
        tried.append(address)
        with grpc_util.channel(address, creds) as channel:
            try:
                return getattr(control_grpc.SchedulerStub(channel), method)(
                    request() if callable(request) else request,
                    timeout=max(deadline - time.monotonic(), 0.001)), address
            except grpc.RpcError as exc:
                following = next_scheduler(addresses, address, leader_hint(exc))
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise AdminCallError(rpc_error_message(exc, address)) from None
                if following in tried:
                    hint = leader_hint(exc)      # a leader outside the list: the standby will say the same
                    if not pauses or time.monotonic() + pauses[0] >= deadline or (hint and hint not in addresses):
                        raise AdminCallError(rpc_error_message(exc, address)) from None
                    log.warning("no scheduler took %s (%s); asking again in %.2f s", method, ", ".join(tried),
                                pauses[0])
                    time.sleep(pauses.pop(0))
                    following, tried = addresses[0], []
                address = following


def _chunks(header: control.UploadHeader, path: pathlib.Path) -> Iterator[control.UploadChunk]:
    yield control.UploadChunk(header=header)
    with path.open("rb") as f:
        while True:
            data = f.read(grpc_util.UPLOAD_CHUNK_BYTES)
            if not data:
                return
            yield control.UploadChunk(data=data)


def upload_model(scheduler: str, path: str | pathlib.Path, name: str, *, profile_path: str | None = None,
                 slo_ms: float = 0.0, runtime: str = "", io_path: str | None = None, load: bool = True,
                 timeout_s: float = 300, min_replicas: int = 0, warmup: Sequence[WarmupSample] = (),
                 version: int = 0, version_policy: VersionPolicy | None = None,
                 expected_rate_rps: float = 0.0, batch_cap: int = 0, creds: Credentials = grpc_util.NO_CREDENTIALS,
                 pin_profile: bool = False, late_requests: LateRequests | None = None) -> control.ModelDesc:
    """Stream a model file to the scheduler; raise AdminCallError with the scheduler's reason if refused.
    The upload carries an id of its own, so that when it is sent again (:func:`_call`) the scheduler
    stores it once.
    ``warmup``: the version's warm-up samples (config.pbtxt's model_warmup; none: the backends' default).
    ``version``: the version the file is (0: the next after the newest, 1 for a new model);
    ``version_policy``: the model's from now on (None: the one it has, else the latest version).
    ``pin_profile``: the profile always plans, whatever serving measures (``"meta": {"pinned": true}``).
    ``expected_rate_rps``: the rate its session is planned for until one is measured (0: the
    scheduler's default), so that a model's first requests find the capacity they need.
    ``batch_cap``: its largest batch (config.pbtxt's max_batch_size; 0: none).
    ``late_requests``: what becomes of its requests that can no longer meet the SLO, from now on
    (common/late_requests.py; None: the model's setting stays)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise AdminCallError(f"no such file: {path}")
    if pin_profile and not profile_path:
        raise AdminCallError("--pin-profile needs --profile (the table to pin)")
    if min_replicas < 0:
        raise AdminCallError(f"--min-replicas must not be negative, got {min_replicas}")
    if version < 0:
        raise AdminCallError(f"--version must be a positive integer, got {version}")
    header = control.UploadHeader(name=name, slo_ms=slo_ms, load=load, min_replicas=min_replicas, version=version,
                                  expected_rate_rps=expected_rate_rps, batch_cap=batch_cap,
                                  late_requests=late_requests.to_pb() if late_requests else 0,
                                  upload_id=uuid.uuid4().hex,
                                  runtime=runtime or ("torch" if path.suffix in (".pt", ".pt2") else "onnxruntime"))
    header.warmup.extend(warmup_to_pb(warmup))
    if version_policy is not None:
        header.version_policy.CopyFrom(policy_to_pb(version_policy))
    for attr, file in (("profile_json", profile_path), ("io_json", io_path)):
        if file:
            try:
                setattr(header, attr, pathlib.Path(file).read_text())
            except OSError as exc:
                raise AdminCallError(f"cannot read {file}: {exc.strerror}") from None
    if pin_profile:
        header.profile_json = pinned(header.profile_json, profile_path)
    return _call(scheduler, creds, "UploadModel", lambda: _chunks(header, path), timeout_s).model


def pinned(profile_json: str, where: str) -> str:
    """The profile file's JSON with ``meta.pinned`` set (globalsched/state/profile_book.py: a pinned table
    always plans; uploading it again without the pin unpins it)."""
    try:
        profile = Profile.from_json(profile_json, where)
    except ProfileError as exc:
        raise AdminCallError(f"invalid profile: {exc}") from None
    return Profile(profile.rows, profile.device_type, {**profile.meta, "pinned": True}).to_json()


def wait_model_ready(scheduler: str, name: str, version: int = 0, timeout_s: float = 120.0,
                     creds: Credentials = grpc_util.NO_CREDENTIALS) -> control.ModelDesc:
    """The description of version ``version`` of ``name`` (0: the newest) once it is READY or FAILED
    (its ``serving_state``), or as it is after ``timeout_s``."""
    return _call(scheduler, creds, "WaitModelReady",
                 control.WaitReadyRequest(name=name, version=version, timeout_s=timeout_s), timeout_s + 30.0)


def list_models(scheduler: str, creds: Credentials = grpc_util.NO_CREDENTIALS) -> list[control.ModelDesc]:
    return list(_call(scheduler, creds, "ListModels", control.ListModelsRequest()).models)


def add_profile(scheduler: str, name: str, profile: Profile, version: int = 0,
                creds: Credentials = grpc_util.NO_CREDENTIALS) -> None:
    """Store ``profile`` as the table of version ``version`` of ``name`` (0: the newest served) for its
    device type; AdminCallError with the scheduler's reason if refused."""
    _call(scheduler, creds, "AddProfile", control.ProfileUpload(model=name, profile_json=profile.to_json(),
                                                                version=version))


def register_query(scheduler: str, text: str, creds: Credentials = grpc_util.NO_CREDENTIALS) -> str:
    """Register a query definition; raise AdminCallError with the scheduler's reason if refused."""
    return _call(scheduler, creds, "RegisterQuery", control.QueryDefinition(json=text)).name


def list_queries(scheduler: str, creds: Credentials = grpc_util.NO_CREDENTIALS) -> list[control.QueryInfo]:
    return list(_call(scheduler, creds, "ListQueries", control.ListQueriesRequest()).queries)


def fetch_status(scheduler: str, timeout_s: float = 30.0,
                 creds: Credentials = grpc_util.NO_CREDENTIALS) -> ClusterStatus:
    """The scheduler's read-only ``GetStatus``, as a :class:`~nexus.status_model.ClusterStatus`."""
    return from_reply(_call(scheduler, creds, "GetStatus", control.StatusRequest(), timeout_s))


class StatusReader:
    """``GetStatus`` read over and over, on one channel kept to the scheduler that answered last
    (``nexus serve --backends auto`` reads the scaler's decision ten times a second:
    nexus/local_scaler.py).

    :func:`fetch_status` dials for every call: on loopback that costs the caller 1.6 ms of CPU a
    read, against 0.3 ms on a kept channel (2026-12-06, AMD EPYC). Any failure closes the channel. An
    UNAVAILABLE one (the scheduler gone, or a standby) is tried again at once on the schedulers listed,
    without :func:`fetch_status`'s pauses (its caller reads again soon), and the channel is then kept
    to the scheduler that answered; any other raises :class:`AdminCallError`, and the next read
    dials afresh. ``scaling_only``: the scaling decisions and the devices' identities, no sessions,
    routes or profiles (globalsched/rpc/status.py, ``scaling_reply``)."""

    def __init__(self, scheduler: str, timeout_s: float = 30.0,
                 creds: Credentials = grpc_util.NO_CREDENTIALS, scaling_only: bool = False) -> None:
        self.scheduler = scheduler
        self.timeout_s = timeout_s
        self.creds = creds
        self.request = control.StatusRequest(scaling_only=scaling_only)
        self.address = ""                       # the scheduler the kept channel dials ('': none kept)
        self._channel: grpc.Channel | None = None

    def __call__(self) -> ClusterStatus:
        if self._channel is not None:
            try:
                return from_reply(control_grpc.SchedulerStub(self._channel).GetStatus(self.request,
                                                                                       timeout=self.timeout_s))
            except grpc.RpcError as exc:
                address = self.address
                self.close()
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise AdminCallError(rpc_error_message(exc, address)) from None
        reply, address = _call_at(self.scheduler, self.creds, "GetStatus", self.request, self.timeout_s,
                                  retry_delays_s=())      # its caller reads again soon
        self._channel, self.address = grpc_util.channel(address, self.creds), address
        return from_reply(reply)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self.address = None, ""
