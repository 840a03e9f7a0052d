"""A dedicated Prometheus endpoint: ``GET /metrics`` on its own address, on the process's event loop.

Frontends (``--metrics-listen``), backends (``--metrics-port``) and the scheduler serve their
``prometheus_client.CollectorRegistry`` here. The collectors run on the loop, where the state they
read is changed; the text is written from what they returned in a worker thread, so that the loop
answers heartbeats meanwhile (a scheduler of 1,000 backends and 2,400 models spent 200-400 ms of
its loop per scrape writing the text). A collector with many samples may have them made there too,
from what it took on the loop (globalsched/rpc/profile_metrics.py). The library's encoders negotiate
OpenMetrics when the scraper asks for it, and ``name[]`` parameters select metric families, as the
library's own handlers do. Any other path is a 404; other methods on ``/metrics`` a 405. aiohttp runs on the loop
that grpc.aio already uses.

Given a ``loop_lag`` name, the endpoint also exports how late that loop runs a timer
(common/loop_lag.py): a frontend or backend whose loop stalls answers nothing meanwhile, and its
requests' latencies alone do not say why.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

from aiohttp import hdrs, web
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric

from common.config import join_host_port, split_host_port
from common.loop_lag import LoopLagMonitor

METRICS_PATH = "/metrics"


class _Collected:
    """Metric families already collected, as the library's encoders read a registry."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def metrics_handler(registry: CollectorRegistry):
    """The aiohttp handler of ``GET /metrics`` for ``registry`` (module docstring)."""

    async def handle(request: web.Request) -> web.Response:
        names = request.query.getall("name[]", [])
        source = registry.restricted_registry(names) if names else registry
        collected = _Collected(source.collect())
        encoder, content_type = choose_encoder(",".join(request.headers.getall(hdrs.ACCEPT, [])))
        body = await asyncio.to_thread(encoder, collected)
        return web.Response(body=body, headers={hdrs.CONTENT_TYPE: content_type})

    return handle


class MetricsServer:
    """A running endpoint; :attr:`url` has the bound port (useful with port 0)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, loop_lag: asyncio.Task | None = None) -> None:
        self._runner = runner
        self._loop_lag = loop_lag
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{join_host_port(self.host, self.port)}{METRICS_PATH}"

    async def close(self) -> None:
        if self._loop_lag is not None:
            self._loop_lag.cancel()
        await self._runner.cleanup()


async def start_metrics_server(host: str, port: int, registry: CollectorRegistry, loop_lag: str = "") -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics``; OSError when the address cannot be bound.
    ``loop_lag``: the name of a histogram of this loop's lag, added to ``registry`` ("": none)."""
    app = web.Application()
    app.router.add_get(METRICS_PATH, metrics_handler(registry))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = next(iter(runner.addresses))[1] if port == 0 else port
    task = None
    if loop_lag:
        monitor = LoopLagMonitor(loop_lag)
        registry.register(monitor.histogram)
        task = asyncio.create_task(monitor.run())
    return MetricsServer(runner, host, bound, task)


async def serve_metrics(component: str, flag_value: str, address: str, registry: CollectorRegistry,
                        loop_lag: str = "") -> MetricsServer:
    """:func:`start_metrics_server` on ``address`` (HOST:PORT) for ``nexus COMPONENT --metrics-listen
    FLAG_VALUE``; SystemExit with a message naming the flag when the address cannot be bound."""
    host, port = split_host_port(address)
    try:
        return await start_metrics_server(host, port, registry, loop_lag)
    except OSError as exc:
        raise SystemExit(f"nexus {component}: error: cannot serve --metrics-listen {flag_value}: "
                         f"{exc.strerror or exc}") from None
