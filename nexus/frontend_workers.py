"""``nexus frontend --workers N``: N frontend processes behind one KServe port.

One frontend process serves on one core: its event loop and gRPC's poller are the busy core of a
single server under load (benchmarks/vs_triton.md). With ``--workers N`` this process starts N
``nexus frontend`` workers that bind the same gRPC and HTTP ports with SO_REUSEPORT, so the kernel
hands each new connection to one of them. It holds nothing on the request path; it:

- reserves the ports first: each shared port, and one port of its own for every worker, is bound
  here with SO_REUSEPORT and never listened on, so port 0 resolves once for all workers, a port
  taken by another program fails here with a message, and a restarted worker finds its ports again;
- starts the workers (:mod:`nexus.launcher`), each a frontend of its own to the scheduler: it
  registers its own port, where the scheduler pushes its routing tables and the other workers ask
  it for its request counts (ModelStatistics sums them, frontend/worker_statistics.py);
- restarts a worker that dies, with the launcher's backoff;
- serves ``/metrics`` on ``--metrics-listen``: every worker's series, each with a ``worker`` label
  (sum over it for the frontend's figures: counters and histograms add up);
- on SIGTERM, signals every worker at once: each drains as a single frontend does.

A client with one connection is served by one worker; the kernel spreads connections, not requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import socket
import subprocess
import time

import aiohttp
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.config import FrontendConfig, join_host_port, split_host_port
from common.metrics_http import METRICS_PATH
from nexus.launcher import Child, Supervisor, launch

log = logging.getLogger("nexus.frontend")

WORKER_METRICS_LISTEN = "127.0.0.1:0"    # scraped by this process only
READY_TIMEOUT_S = 120.0
STOP_MARGIN_S = 5.0                      # after a worker's drain grace, SIGKILL
SCRAPE_TIMEOUT_S = 5.0
CHECK_S = 0.2


def reserve(address: str, held: list[socket.socket]) -> str:
    """Bind ``address`` (port 0: a free port) with SO_REUSEPORT without listening, keep the socket in
    ``held``, and return HOST:PORT with the port bound. OSError when the port is taken."""
    host, port = split_host_port(address)
    bind_host = "" if host in ("0.0.0.0", "::", "*") else host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((bind_host, port))
    except OSError:
        sock.close()
        raise
    held.append(sock)
    return join_host_port(host, sock.getsockname()[1])


def worker_configs(config: FrontendConfig, listen: str, http_listen: str, own: list[str]) -> list[FrontendConfig]:
    """What each worker runs: the shared ports, its own port, the others' ports, its own trace file."""
    configs = []
    for i, address in enumerate(own):
        advertise = ""
        if config.advertise:       # the host peers dial, with this worker's own port
            advertise = join_host_port(split_host_port(config.advertise)[0], split_host_port(address)[1])
        configs.append(dataclasses.replace(
            config, workers=1, listen=listen, http_listen=http_listen, metrics_listen=WORKER_METRICS_LISTEN,
            worker_control_listen=address, worker_siblings=",".join(a for a in own if a != address),
            advertise=advertise, trace=f"{config.trace}.{i}" if config.trace else ""))
    return configs


def merged_metrics(texts: list[tuple[str, str]]) -> bytes:
    """The exposition of every worker's series, each sample labelled ``worker``; ``texts`` holds
    (worker, exposition text) pairs."""
    families: dict[str, object] = {}
    for worker, text in texts:
        for family in text_string_to_metric_families(text):
            samples = family.samples
            kept = families.get(family.name)
            if kept is None:
                kept = families[family.name] = family
                kept.samples = []
            for sample in samples:
                kept.samples.append(sample._replace(labels={**sample.labels, "worker": worker}))

    class _Families:
        def collect(self):
            return list(families.values())

    return generate_latest(_Families())


class MetricsGate:
    """``/metrics`` of the whole frontend: scrapes every worker that is up, at each request."""

    def __init__(self, children: list[Child]) -> None:
        self.children = children
        self.session: aiohttp.ClientSession | None = None

    async def _scrape(self, index: int, child: Child) -> tuple[str, str] | None:
        url = child.info.get("metrics", "")
        if not url or not child.running():
            return None
        try:
            async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as reply:
                return str(index), await reply.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            log.info("worker %d's metrics not read (%s)", index, exc.__class__.__name__)
            return None

    async def handle(self, request: web.Request) -> web.Response:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        texts = await asyncio.gather(*(self._scrape(i, c) for i, c in enumerate(self.children)))
        body = merged_metrics([t for t in texts if t is not None])
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, address: str, flag: str) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_get(METRICS_PATH, self.handle)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        host, port = split_host_port(address)
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:
            await runner.cleanup()
            raise SystemExit(f"nexus frontend: error: cannot serve --metrics-listen {flag}: "
                             f"{exc.strerror or exc}") from None
        return runner, f"http://{join_host_port(host, runner.addresses[0][1])}{METRICS_PATH}"

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


async def serve(config: FrontendConfig, ready=None) -> None:
    """Run ``config.resolved_workers`` frontend workers until cancelled; ``ready`` as for a frontend."""
    held: list[socket.socket] = []
    supervisor = Supervisor(log.info)
    runner = None
    gate = None
    try:
        try:
            listen = reserve(config.listen, held)
            http = reserve(config.resolved_http_listen, held) if config.resolved_http_listen else ""
            host = split_host_port(config.listen)[0]
            own = [reserve(join_host_port(host, 0), held) for _ in range(config.resolved_workers)]
        except OSError as exc:
            raise SystemExit(f"nexus frontend: error: cannot bind {config.listen}"
                             f"{' or ' + config.resolved_http_listen if config.resolved_http_listen else ''}: "
                             f"{exc.strerror or exc}") from None
        children = [supervisor.add(launch(c, f"frontend worker {i}", start_new_session=True))
                    for i, c in enumerate(worker_configs(config, listen, http, own))]
        for child in children:
            try:
                await asyncio.to_thread(child.wait_ready, READY_TIMEOUT_S)
            except RuntimeError as exc:
                raise SystemExit(f"nexus frontend: error: {exc}") from None
        log.info("%d frontend workers serve %s (own ports %s)", len(children), listen, ", ".join(own))
        extra = {"http": http} if http else {}
        if config.resolved_metrics_listen:
            gate = MetricsGate(children)
            runner, extra["metrics"] = await gate.start(config.resolved_metrics_listen, config.metrics_listen)
        if ready:
            ready(listen, **extra)
        while True:
            supervisor.check()
            await asyncio.sleep(CHECK_S)
    finally:
        supervisor.stopping = True
        supervisor.signal_all(signal.SIGTERM)      # every worker drains at once
        await asyncio.to_thread(_wait_all, supervisor.children, config.drain_grace_s + STOP_MARGIN_S)
        if runner is not None:
            await runner.cleanup()
        if gate is not None:
            await gate.close()
        for sock in held:
            sock.close()


def _wait_all(children: list[Child], timeout_s: float) -> None:
    """Wait for every child to exit (they were signalled once: a second SIGTERM would cut a drain
    short); SIGKILL what is left after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.proc.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            log.warning("%s did not exit within %.0f s of SIGTERM; killing it", child.name, timeout_s)
            child.proc.kill()
            child.proc.wait()
