"""``nexus serve``: a whole local cluster (scheduler, a frontend, N backends) as separate processes.

The sample models are built in code into the data directory, uploaded on first start, profiled by
a backend on demand, and served. Ctrl-C or SIGTERM stops every child; children also die with this
process if it is killed (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

import grpc

from common.config import BatchStart, ConfigError, SchedulerConfig, SecurityConfig, join_host_port, to_argv
from common import grpc_util
from common.security import TOKEN_ENV, Credentials, SecurityError, ensure_token_file
from common.pb import kserve, kserve_grpc
from nexus.process import READY_PREFIX

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Child:
    """One ``nexus ARGV...`` process (``command`` replaces ``python -m nexus``) that dies with this
    one; :meth:`wait_ready` returns the address from its ready line."""

    def __init__(self, name: str, argv: list[str], env: dict, *, command: list[str] | None = None,
                 stderr=None, cwd=None, start_new_session: bool = False) -> None:
        self.name = name
        self.proc = subprocess.Popen([*(command or [sys.executable, "-m", "nexus"]), *argv], stdout=subprocess.PIPE,
                                     stderr=stderr, env=env, cwd=cwd, preexec_fn=_die_with_parent,
                                     start_new_session=start_new_session, text=True, bufsize=1)
        self.address = ""
        self.info: dict[str, str] = {}      # key=value words of its ready line (metrics=URL, http=HOST:PORT)
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before it was ready")
                continue
            if line.startswith(READY_PREFIX):
                words = line.split()
                self.address = words[2]
                self.info = dict(w.split("=", 1) for w in words[3:] if "=" in w)
                return self.address
        raise RuntimeError(f"{self.name} was not ready within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_models_ready(frontend: str, names: list[str], timeout_s: float,
                      creds: Credentials = grpc_util.NO_CREDENTIALS) -> list[str]:
    """Poll the frontend until every model is ready; return those still not ready at the timeout."""
    deadline = time.monotonic() + timeout_s
    pending = list(names)
    with grpc_util.channel(frontend, creds) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        while pending and time.monotonic() < deadline:
            still = []
            for name in pending:
                try:
                    if not stub.ModelReady(kserve.ModelReadyRequest(name=name), timeout=5).ready:
                        still.append(name)
                except grpc.RpcError:
                    still.append(name)
            pending = still
            if pending:
                time.sleep(0.3)
    return pending


def cluster_security(args, data_dir: pathlib.Path) -> tuple[list[str], Credentials]:
    """The security flags every child gets, and the credentials of serve's own calls.

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
    return to_argv(config), Credentials(ca=creds.ca, token=creds.token)


def _client_flags(security: list[str]) -> list[str]:
    """The flags of ``security`` that an admin command needs too (the CA and the token file)."""
    return [f"{flag} {value}" for flag, value in zip(security[::2], security[1::2])
            if flag in ("--tls-ca", "--token-file")]


def _abs(path: str) -> str:
    return str(pathlib.Path(path).resolve()) if path else ""


def run(args) -> int:
    from common.sample_models import SAMPLE_MODELS, write_sample_models
    from common.sample_queries import SAMPLE_QUERIES, sample_query_json
    from nexus.models_cmd import CommandError, list_models, upload_model
    from nexus.queries_cmd import list_queries, register_query
    from common.emulated_gpus import UnknownGpuError, check_device

    try:
        check_device(args.device)
    except UnknownGpuError as exc:
        print(f"nexus serve: error: --device: {exc}", file=sys.stderr, flush=True)
        return 2
    repository = []
    if args.model_repository:
        from nexus.repository_cmd import read_checked, upload_repository

        repository = read_checked(args.model_repository, "nexus serve")
        if repository is None:
            return 2
    data_dir = pathlib.Path(args.data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    children: list[Child] = []
    stopping = False

    def stop_all(*_):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    try:
        security, creds = cluster_security(args, data_dir)
    except (ConfigError, SecurityError) as exc:
        print(f"nexus serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    signal.signal(signal.SIGTERM, stop_all)
    try:
        scheduler = Child("scheduler", ["scheduler", *security, "--listen", f"127.0.0.1:{args.scheduler_port}",
                                        "--data-dir", str(data_dir / "db"), "--epoch-s", str(args.epoch_s),
                                        "--latency-split", args.latency_split,
                                        "--rate-headroom", str(args.rate_headroom),
                                        "--burst-sigma", str(args.burst_sigma),
                                        "--path-allowance-ms", str(args.path_allowance_ms),
                                        "--min-replicas", str(args.min_replicas)], env)
        children.append(scheduler)
        sched_addr = scheduler.wait_ready(60)
        names = []
        if not args.no_samples:
            known = {m.name for m in list_models(sched_addr, creds)}
            paths = write_sample_models(data_dir / "samples")
            for name, path in paths.items():
                names.append(name)
                if name not in known:
                    upload_model(sched_addr, path, name, slo_ms=SAMPLE_MODELS[name].slo_ms, creds=creds)
            known_queries = {q.name for q in list_queries(sched_addr, creds)}
            for name in SAMPLE_QUERIES:
                if name not in known_queries:
                    register_query(sched_addr, sample_query_json(name), creds)
                names.append(name)
        if repository:
            upload_repository(sched_addr, repository, creds=creds)
            names += [m.name for m in repository if m.name not in names]
        names += [m.name for m in list_models(sched_addr, creds) if m.loaded and m.name not in names]
        for i in range(args.backends):
            argv = ["backend", *security, "--scheduler", sched_addr, "--device", args.device, "--listen", "127.0.0.1:0"]
            if args.threads:
                argv += ["--threads", str(args.threads)]
            argv += ["--batch-start", args.batch_start]
            children.append(Child(f"backend-{i}", argv, env))
        frontend = Child("frontend", ["frontend", *security, "--scheduler", sched_addr,
                                      "--listen", f"{args.host}:{args.frontend_port}",
                                      "--metrics-listen", join_host_port(args.host, args.metrics_port),
                                      "--http-listen", join_host_port(args.host, args.http_port)], env)
        children.append(frontend)
        for c in children[1:]:
            c.wait_ready(120)
        missing = wait_models_ready(frontend.address, names, args.ready_timeout_s, creds)
        if missing:
            print(f"nexus serve: warning: not ready after {args.ready_timeout_s:.0f} s: {', '.join(missing)}",
                  file=sys.stderr, flush=True)
        http_address = frontend.info.get("http", "")
        print(f"Nexus is serving on {frontend.address} (KServe v2 gRPC) and http://{http_address} (KServe v2 "
              f"HTTP/REST); scheduler at {sched_addr}", flush=True)
        metrics_url = frontend.info.get("metrics", "")
        print(f"  models: {', '.join(names) or '(none)'}", flush=True)
        print(f"  metrics: {metrics_url} (Prometheus)", flush=True)
        print(f"  admin:  nexus models list --scheduler {sched_addr} {' '.join(_client_flags(security))}".rstrip(),
              flush=True)
        print(f"  try:    nexus bench --frontend {frontend.address} --model resnet18_64 --rate 50 --slo-ms 100",
              flush=True)
        print(f"{READY_PREFIX} serve {frontend.address} {sched_addr} http={http_address} metrics={metrics_url}", flush=True)
        while True:
            for c in children:
                if c.proc.poll() is not None:
                    print(f"nexus serve: {c.name} exited with status {c.proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, CommandError) as exc:
        print(f"nexus serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for c in reversed(children):
            c.stop()


def register(sub) -> None:
    p = sub.add_parser("serve", help="run a local cluster (scheduler, frontend, backends) on loopback",
                       description="Run a whole local cluster on loopback with the built-in sample models.")
    p.add_argument("--backends", type=int, default=1, help="number of backend processes (default 1)")
    p.add_argument("--device", default="cpu", help="device of every backend: cpu | cuda:N | emulated:<gpu>")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads per backend (0: all cores)")
    p.add_argument("--host", default="127.0.0.1", help="frontend host (default 127.0.0.1)")
    p.add_argument("--frontend-port", type=int, default=8001, help="frontend port (0: any free port)")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="frontend's Prometheus /metrics port (0: any free port)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="frontend's KServe v2 HTTP/REST port (0: any free port; default 8000)")
    p.add_argument("--scheduler-port", type=int, default=8100, help="scheduler port (0: any free port)")
    p.add_argument("--data-dir", default=".nexus-data", help="model database and sample models")
    p.add_argument("--epoch-s", type=float, default=30.0, help="scheduler re-planning period")
    p.add_argument("--latency-split", default="dp", choices=["dp", "even", "proportional"],
                   help="how the scheduler splits a query's SLO over its stages")
    p.add_argument("--batch-start", default=BatchStart.EAGER.value, choices=[m.value for m in BatchStart],
                   help="backends: when the next batch starts (default eager)")
    defaults = SchedulerConfig()
    p.add_argument("--rate-headroom", type=float, default=defaults.rate_headroom,
                   help=f"scheduler: plan for measured rates times (1 + this) (default {defaults.rate_headroom:g})")
    p.add_argument("--burst-sigma", type=float, default=defaults.burst_sigma,
                   help="scheduler: provision each session for n + this*sqrt(n) arrivals per duty cycle "
                        f"(default {defaults.burst_sigma:g})")
    p.add_argument("--path-allowance-ms", type=float, default=defaults.path_allowance_ms,
                   help="scheduler: time per hop outside the device, taken from every SLO when planning "
                        f"(default {defaults.path_allowance_ms:g})")
    p.add_argument("--min-replicas", type=int, default=defaults.min_replicas,
                   help="scheduler: backends every session keeps at least, when enough exist "
                        f"(default {defaults.min_replicas})")
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
    p.set_defaults(func=run)
