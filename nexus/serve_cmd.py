"""``nexus serve``: a whole local cluster (scheduler, a frontend, N backends) as separate processes.

``--backends N`` runs N backends; ``--backends auto`` starts ``--min-backends`` and then as many as
the scheduler's scaling policy wants, within ``--max-backends`` (:mod:`nexus.local_scaler`): a
backend it no longer wants is drained by SIGTERM, one after another, and not restarted. On CPU, auto
runs one backend per core, each with one intra-op thread unless ``--threads`` says otherwise
(benchmarks/elastic.md, "The CPU device under auto", has the measurement behind it). On a CPU
without ``--backends``, ``--threads`` or ``--device-type``, the backends' layout on the cores (one
for the machine, or one per core) is ``--cpu-layout``'s, by default chosen from the models' measured
profiles and rates (:mod:`nexus.cpu_layout`, :mod:`nexus.cpu_layout_switch`).

The sample models are built in code into the data directory, uploaded on first start, profiled by
a backend on demand, and served. The children are started by :mod:`nexus.launcher` from their
config dataclasses: every component flag of ``nexus serve`` is derived from ``SchedulerConfig``,
``BackendConfig`` (shared by every backend) and ``FrontendConfig`` (as ``--frontend-*``), with the
components' own defaults. ``nexus serve`` supervises them: a child that dies is restarted with
exponential backoff and the cluster keeps serving on the others; only Ctrl-C or SIGTERM stops
everything: SIGINT and SIGTERM, however this process was started (also where a script's background
job inherited SIGINT ignored). The children run in sessions of their own, so a signal to this
process's group reaches only this process, which stops them in order (frontend, backends, then the
scheduler that the backends leave the plan through), restarts none of them on the way down, and
confirms the stop in one last line. Children also die with this process if it is killed
(PR_SET_PDEATHSIG). They log warnings and errors only unless ``--log-level`` (or ``$NEXUS_LOG``)
says otherwise; this command prints what an operator needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import functools
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
from typing import Callable, Iterable, Mapping

import grpc

from common import grpc_util
from common.config import BackendConfig, ConfigError, FrontendConfig, SchedulerConfig, SecurityConfig, add_arguments, \
    from_args, join_host_port
from common.emulated_gpus import UnknownGpuError, check_device
from common.host_load import CLUSTER_PID_ENV
from common.sample_queries import SAMPLE_QUERIES, sample_query_json
from common.security import TOKEN_ENV, Credentials, SecurityError, ensure_token_file
from common.pb import control, kserve, kserve_grpc
from nexus.client_flags import SERVE_DATA_DIR
from nexus.cpu_layout import CpuLayout, LayoutShape, layout_shapes
from nexus.cpu_layout_switch import CpuLayoutSwitch, measure_on_backend
from nexus.launcher import Child, Supervisor, launch, pin_listen
from nexus.local_scaler import LocalScaler
from nexus.process import READY_PREFIX
from nexus.repository_cmd import read_checked, upload_repository
from nexus.scheduler_client import AdminCallError, StatusReader, add_profile, fetch_status, list_models, list_queries, \
    register_query, upload_model

__all__ = ["Child", "wait_models_ready", "register", "run"]

# Component fields that `nexus serve` sets itself (addresses, the data directory) or that make no
# sense for several processes at once (one metrics port); every other field is a flag of `nexus serve`.
SCHEDULER_OWN = ("listen", "advertise", "data_dir", "security")
BACKEND_OWN = ("scheduler", "listen", "advertise", "metrics_port", "security")
FRONTEND_OWN = ("scheduler", "listen", "advertise", "security", "metrics_listen", "http_listen",
                "worker_control_listen", "worker_siblings")
FRONTEND_PREFIX = "frontend"
DRAIN_KILL_MARGIN_S = 10.0      # a backend removed by --backends auto is killed this long after its drain grace
SUPERVISE_S = 0.2               # how often the children are checked (and the scaler, at most its own poll apart)


def wait_models_ready(frontend: str, names: list[str], timeout_s: float,
                      creds: Credentials = grpc_util.NO_CREDENTIALS,
                      unservable: Callable[[], Mapping[str, str]] | None = None,
                      given_up: dict[str, str] | None = None) -> list[str]:
    """Poll the frontend until every model is ready; return those still not ready at the timeout.

    ``unservable()`` names models that cannot be served at all, with why (see
    :func:`unservable_models`): they are waited for no longer and go into ``given_up``."""
    deadline = time.monotonic() + timeout_s
    pending = list(names)
    with grpc_util.channel(frontend, creds) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        while pending and time.monotonic() < deadline:
            hopeless = unservable() if unservable is not None else {}
            still = []
            for name in pending:
                if name in hopeless:
                    if given_up is not None:
                        given_up[name] = hopeless[name]
                    continue
                try:
                    if not stub.ModelReady(kserve.ModelReadyRequest(name=name), timeout=5).ready:
                        still.append(name)
                except grpc.RpcError:
                    still.append(name)
            pending = still
            if pending:
                time.sleep(0.3)
    return pending


SIGNAL_RETRY_S = 0.05


def interrupts_popen(frame) -> bool:
    """Whether the frame a signal interrupted runs the standard library's subprocess code."""
    return frame is not None and frame.f_code.co_filename == subprocess.__file__


class StartPhases:
    """How long each phase of the start took, for the banner: a start that is not quick says where
    its time went (issue 26: the first start profiles every sample model)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.began = self.last = clock()
        self.phases: list[tuple[str, float]] = []

    def done(self, phase: str) -> None:
        now = self.clock()
        self.phases.append((phase, now - self.last))
        self.last = now

    def describe(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f}" for name, seconds in self.phases)
        return f"{self.last - self.began:.1f} s" + (f" ({parts})" if parts else "")


def unservable_models(models: Iterable[control.ModelDesc]) -> dict[str, str]:
    """Models no registered device type can serve (their serving state is FAILED), with why."""
    return {m.name: m.state_reason for m in models if m.serving_state == control.FAILED}


def children_log_level(args) -> str:
    """The children's log level: ``--log-level``, else ``$NEXUS_LOG``, else WARNING (their INFO lines
    are the components' chatter; this command prints what an operator needs)."""
    return (args.log_level or os.environ.get("NEXUS_LOG", "") or "WARNING").upper()


def _log(message: str) -> None:
    print(f"nexus serve: {message}", file=sys.stderr, flush=True)


def cluster_security(args, data_dir: pathlib.Path) -> tuple[SecurityConfig, Credentials]:
    """The security settings every child gets, and the credentials of serve's own calls.

    The cluster token: ``--token-file``, else ``$NEXUS_TOKEN`` (the children inherit it), else
    ``<data-dir>/token``, created with mode 0600 at first start. TLS: the children serve with
    ``--tls-cert``/``--tls-key`` and verify each other against ``--tls-ca`` (mutual TLS)."""
    if args.tls_cert and not args.tls_ca:
        raise ConfigError("--tls-cert needs --tls-ca: the CA that signed it, which the components verify "
                          "each other against")
    token_file = args.token_file
    if not token_file and not os.environ.get(TOKEN_ENV, "").strip():
        token_file = str(data_dir / "token")
        ensure_token_file(pathlib.Path(token_file))
    config = SecurityConfig(tls_cert=_abs(args.tls_cert), tls_key=_abs(args.tls_key), tls_ca=_abs(args.tls_ca),
                            token_file=_abs(token_file))
    config.validate()
    creds = Credentials.load(config)
    # serve dials as a client: it verifies against the CA and needs no certificate of its own.
    return config, Credentials(ca=creds.ca, token=creds.token)


def _client_flags(security: SecurityConfig) -> list[str]:
    """The flags an admin command needs to reach this cluster (the CA and the token file)."""
    return [f"{flag} {value}" for flag, value in (("--tls-ca", security.tls_ca), ("--token-file", security.token_file))
            if value]


def _abs(path: str) -> str:
    return str(pathlib.Path(path).resolve()) if path else ""


def configs(args, security: SecurityConfig = SecurityConfig()) -> tuple[SchedulerConfig, BackendConfig, FrontendConfig]:
    """The three components' configurations from ``nexus serve``'s flags (scheduler address left to fill)."""
    data_dir = pathlib.Path(args.data_dir).resolve()
    scheduler = from_args(SchedulerConfig, args, listen=f"127.0.0.1:{args.scheduler_port}", data_dir=data_dir / "db",
                          security=security)
    # a scheduler on any free port takes any free metrics port too: pinned as such, so its restart keeps it
    scheduler = dataclasses.replace(scheduler, metrics_listen=scheduler.resolved_metrics_listen)
    backend = from_args(BackendConfig, args, scheduler=scheduler.listen, listen="127.0.0.1:0", security=security)
    frontend = from_args(FrontendConfig, args, prefix=FRONTEND_PREFIX, scheduler=scheduler.listen, security=security,
                         listen=join_host_port(args.host, args.frontend_port),
                         metrics_listen=join_host_port(args.host, args.serve_metrics_port),
                         http_listen=join_host_port(args.host, args.serve_http_port))
    return scheduler, backend, frontend


AUTO = "auto"
EMULATED_MAX_BACKENDS = 8       # --max-backends default on emulated GPUs (on CPU: one per core)


def backends_arg(text: str) -> str | int:
    """``--backends``: a count of at least 0, or ``auto``."""
    if text == AUTO:
        return AUTO
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of backends (0 or more) or 'auto', got {text!r}")
    return n


class CpuLayoutChoice(str, enum.Enum):
    """``--cpu-layout``: a fixed layout, or the one the measurements choose."""

    MACHINE = CpuLayout.MACHINE.value
    PER_CORE = CpuLayout.PER_CORE.value
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value


def cpu_layout(args, backend: BackendConfig) -> CpuLayoutChoice | None:
    """The CPU layout ``nexus serve`` runs (None: the backends are as ``--backends``/``--threads`` say):
    ``--cpu-layout`` once checked against the flags it replaces, else auto on a CPU when none of them
    is given; ConfigError."""
    fixed = [flag for flag, given in (("--backends", args.backends is not None), ("--threads", backend.threads != 0),
                                      ("--device-type", bool(backend.device_type))) if given]
    if args.cpu_layout is None:
        return CpuLayoutChoice.AUTO if backend.device == "cpu" and not fixed else None
    if backend.device != "cpu":
        raise ConfigError(f"--cpu-layout lays backends out on the machine's cores (--device cpu), not on "
                          f"{backend.device}")
    if fixed:
        raise ConfigError(f"--cpu-layout sets the backends, their threads and device types; drop {fixed[0]}")
    return args.cpu_layout


@dataclasses.dataclass(frozen=True)
class AutoBackends:
    """``--backends auto``: how many backends of which device type, and how each runs."""

    device_type: str
    low: int
    high: int


def auto_backends(args, backend: BackendConfig) -> AutoBackends | None:
    """The bounds of ``--backends auto`` (None with a fixed count); ConfigError for bad ones."""
    if args.backends != AUTO:
        for flag, value in (("--min-backends", args.min_backends), ("--max-backends", args.max_backends)):
            if value is not None:
                raise ConfigError(f"{flag} needs --backends auto (with --backends N the count is fixed)")
        return None
    if backend.device.startswith("cuda"):
        raise ConfigError("--backends auto starts backends on cpu or emulated:<gpu>; on a machine's GPUs run one "
                          "`nexus backend --device cuda:N` per GPU (or use the Kubernetes autoscaler)")
    for name in ("min_devices", "max_devices"):
        if getattr(args, name) != _scheduler_default(name):
            raise ConfigError(f"--{name.replace('_', '-')} with --backends auto: use --min-backends/--max-backends "
                              f"(they set the scheduler's bounds for the device type serve runs)")
    low = 1 if args.min_backends is None else args.min_backends
    default_high = len(os.sched_getaffinity(0)) if backend.device == "cpu" else EMULATED_MAX_BACKENDS
    high = max(default_high, low) if args.max_backends is None else args.max_backends
    if low < 1:
        raise ConfigError(f"--min-backends: must be at least 1 (a device type without a backend is planned for "
                          f"none), got {low}")
    if high < low:
        raise ConfigError(f"--max-backends {high} is below --min-backends {low}")
    return AutoBackends(backend.resolved_device_type, low, high)


def _scheduler_default(name: str):
    return next(f.default for f in dataclasses.fields(SchedulerConfig) if f.name == name)


def run(args) -> int:
    # lazy: common.sample_models imports onnx (~30 ms at start-up); nexus --help imports this module
    from common.sample_models import SAMPLE_MODELS, write_sample_models

    try:
        _, backend_flags, _ = configs(args)       # bad flags are refused before anything is created
        auto = auto_backends(args, backend_flags)
        layout = cpu_layout(args, backend_flags)
        check_device(args.device)
    except ConfigError as exc:
        print(f"nexus serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except UnknownGpuError as exc:
        print(f"nexus serve: error: --device: {exc}", file=sys.stderr, flush=True)
        return 2
    repository = []
    if args.model_repository:
        repository = read_checked(args.model_repository, "nexus serve")
        if repository is None:
            return 2
    data_dir = pathlib.Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        security, creds = cluster_security(args, data_dir)
        sched_cfg, backend_cfg, frontend_cfg = configs(args, security)
        if auto is not None:
            # the policy's bounds for the type are serve's; one CPU backend per core, one thread each
            sched_cfg = dataclasses.replace(sched_cfg, min_devices=f"{auto.device_type}={auto.low}",
                                            max_devices=f"{auto.device_type}={auto.high}")
            if backend_cfg.device == "cpu" and backend_cfg.threads == 0:
                backend_cfg = dataclasses.replace(backend_cfg, threads=1)
    except (ConfigError, SecurityError) as exc:
        print(f"nexus serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    # the children count one another as the cluster's own work, not as other work (common/host_load.py)
    env = dict(os.environ, PYTHONUNBUFFERED="1", NEXUS_LOG=children_log_level(args), **{CLUSTER_PID_ENV: str(os.getpid())})
    supervisor = Supervisor(_log)

    def stop(signum, frame):
        if supervisor.stopping:           # a second signal: every child stops at once
            supervisor.signal_all(signal.SIGTERM)
            return
        if interrupts_popen(frame):
            # Popen may hold its waitpid lock here, outside the try that releases it: an exception
            # would leak the lock, and the stop would then wait for a child forever. Again in a moment.
            threading.Timer(SIGNAL_RETRY_S, os.kill, (os.getpid(), signum)).start()
            return
        supervisor.stopping = True        # from now on a child that exits is not restarted
        raise KeyboardInterrupt

    # Both signals stop the cluster, also where SIGINT was inherited ignored (a script's background
    # job). The children run in sessions of their own: a signal to this process's group (Ctrl-C)
    # reaches only this process, which stops them in order (frontend, backends, then the scheduler
    # they leave the plan through).
    handlers = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    start = functools.partial(launch, env=env, start_new_session=True)
    phases = StartPhases()
    layout_switch = None
    decisions: StatusReader | None = None       # the scaler's reads of GetStatus, on a kept channel
    try:
        scheduler = supervisor.add(start(sched_cfg))
        # built while the scheduler starts (each takes about a second on a small machine)
        paths = write_sample_models(data_dir / "samples") if not args.no_samples else {}
        phases.done("building the sample models")
        sched_addr = scheduler.wait_ready(60)
        phases.done("scheduler")
        # a restarted scheduler comes back where the nodes and scrapers look
        scheduler_metrics = scheduler.info.get("metrics", "")
        pin_listen(scheduler, sched_cfg, metrics_listen=urllib.parse.urlsplit(scheduler_metrics).netloc)
        names = []
        if not args.no_samples:
            known = {m.name for m in list_models(sched_addr, creds)}
            for name, path in paths.items():
                names.append(name)
                if name not in known:
                    upload_model(sched_addr, path, name, slo_ms=SAMPLE_MODELS[name].slo_ms, creds=creds)
            known_queries = {q.name for q in list_queries(sched_addr, creds)}
            for name in SAMPLE_QUERIES:
                if name not in known_queries:
                    register_query(sched_addr, sample_query_json(name), creds)
                names.append(name)
            phases.done("storing them")
        if repository:
            upload_repository(sched_addr, repository, creds=creds)
            names += [name for name in dict.fromkeys(m.name for m in repository) if name not in names]
        names += [m.name for m in list_models(sched_addr, creds) if m.loaded and m.name not in names]
        backend_cfg = dataclasses.replace(backend_cfg, scheduler=sched_addr)
        cores = len(os.sched_getaffinity(0))
        shapes = layout_shapes(cores)
        running = CpuLayout.MACHINE if layout in (None, CpuLayoutChoice.AUTO) else CpuLayout(layout.value)

        def start_shape(shape: LayoutShape, name: str) -> Child:
            return start(dataclasses.replace(backend_cfg, threads=shape.threads, device_type=shape.device_type), name)

        if layout is not None:
            first = [supervisor.add(start_shape(shapes[running], f"backend-{i}"))
                     for i in range(shapes[running].devices)]
        else:
            first = [supervisor.add(start(backend_cfg, f"backend-{i}"))
                     for i in range(auto.low if auto is not None else 1 if args.backends is None else args.backends)]
        frontend_cfg = dataclasses.replace(frontend_cfg, scheduler=sched_addr)
        frontend = supervisor.add(start(frontend_cfg))
        scaler = None
        if layout is CpuLayoutChoice.AUTO:
            layout_switch = CpuLayoutSwitch(
                supervisor, start_shape, shapes, running, first, functools.partial(fetch_status, sched_addr, 5.0, creds),
                functools.partial(list_models, sched_addr, creds), measure_on_backend(creds),
                lambda name, version, profile: add_profile(sched_addr, name, profile, version, creds), _log, cores=cores,
                drain_timeout_s=backend_cfg.drain_grace_s + DRAIN_KILL_MARGIN_S, stop_after=frontend,
                frontends=[frontend])
        if auto is not None:
            decisions = StatusReader(sched_addr, 5.0, creds, scaling_only=True)
            scaler = LocalScaler(supervisor, functools.partial(start, backend_cfg), auto.device_type,
                                 (auto.low, auto.high), decisions, _log,
                                 drain_timeout_s=backend_cfg.drain_grace_s + DRAIN_KILL_MARGIN_S, stop_after=frontend)
            for child in first:
                scaler.add(child)
        for c in supervisor.children[1:]:
            c.wait_ready(120)
        phases.done("backends and frontend")
        http_address = frontend.info.get("http", "")
        metrics_url = frontend.info.get("metrics", "")
        # clients keep the frontend's addresses across restarts, also those it was given port 0 for
        pin_listen(frontend, frontend_cfg, http_listen=http_address,
                   metrics_listen=urllib.parse.urlsplit(metrics_url).netloc)
        for c in supervisor.children:
            _log(f"{c.name} started (pid {c.proc.pid}) at {c.address}")
        if names:
            _log(f"waiting for {len(names)} models and queries to be profiled and placed "
                 f"(at most {args.ready_timeout_s:.0f} s)")
        unserved: dict[str, str] = {}
        missing = wait_models_ready(frontend.address, names, args.ready_timeout_s, creds,
                                    lambda: unservable_models(list_models(sched_addr, creds)), unserved)
        if names:
            profiled = sum(any(st.stage == "profiled" for st in m.ready_stages) for m in list_models(sched_addr, creds))
            phases.done(f"profiling {profiled} models on their first start (profiles are kept) and placing them"
                        if profiled else "placing, loading and warming up the models")
        for name, why in unserved.items():
            _log(f"warning: {name} cannot be served: {why}")
        if missing:
            _log(f"warning: not ready after {args.ready_timeout_s:.0f} s: {', '.join(missing)}")
        names = [n for n in names if n not in unserved and n not in missing]
        print(f"Nexus is serving on {frontend.address} (KServe v2 gRPC) and http://{http_address} (KServe v2 "
              f"HTTP/REST); scheduler at {sched_addr}", flush=True)
        print(f"  models: {', '.join(names) or '(none)'}", flush=True)
        print(f"  started in {phases.describe()}", flush=True)
        print(f"  metrics: {metrics_url} (Prometheus; the scheduler's, with nexus_desired_devices: "
              f"{scheduler_metrics or 'off'})", flush=True)
        print(f"  admin:  nexus models list --scheduler {sched_addr} {' '.join(_client_flags(security))}".rstrip(),
              flush=True)
        print(f"  try:    nexus bench --frontend {frontend.address} --model resnet18_64 --rate 50 --slo-ms 100",
              flush=True)
        print(f"{READY_PREFIX} serve {frontend.address} {sched_addr} http={http_address} metrics={metrics_url}",
              flush=True)
        if scaler is not None:
            _log(f"backends: auto, {auto.low} to {auto.high} on {args.device} (device type {auto.device_type}), as "
                 f"the scheduler's scaling policy decides")
        if layout is not None:
            _log(f"cpu layout: {running.value} ({shapes[running].devices} backend(s) on {cores} core(s))"
                 + (", switched to the other when the models' measured profiles and rates say it serves more"
                    if layout_switch is not None else ""))
        while True:
            supervisor.check()
            if scaler is not None:
                scaler.step()
            if layout_switch is not None:
                layout_switch.step()
            time.sleep(min(SUPERVISE_S, scaler.poll_s) if scaler is not None else SUPERVISE_S)
    except KeyboardInterrupt:
        status = 0
    except (RuntimeError, AdminCallError) as exc:
        print(f"nexus serve: error: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        if layout_switch is not None:
            layout_switch.close()
        if decisions is not None:
            decisions.close()
        _stop(supervisor, handlers)
    return status


def _stop(supervisor: Supervisor, handlers: dict) -> None:
    """Stop every child in order, put the signal handlers back, and confirm it in one line."""
    try:
        exits = supervisor.stop_all()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    unclean = [f"{name} exited with status {code}" for name, code in exits.items() if code != 0]
    if unclean:
        _log(f"stopped; {', '.join(unclean)}")
    else:
        _log(f"stopped: every process exited cleanly ({', '.join(exits) or 'none started'})")


def register(sub) -> None:
    p = sub.add_parser("serve", help="run a local cluster (scheduler, frontend, backends) on loopback",
                       description="Run a whole local cluster on loopback with the built-in sample models. "
                                   "Components that die are restarted; Ctrl-C or SIGTERM stops them all.")
    p.add_argument("--backends", type=backends_arg, default=None,
                   help="number of backend processes (default: as --cpu-layout says), or 'auto': as many as the scheduler's scaling "
                        "policy wants, between --min-backends and --max-backends (on CPU one per core, --threads 1 "
                        "each unless given)")
    p.add_argument("--cpu-layout", type=CpuLayoutChoice, choices=list(CpuLayoutChoice), default=None,
                   help="on cpu, instead of --backends/--threads: machine (one backend, every core its intra-op "
                        "thread), per-core (one single-thread backend per core, device type cpu-1t) or auto (the "
                        "one the models' measured profiles and rates serve most in, switched make-before-break "
                        "while serving; nexus/cpu_layout.py). Default: auto on cpu unless --backends, --threads "
                        "or --device-type is given")
    p.add_argument("--min-backends", type=int, default=None,
                   help="with --backends auto: backends kept at least (default 1)")
    p.add_argument("--max-backends", type=int, default=None,
                   help=f"with --backends auto: backends started at most (default: one per core on cpu, "
                        f"{EMULATED_MAX_BACKENDS} on emulated GPUs); beyond it the plan folds sessions onto busy "
                        f"backends and `nexus status` says so")
    p.add_argument("--host", default="127.0.0.1", help="frontend host (default 127.0.0.1)")
    p.add_argument("--frontend-port", type=int, default=8001, help="frontend port (0: any free port)")
    # dests apart from the components' fields (BackendConfig.metrics_port is another port)
    p.add_argument("--metrics-port", dest="serve_metrics_port", type=int, default=8002,
                   help="frontend's Prometheus /metrics port (0: any free port)")
    p.add_argument("--http-port", dest="serve_http_port", type=int, default=8000,
                   help="frontend's KServe v2 HTTP/REST port (0: any free port; default 8000)")
    p.add_argument("--scheduler-port", type=int, default=8100, help="scheduler port (0: any free port)")
    p.add_argument("--data-dir", default=SERVE_DATA_DIR, help=f"model database, sample models and the cluster token "
                   f"(default {SERVE_DATA_DIR}, where the admin commands look for the token)")
    p.add_argument("--no-samples", action="store_true", help="do not build and upload the sample models")
    p.add_argument("--model-repository", default="", metavar="DIR",
                   help="also serve the models of a Triton model repository (<name>/config.pbtxt, <name>/1/model.onnx)")
    p.add_argument("--tls-cert", default="", help="PEM certificate every component serves TLS with (with --tls-key, "
                   "--tls-ca); it must name the addresses peers dial, e.g. IP:127.0.0.1")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default="", help="PEM CA that signed --tls-cert: components verify each other "
                   "against it (mutual TLS); clients pass it as --tls-ca or tritonclient's root_certificates")
    p.add_argument("--token-file", default="", help="cluster token guarding registration and admin calls "
                   "(default: $NEXUS_TOKEN, else <data-dir>/token, created with mode 0600 at first start)")
    p.add_argument("--ready-timeout-s", type=float, default=180.0)
    p.add_argument("--log-level", default="", help="the components' log level: DEBUG, INFO, WARNING "
                   "(default: $NEXUS_LOG, else WARNING)")
    add_arguments(p.add_argument_group("scheduler (as `nexus scheduler`)"), SchedulerConfig, skip=SCHEDULER_OWN)
    add_arguments(p.add_argument_group("every backend (as `nexus backend`)"), BackendConfig, skip=BACKEND_OWN)
    add_arguments(p.add_argument_group("the frontend (`nexus frontend`'s flags, prefixed --frontend-)"),
                  FrontendConfig, skip=FRONTEND_OWN, prefix=FRONTEND_PREFIX)
    p.set_defaults(func=run)
