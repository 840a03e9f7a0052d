"""Open-loop load generation against a KServe v2 gRPC frontend.

Arrivals come from :func:`common.arrivals.arrival_times` (a Poisson process by default, Gamma gaps of
another coefficient of variation with ``cv``; seeded) and are sent at their absolute scheduled times:
the sender never waits for a response, so a slow server cannot slow the offered load down (no
coordinated omission). When the client itself falls behind schedule it says so (``client_lag_ms``).

Every request is the same message, built once from the model's metadata with random inputs and
serialized once; the calls go through a raw-bytes unary method (identity serializers), so a
request costs the client one gRPC call and no protobuf work. Each request carries a gRPC deadline of
SLO plus a grace period (so that late answers are seen and classified late rather than lost) and,
as Triton does, the request parameter ``timeout`` (microseconds) set to the SLO.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import re
import threading
import time
from typing import Any, Callable, Mapping, Sequence

import grpc
import grpc.aio
import numpy as np

from common.arrivals import arrival_times
from common.rate_search import max_passing_rate_async
from common import grpc_util
from common.pb import kserve, kserve_grpc
from common.tensors import numpy_dtype
from nexus.bench.report import (
    CLIENT_DROPPED,
    CLIENT_LIMIT_STATUS,
    DROP_CODES,
    DROPPED,
    FAILED,
    NO_STATUS,
    OK,
    BenchReport,
    BenchSamples,
    build_report,
)

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
DEFAULT_ADDRESS = "127.0.0.1:8001"
# Several frontends: round-robin over those whose gRPC health check says SERVING (gRPC's client-side
# health checking watches them), reconnecting to a restarted one within a second.
BALANCED_OPTIONS = [
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}],
                                        "healthCheckConfig": {"serviceName": ""}})),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]


class BenchError(Exception):
    """A benchmark that cannot run: bad arguments, unreachable frontend, unknown model."""


def check_address(address: str) -> str:
    """``HOST:PORT`` (an IPv6 host in brackets), else BenchError."""
    m = re.fullmatch(r"(\[[0-9a-fA-F:.]+\]|[^:\s\[\]]+):(\d{1,5})", address or "")
    if not m or not 0 < int(m.group(2)) < 65536:
        raise BenchError(f"bad frontend address {address!r}: expected HOST:PORT")
    return address


def default_grace_ms(slo_ms: float) -> float:
    """Client deadline past the SLO: half the SLO, at least 20 ms."""
    return max(20.0, 0.5 * slo_ms)


def _random_tensor(shape: Sequence[int], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(dtype)
    if dtype == np.uint8:
        return rng.integers(0, 256, shape).astype(dtype)
    # Other integers are often indices (tokens, classes): keep them small and non-negative.
    return rng.integers(0, 10, shape).astype(dtype)


def build_request(
    metadata: Any,
    *,
    model: str,
    batch: int = 1,
    rng: np.random.Generator | None = None,
    model_version: str = "",
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> Any:
    """A ModelInferRequest with random inputs shaped from ``metadata`` (a ModelMetadataResponse).

    A leading -1 is the batch dimension and becomes ``batch`` rows; any other variable dimension
    needs its input's shape (without the batch dimension) in ``input_shapes``.
    """
    rng = rng if rng is not None else np.random.default_rng(0)
    overrides = dict(input_shapes or {})
    unknown = set(overrides) - {t.name for t in metadata.inputs}
    if unknown:
        raise BenchError(f"model {model!r} has no input named {sorted(unknown)[0]!r}")
    if not metadata.inputs:
        raise BenchError(f"model {model!r} declares no inputs")
    req = kserve.ModelInferRequest(model_name=model, model_version=model_version)
    for t in metadata.inputs:
        dims = [int(d) for d in t.shape]
        batched = bool(dims) and dims[0] == -1
        item = dims[1:] if batched else dims
        if t.name in overrides:
            item = [int(d) for d in overrides[t.name]]
        if any(d < 0 for d in item):
            raise BenchError(
                f"input {t.name!r} of model {model!r} has a variable dimension (shape {dims}); "
                f"give its shape with --shape {t.name}=D1,D2,..."
            )
        if not batched and batch != 1:
            raise BenchError(f"input {t.name!r} of model {model!r} has no batch dimension; use --batch 1")
        shape = [batch] + item if batched else item
        try:
            dtype = numpy_dtype(t.datatype)
        except KeyError:
            raise BenchError(f"input {t.name!r} of model {model!r}: unsupported datatype {t.datatype!r}") from None
        data = _random_tensor(shape, dtype, rng)
        req.inputs.add(name=t.name, datatype=t.datatype, shape=shape)
        req.raw_input_contents.append(data.astype(dtype.newbyteorder("<"), copy=False).tobytes())
    return req


class RunState:
    """Mutable state of one open-loop phase (per-request arrays plus live counters)."""

    def __init__(self, n: int, slo_ms: float) -> None:
        self.sched_s = np.zeros(n)
        self.lag_s = np.zeros(n)
        self.done_s = np.full(n, np.nan)
        self.start_s = 0.0
        self.sent = 0
        self.latency_ms = np.full(n, np.nan)
        self.outcome = np.zeros(n, dtype=np.int8)
        self.status = np.full(n, NO_STATUS, dtype=np.int16)
        self.slo_ms = slo_ms
        self.inflight = 0
        self.finished = 0
        self.ok = self.late = self.dropped = self.failed = 0
        self.sending = True
        self.idle = asyncio.Event()
        self.first_error: str | None = None
        self.examples: dict[str, str] = {}   # status name -> the first such error's message
        self.tasks: set[asyncio.Task] = set()


class LoadClient:
    """One or more channels to a frontend and the prepared request of one model.

    ``await client.open()`` (or ``async with``) fetches the model's metadata and builds the
    request; each ``await client.run(rate, duration, slo)`` is one open-loop phase returning a
    :class:`BenchReport`. ``raw=False`` sends through the generated stub instead (a protobuf
    serialization per request and a parse per response), kept to measure what the raw path saves.
    ``address`` may list several frontends: each channel then balances round-robin over those whose
    gRPC health check says SERVING (as a client behind a load balancer; IPv4 addresses).
    """

    def __init__(
        self,
        address: str | Sequence[str],
        model: str,
        *,
        batch: int = 1,
        channels: int = 1,
        seed: int = 0,
        model_version: str = "",
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        connect_timeout_s: float = 5.0,
        raw: bool = True,
        timeout_param: bool = True,
        root_certificates: bytes | None = None,
    ) -> None:
        addresses = [address] if isinstance(address, str) else list(address)
        if not addresses:
            raise BenchError("no frontend address")
        self.addresses = [check_address(a) for a in addresses]
        self.address = ",".join(self.addresses)
        if not model:
            raise BenchError("a model name is required (--model)")
        if batch < 1:
            raise BenchError(f"--batch must be >= 1, got {batch}")
        if channels < 1:
            raise BenchError(f"--channels must be >= 1, got {channels}")
        self.model = model
        self.batch = int(batch)
        self.n_channels = int(channels)
        self.seed = int(seed)
        self.model_version = model_version
        self.input_shapes = input_shapes
        self.connect_timeout_s = connect_timeout_s
        self.raw = raw
        self.timeout_param = timeout_param
        self.root_certificates = root_certificates    # a CA: TLS to the frontend
        self.metadata: Any = None
        self.request: Any = None
        self._channels: list[grpc.aio.Channel] = []
        self._checked_response = False
        self.runs = 0                       # runs started (a rate search cools down between them)
        self.current: RunState | None = None    # the run in progress, or the last one

    async def __aenter__(self) -> "LoadClient":
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        if self.n_channels > 1:
            # Without a local subchannel pool, channels to one target share one TCP connection.
            options.append(("grpc.use_local_subchannel_pool", 1))
        target = self.addresses[0]
        if len(self.addresses) > 1:
            target = "ipv4:" + self.address
            options += [*grpc_util.CHANNEL_OPTIONS, *BALANCED_OPTIONS]
        if self.root_certificates is not None:
            tls = grpc.ssl_channel_credentials(root_certificates=self.root_certificates)
            self._channels = [grpc.aio.secure_channel(target, tls, options=options) for _ in range(self.n_channels)]
        else:
            self._channels = [grpc.aio.insecure_channel(target, options=options) for _ in range(self.n_channels)]
        try:
            stub = kserve_grpc.GRPCInferenceServiceStub(self._channels[0])
            req = kserve.ModelMetadataRequest(name=self.model, version=self.model_version)
            try:
                self.metadata = await stub.ModelMetadata(req, timeout=self.connect_timeout_s)
            except grpc.aio.AioRpcError as e:
                raise self._metadata_error(e) from None
            self.request = build_request(
                self.metadata,
                model=self.model,
                batch=self.batch,
                rng=np.random.default_rng(self.seed),
                model_version=self.model_version,
                input_shapes=self.input_shapes,
            )
            for ch in self._channels[1:]:
                try:
                    await asyncio.wait_for(ch.channel_ready(), self.connect_timeout_s)
                except asyncio.TimeoutError:
                    raise BenchError(f"cannot open {self.n_channels} channels to {self.address}") from None
        except BaseException:
            await self.close()
            raise

    def _metadata_error(self, e: grpc.aio.AioRpcError) -> BenchError:
        code, details = e.code(), (e.details() or "").strip()
        if code == grpc.StatusCode.NOT_FOUND:
            return BenchError(f"unknown model {self.model!r} at {self.address}: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return BenchError(f"cannot reach the frontend at {self.address}: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return BenchError(
                f"the frontend at {self.address} did not answer within {self.connect_timeout_s:g} s"
            )
        return BenchError(f"ModelMetadata({self.model!r}) at {self.address} failed: {code.name}: {details}")

    async def close(self) -> None:
        channels, self._channels = self._channels, []
        for ch in channels:
            await ch.close()

    def _request_for(self, slo_ms: float) -> Any:
        req = kserve.ModelInferRequest()
        req.CopyFrom(self.request)
        if self.timeout_param:
            req.parameters["timeout"].int64_param = max(1, int(round(slo_ms * 1000)))
        return req

    def call_path(self, slo_ms: float) -> tuple[Any, list[Callable]]:
        """The request payload and one ModelInfer callable per channel, as :meth:`run` sends them."""
        message = self._request_for(slo_ms)
        if self.raw:
            # Serialized once; identity (de)serializers: a call moves bytes, no protobuf work.
            return message.SerializeToString(), [ch.unary_unary(MODEL_INFER) for ch in self._channels]
        return message, [kserve_grpc.GRPCInferenceServiceStub(ch).ModelInfer for ch in self._channels]

    async def run(
        self,
        rate_rps: float,
        duration_s: float,
        slo_ms: float,
        *,
        warmup_s: float = 0.0,
        grace_ms: float | None = None,
        concurrency_limit: int | None = None,
        seed: int | None = None,
        progress: bool = False,
        cv: float = 1.0,
        stop: threading.Event | None = None,
        arrivals: np.ndarray | None = None,
    ) -> BenchReport:
        """One open-loop phase: arrivals at ``rate_rps`` for ``warmup_s + duration_s`` (Poisson, or Gamma
        gaps with coefficient of variation ``cv``), or at the given ``arrivals`` (sorted offsets in
        seconds within ``warmup_s + duration_s``: a trace whose rate changes; ``rate_rps`` is then its
        mean, as reported). Once ``stop`` is set (from any thread) no further request is sent; the
        report then covers the requests sent, over the time they took to send."""
        if not self._channels or self.request is None:
            raise BenchError("LoadClient.run() before open()")
        _check_run_args(rate_rps, duration_s, slo_ms, warmup_s, grace_ms, concurrency_limit, cv)
        grace_ms = default_grace_ms(slo_ms) if grace_ms is None else float(grace_ms)
        timeout_s = (slo_ms + grace_ms) / 1000.0
        if arrivals is None:
            rng = np.random.default_rng(self.seed if seed is None else seed)
            arrivals = arrival_times(rate_rps, warmup_s + duration_s, rng, cv=cv)
        else:
            arrivals = np.asarray(arrivals, dtype=float)
            if len(arrivals) and (arrivals[0] < 0 or np.any(np.diff(arrivals) < 0)):
                raise BenchError("arrivals must be sorted offsets of at least 0 s")
        n = len(arrivals)
        st = RunState(n, slo_ms)
        st.sched_s = arrivals
        self.current = st

        payload, calls = self.call_path(slo_ms)
        self.runs += 1

        bar = None
        if progress:
            from tqdm import tqdm  # lazy: tqdm costs ~20 ms at start-up (nexus --help imports this module)

            bar = tqdm(
                total=n,
                desc=f"bench {self.model} @ {rate_rps:g} rps",
                unit="req",
                leave=True,
                dynamic_ncols=True,
                mininterval=0.2,
            )
            ticker = asyncio.ensure_future(self._progress(st, bar))
        try:
            await self._drive(st, arrivals, calls, payload, timeout_s, concurrency_limit, stop)
        finally:
            if bar is not None:
                ticker.cancel()
                try:
                    await ticker
                except asyncio.CancelledError:
                    pass
                bar.set_postfix(_postfix(st), refresh=False)
                bar.update(st.finished - bar.n)
                bar.close()

        k = st.sent
        if k < n:  # stopped early: the window is what was sent
            duration_s = max(float(arrivals[k - 1]) - warmup_s, 1e-9) if k else 1e-9
        samples = BenchSamples(
            sched_s=arrivals[:k],
            lag_s=st.lag_s[:k],
            latency_ms=st.latency_ms[:k],
            outcome=st.outcome[:k],
            status=st.status[:k],
            warmup_s=float(warmup_s),
            slo_ms=float(slo_ms),
            done_s=st.done_s[:k],
            start_s=st.start_s,
            timeout_ms=timeout_s * 1000.0,
        )
        return build_report(
            samples,
            model=self.model,
            address=self.address,
            offered_rps=rate_rps,
            duration_s=duration_s,
            batch=self.batch,
            timeout_ms=timeout_s * 1000.0,
            channels=self.n_channels,
            first_error=st.first_error,
        )

    async def _progress(self, st: RunState, bar: Any) -> None:
        while True:
            await asyncio.sleep(0.25)
            bar.set_postfix(_postfix(st), refresh=False)
            bar.update(st.finished - bar.n)

    async def _drive(
        self,
        st: RunState,
        arrivals: np.ndarray,
        calls: list[Callable],
        payload: Any,
        timeout_s: float,
        limit: int | None,
        stop: threading.Event | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        clock = loop.time
        start = clock() + 0.002
        st.start_s = start
        stopped = stop.is_set if stop is not None else (lambda: False)
        sched = (arrivals + start).tolist()
        n = len(sched)
        nch = len(calls)
        lag = st.lag_s
        one = self._one
        perf_counter = time.perf_counter
        tasks = st.tasks
        discard = tasks.discard
        i = 0
        try:
            while i < n and not stopped():
                now = clock()
                if sched[i] > now:
                    await asyncio.sleep(min(sched[i] - now, 0.1))
                    continue
                # Send everything that is due; never wait for responses.
                while i < n and sched[i] <= now:
                    lag[i] = now - sched[i]
                    if limit is not None and st.inflight >= limit:
                        st.outcome[i] = CLIENT_DROPPED
                        st.status[i] = CLIENT_LIMIT_STATUS
                        st.dropped += 1
                        st.finished += 1
                    else:
                        st.inflight += 1
                        t0 = perf_counter()
                        # The call (and its deadline) starts here, not when the task first runs.
                        task = loop.create_task(one(st, i, calls[i % nch](payload, timeout=timeout_s), t0))
                        tasks.add(task)
                        task.add_done_callback(discard)
                    i += 1
                st.sent = i
                await asyncio.sleep(0)  # let the new calls start even when behind schedule
            st.sending = False
            if st.inflight:
                st.idle.clear()
                try:
                    await asyncio.wait_for(st.idle.wait(), timeout_s + 10.0)
                except asyncio.TimeoutError:
                    pass  # gRPC deadlines make this unreachable; leftovers are counted as failed
        finally:
            st.sending = False
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _one(self, st: RunState, i: int, call: Any, t0: float) -> None:
        clock = asyncio.get_running_loop().time
        try:
            response = await call
        except grpc.aio.AioRpcError as e:
            code = e.code()
            st.status[i] = code.value[0]
            if code.name in DROP_CODES:
                st.outcome[i] = DROPPED
                st.dropped += 1
            else:
                st.outcome[i] = FAILED
                st.failed += 1
            if code.name not in st.examples:
                st.examples[code.name] = (e.details() or "").strip()
                if st.first_error is None:
                    st.first_error = f"{code.name}: {st.examples[code.name]}"
        except asyncio.CancelledError:
            st.status[i] = grpc.StatusCode.CANCELLED.value[0]
            st.outcome[i] = FAILED
            st.failed += 1
            raise
        except Exception as e:  # noqa: BLE001 - anything else is a failed request, not a crash
            st.status[i] = _UNKNOWN
            st.outcome[i] = FAILED
            st.failed += 1
            if st.first_error is None:
                st.first_error = f"{type(e).__name__}: {e}"
        else:
            ms = (time.perf_counter() - t0) * 1000.0
            if not self._checked_response and not self._check_response(response, st, i):
                return
            st.latency_ms[i] = ms
            st.outcome[i] = OK
            st.status[i] = 0
            st.ok += 1
            if ms > st.slo_ms:
                st.late += 1
        finally:
            st.done_s[i] = clock() - st.start_s
            st.inflight -= 1
            st.finished += 1
            if not st.inflight and not st.sending:
                st.idle.set()

    def _check_response(self, response: Any, st: RunState, i: int) -> bool:
        """Parse the first successful response once (raw mode) to catch a server answering junk."""
        try:
            msg = kserve.ModelInferResponse.FromString(response) if self.raw else response
            if not msg.outputs:
                raise ValueError("the response has no outputs")
        except Exception as e:  # noqa: BLE001
            st.status[i] = _UNKNOWN
            st.outcome[i] = FAILED
            st.failed += 1
            if st.first_error is None:
                st.first_error = f"bad ModelInferResponse: {e}"
            return False
        self._checked_response = True
        return True


# Keywords of LoadClient other than the address and the model (find_max_rate passes them on).
_CLIENT_OPTIONS = frozenset(inspect.signature(LoadClient).parameters) - {"address", "model", "seed"}


def _postfix(st: RunState) -> dict[str, int]:
    return {"good": st.ok - st.late, "late": st.late, "drop": st.dropped, "fail": st.failed, "inflight": st.inflight}


def _check_run_args(
    rate_rps: float,
    duration_s: float,
    slo_ms: float,
    warmup_s: float,
    grace_ms: float | None,
    concurrency_limit: int | None,
    cv: float = 1.0,
) -> None:
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise BenchError(f"--rate must be > 0, got {rate_rps}")
    if not (duration_s > 0 and math.isfinite(duration_s)):
        raise BenchError(f"--duration-s must be > 0, got {duration_s}")
    if not (slo_ms > 0 and math.isfinite(slo_ms)):
        raise BenchError(f"--slo-ms must be > 0, got {slo_ms}")
    if not (warmup_s >= 0 and math.isfinite(warmup_s)):
        raise BenchError(f"--warmup-s must be >= 0, got {warmup_s}")
    if grace_ms is not None and not (grace_ms >= 0 and math.isfinite(grace_ms)):
        raise BenchError(f"--grace-ms must be >= 0, got {grace_ms}")
    if concurrency_limit is not None and concurrency_limit < 1:
        raise BenchError(f"--concurrency-limit must be >= 1, got {concurrency_limit}")
    if not (cv >= 0 and math.isfinite(cv)):
        raise BenchError(f"the arrivals' coefficient of variation must be >= 0, got {cv}")


async def run_bench_async(
    address: str | Sequence[str],
    model: str,
    rate_rps: float,
    duration_s: float,
    slo_ms: float,
    *,
    warmup_s: float = 0.0,
    seed: int = 0,
    concurrency_limit: int | None = None,
    grace_ms: float | None = None,
    progress: bool = False,
    cv: float = 1.0,
    **client_options: Any,
) -> BenchReport:
    """Open-loop load at ``rate_rps`` against ``model`` at ``address``; see :class:`BenchReport`.

    ``client_options`` are those of :class:`LoadClient` (``batch``, ``channels``, ``raw``, ...).
    Raises :class:`BenchError` when the run cannot start (bad arguments, unreachable frontend,
    unknown model). Request failures during the run are counted, never raised.
    """
    _check_run_args(rate_rps, duration_s, slo_ms, warmup_s, grace_ms, concurrency_limit, cv)
    async with LoadClient(address, model, seed=seed, **client_options) as client:
        return await client.run(
            rate_rps,
            duration_s,
            slo_ms,
            warmup_s=warmup_s,
            grace_ms=grace_ms,
            concurrency_limit=concurrency_limit,
            progress=progress,
            cv=cv,
        )


def run_bench(address: str, model: str, rate_rps: float, duration_s: float, slo_ms: float, **kwargs: Any) -> BenchReport:
    """Blocking :func:`run_bench_async` (runs its own event loop; call the async one from a loop)."""
    return asyncio.run(run_bench_async(address, model, rate_rps, duration_s, slo_ms, **kwargs))


async def search_rate(
    client: LoadClient,
    slo_ms: float,
    lo: float,
    *,
    target_good_fraction: float = 0.99,
    step_duration_s: float | Callable[[float], float] = 5.0,
    warmup_s: float = 1.0,
    cooldown_s: float = 0.5,
    seed: int = 0,
    grace_ms: float | None = None,
    concurrency_limit: int | None = None,
    progress: bool = False,
    on_step: Callable[[BenchReport], None] | None = None,
    **search: Any,
) -> tuple[float, list[BenchReport]]:
    """The largest rate at which at least ``target_good_fraction`` of requests finish within the SLO,
    with open-loop steps of ``client`` (open), searched by :func:`common.rate_search.rate_steps`
    from ``lo`` (``search``: its keywords ``hi``, ``growth``, ``max_rate``, ``floor``, ``rel_tol``,
    ``refine``, ``max_steps``).

    Each step runs ``step_duration_s`` (a number, or a function of the rate) after ``warmup_s`` of
    unmeasured load, ``cooldown_s`` after the client's previous run, with seed ``seed`` plus its
    index. Returns (best passing rate, or 0.0; every step's report in order). Reports whose
    ``client_lag_ms`` is large measured the client, not the server.
    """
    if not 0.0 < target_good_fraction <= 1.0:
        raise BenchError(f"target_good_fraction must be in (0, 1], got {target_good_fraction}")
    reports: list[BenchReport] = []

    async def passes(rate: float) -> bool:
        if client.runs and cooldown_s > 0:
            await asyncio.sleep(cooldown_s)  # let the server drain what the last run left
        duration = step_duration_s(rate) if callable(step_duration_s) else step_duration_s
        r = await client.run(
            rate,
            duration,
            slo_ms,
            warmup_s=warmup_s,
            grace_ms=grace_ms,
            concurrency_limit=concurrency_limit,
            seed=seed + len(reports),
            progress=progress,
        )
        reports.append(r)
        if on_step is not None:
            on_step(r)
        return r.sent > 0 and r.good_fraction >= target_good_fraction

    try:
        best = await max_passing_rate_async(passes, lo, **search)
    except ValueError as e:
        raise BenchError(str(e)) from None
    return best, reports


async def find_max_rate_async(address: str | Sequence[str], model: str, slo_ms: float,
                              target_good_fraction: float = 0.99, lo: float = 10.0, hi: float | None = None,
                              step_duration_s: float = 5.0, *, rel_tol: float = 0.05, max_steps: int | None = 12,
                              seed: int = 0, **options: Any) -> tuple[float, list[BenchReport]]:
    """:func:`search_rate` on a client of its own: ``lo`` first, then without ``hi`` doubling until a
    step fails, with ``hi`` that rate itself, then bisection to ``rel_tol`` within ``max_steps``.

    ``options`` are those of :class:`LoadClient` (``batch``, ``channels``, ...) and of
    :func:`search_rate` (``warmup_s``, ``cooldown_s``, ``on_step``, ``growth``, ...). Returns (best
    passing rate, or 0.0 if ``lo`` fails; every step's report in order).
    """
    if not lo > 0 or (hi is not None and hi <= lo):
        raise BenchError(f"need 0 < lo < hi, got lo={lo}, hi={hi}")
    if max_steps is not None and max_steps < 1:
        raise BenchError("max_steps must be >= 1")
    client_options = {k: options.pop(k) for k in list(options) if k in _CLIENT_OPTIONS}
    async with LoadClient(address, model, seed=seed, **client_options) as client:
        return await search_rate(client, slo_ms, lo, target_good_fraction=target_good_fraction,
                                 step_duration_s=step_duration_s, seed=seed, hi=hi, rel_tol=rel_tol,
                                 max_steps=max_steps, **options)


def find_max_rate(address: str | Sequence[str], model: str, slo_ms: float, target_good_fraction: float = 0.99,
                  lo: float = 10.0, hi: float | None = None, step_duration_s: float = 5.0,
                  **kwargs: Any) -> tuple[float, list[BenchReport]]:
    """Blocking :func:`find_max_rate_async`."""
    return asyncio.run(
        find_max_rate_async(address, model, slo_ms, target_good_fraction, lo, hi, step_duration_s, **kwargs)
    )
