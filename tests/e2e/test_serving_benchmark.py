"""benchmarks/serving.py's low-load phase on a real cluster whose backend never answers: it says what
was sent and how each request ended, instead of failing on an empty list of latencies."""

from __future__ import annotations

import ast
import os
import signal

import pytest

from benchmarks.serving import low_load
from harness.experiments import SampleCluster


@pytest.mark.slow
def test_a_low_load_phase_with_no_answer_reports_what_was_sent_and_how_it_ended():
    with SampleCluster(["mlp_small"], threads=1, tag="lowload") as cluster:
        backend = cluster.backends[0].pid
        os.kill(backend, signal.SIGSTOP)
        try:
            with pytest.raises(SystemExit) as exited:
                low_load(cluster, "mlp_small", rate=20.0, duration_s=1.0, slo_ms=30.0, threads=1, rounds=1)
        finally:
            os.kill(backend, signal.SIGCONT)
    message = str(exited.value)
    assert message.startswith("serving: no request of the low-load phase (20 rps for 1 s) was answered"), message
    sent = int(message.split("sent ")[1].split(",")[0])
    assert sent > 0
    statuses = ast.literal_eval(message.split("statuses ")[1])     # status name -> count, as printed
    assert sum(statuses.values()) == sent, message
    assert "OK" not in statuses, message
