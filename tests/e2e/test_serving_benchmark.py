"""The serving benchmarks' phase with no answer (harness/experiments.py, ``require_answers``, which
benchmarks/serving.py's low-load phase calls): on a real cluster whose backend is stopped, it says what
was sent and how each request ended, instead of failing on an empty list of latencies."""

from __future__ import annotations

import ast
import asyncio
import os
import signal

import numpy as np
import pytest

from harness.experiments import SampleCluster, require_answers
from nexus.bench import LoadClient


async def _phase(address: str) -> tuple[list, list]:
    async with LoadClient(address, "mlp_small") as client:
        r = await client.run(20.0, 1.0, 30.0, seed=1)
    s = r.samples
    ok = s.measured & np.isfinite(s.latency_ms)
    return s.latency_ms[ok].tolist(), [r]


@pytest.mark.slow
def test_a_phase_with_no_answer_exits_with_what_was_sent_and_how_it_ended():
    with SampleCluster(["mlp_small"], threads=1, tag="noanswer") as cluster:
        answered, reports = asyncio.run(_phase(cluster.frontend.address))
        require_answers(answered, reports, "the phase")            # served: returns
        assert answered
        backend = cluster.backends[0].pid
        os.kill(backend, signal.SIGSTOP)
        try:
            latencies, reports = asyncio.run(_phase(cluster.frontend.address))
        finally:
            os.kill(backend, signal.SIGCONT)
    assert latencies == []
    with pytest.raises(SystemExit) as exited:
        require_answers(latencies, reports, "the phase")
    message = str(exited.value)
    assert message.startswith("the phase: no request was answered within its measurement window: sent "), message
    sent = int(message.split("sent ")[1].split(",")[0])
    assert sent == reports[0].sent > 0
    statuses = ast.literal_eval(message.split("statuses ")[1])     # status name -> count, as printed
    assert sum(statuses.values()) == sent and "OK" not in statuses, message
