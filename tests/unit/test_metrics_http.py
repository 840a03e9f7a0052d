"""The Prometheus endpoint every component serves (common/metrics_http.py), on a real port: the
collectors run on the event loop's thread, the text is written in another; the text and OpenMetrics
formats as the scraper asks; ``name[]`` selects families; other paths and methods are refused; the
event loop's lag, where asked for."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.metrics_http import start_metrics_server


class _Samples(list):
    """A family's samples that note the thread that reads them (the encoder does)."""

    readers: set[int] = set()

    def __iter__(self):
        self.readers.add(threading.get_ident())
        return super().__iter__()


class _Collector(Collector):
    def __init__(self) -> None:
        self.collected_on: list[int] = []

    def collect(self):
        self.collected_on.append(threading.get_ident())
        a = GaugeMetricFamily("nexus_test_a", "first", labels=["model"])
        a.add_metric(["m"], 1.5)
        a.samples = _Samples(a.samples)
        b = GaugeMetricFamily("nexus_test_b", "second")
        b.add_metric([], 2.0)
        yield from (a, b)


def test_collected_on_the_loop_written_elsewhere_in_the_format_asked_for():
    async def main():
        collector = _Collector()
        registry = CollectorRegistry(auto_describe=True)      # so that name[] knows a collector's names
        registry.register(collector)
        server = await start_metrics_server("127.0.0.1", 0, registry)
        loop_thread = threading.get_ident()
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url) as r:
                    text = await r.text()
                    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                assert 'nexus_test_a{model="m"} 1.5' in text and "nexus_test_b 2.0" in text
                assert collector.collected_on and set(collector.collected_on) == {loop_thread}
                assert _Samples.readers and loop_thread not in _Samples.readers
                async with http.get(server.url, headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as r:
                    om = await r.text()
                    assert r.headers["Content-Type"].startswith("application/openmetrics-text")
                assert om.endswith("# EOF\n") and 'nexus_test_a{model="m"} 1.5' in om
                async with http.get(server.url, params={"name[]": "nexus_test_b"}) as r:
                    only = await r.text()
                assert "nexus_test_b 2.0" in only and "nexus_test_a" not in only
                async with http.get(server.url.replace("/metrics", "/other")) as r:
                    assert r.status == 404
                async with http.post(server.url) as r:
                    assert r.status == 405
        finally:
            await server.close()

    asyncio.run(main())


def test_a_loop_lag_histogram_counts_a_stall_of_the_loop_and_stops_with_the_server():
    async def main():
        registry = CollectorRegistry()
        server = await start_metrics_server("127.0.0.1", 0, registry, loop_lag="nexus_test_loop_lag_seconds")
        try:
            await asyncio.sleep(0.6)
            time.sleep(0.4)                 # the loop is held: the timer due meanwhile runs 0.15 s late or more
            await asyncio.sleep(0.3)
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url) as r:
                    text = await r.text()
        finally:
            await server.close()
        return text, [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    text, left = asyncio.run(main())
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    count = samples["nexus_test_loop_lag_seconds_count[]"]
    assert count >= 3
    assert samples["nexus_test_loop_lag_seconds_bucket[('le', '0.1')]"] <= count - 1      # the stall
    assert samples["nexus_test_loop_lag_seconds_bucket[('le', '+Inf')]"] == count
    assert not left                         # the monitor ended with the server
