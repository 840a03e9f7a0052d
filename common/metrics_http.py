"""A dedicated Prometheus endpoint: ``GET /metrics`` on its own address, on the process's event loop.

Frontends (``--metrics-listen``) and backends (``--metrics-port``) serve their
``prometheus_client.CollectorRegistry`` here with the library's own aiohttp handler, which also
negotiates OpenMetrics when the scraper asks for it. Any other path is a 404; other methods on
``/metrics`` a 405. No thread is started: aiohttp runs on the loop that grpc.aio already uses.
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler

from common.config import join_host_port, split_host_port

METRICS_PATH = "/metrics"


class MetricsServer:
    """A running endpoint; :attr:`url` has the bound port (useful with port 0)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self._runner = runner
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{join_host_port(self.host, self.port)}{METRICS_PATH}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Serve ``registry`` at ``http://host:port/metrics``; OSError when the address cannot be bound."""
    app = web.Application()
    app.router.add_get(METRICS_PATH, make_aiohttp_handler(registry, disable_compression=True))
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = next(iter(runner.addresses))[1] if port == 0 else port
    return MetricsServer(runner, host, bound)


async def serve_metrics(component: str, flag_value: str, address: str, registry: CollectorRegistry) -> MetricsServer:
    """:func:`start_metrics_server` on ``address`` (HOST:PORT) for ``nexus COMPONENT --metrics-listen
    FLAG_VALUE``; SystemExit with a message naming the flag when the address cannot be bound."""
    host, port = split_host_port(address)
    try:
        return await start_metrics_server(host, port, registry)
    except OSError as exc:
        raise SystemExit(f"nexus {component}: error: cannot serve --metrics-listen {flag_value}: "
                         f"{exc.strerror or exc}") from None
