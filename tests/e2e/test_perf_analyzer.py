"""Triton's perf_analyzer, unmodified, against ``nexus serve`` (issue 12): its server-side analysis
reads ModelStatistics between measurement windows and needs Triton's figures, mutually consistent.

The binary and its libraries are fetched once by the benchmark library (harness/perf_analyzer.py:
the tritonclient 2.50 wheel, the nvidia-cuda-runtime-cu12 wheel and Debian's libb64-0d, into
``$NEXUS_TEST_TOOLS``, default ``~/.cache/nexus-test-tools``, outside the repository). When the binary
cannot be had or cannot run, the tests are skipped with the reason.

The served model is uploaded as a user would: the sample MLP under its own name with a generous
SLO, so that a loaded, shared 2-core machine never makes the server drop a request (perf_analyzer
stops at the first failed request, which is not what these tests are about).
"""

from __future__ import annotations

import re
import subprocess

import pytest

from common.sample_models import mlp_small, model_bytes
from harness.perf_analyzer import TRITONCLIENT_VERSION, CUDART_VERSION, ToolUnavailable, fetch_perf_analyzer, \
    parse_level
from tests.conftest import ServedModel, serve_models

MODEL = "pa_mlp"
# Short windows and a stability bound (max/min of 3 windows <= 11) that a shared, loaded machine still
# meets: the figures only need to exist and be consistent here, not be precise.
WINDOW_ARGS = ["--measurement-interval", "800", "--stability-percentage", "1000", "--max-trials", "10"]
SERVER_LINE = re.compile(r"Avg request latency: \d+ usec \(overhead \d+ usec \+ queue \d+ usec \+ compute input "
                         r"\d+ usec \+ compute infer \d+ usec \+ compute output \d+ usec\)")


@pytest.fixture(scope="module")
def perf_analyzer():
    try:
        return fetch_perf_analyzer()
    except ToolUnavailable as exc:
        pytest.skip(f"perf_analyzer unavailable: {exc}")


@pytest.fixture(scope="module")
def served(perf_analyzer, tmp_path_factory):
    """``nexus serve`` without the samples, and one model uploaded with ``nexus models upload``."""
    data_dir = tmp_path_factory.mktemp("pa_cluster")
    path = data_dir / f"{MODEL}.onnx"
    path.write_bytes(model_bytes(mlp_small()))
    cluster = serve_models(data_dir, [ServedModel(path, MODEL, 2000)])
    try:
        yield cluster
    finally:
        cluster.stop()


def run_perf_analyzer(perf_analyzer, frontend: str, *args: str) -> str:
    binary, env = perf_analyzer
    cmd = [str(binary), "-i", "grpc", "-u", frontend, "-m", MODEL, *WINDOW_ARGS, *args]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{out[-4000:]}"
    return out


def _server_sections(out: str) -> list[str]:
    """The text of each load level's ``Server:`` section."""
    return [part.split("\n\n")[0] for part in out.split("  Server: \n")[1:]]


def _check_server_sections(out: str, levels: int) -> None:
    assert "compute counts must be the same" not in out
    sections = _server_sections(out)
    assert len(sections) == levels, out
    for section in sections:
        successes = int(re.search(r"Successful request count: (\d+)", section).group(1))
        executions = int(re.search(r"Execution count: (\d+)", section).group(1))
        inferences = int(re.search(r"Inference count: (\d+)", section).group(1))
        assert successes > 0 and 0 < executions <= inferences, section
        assert SERVER_LINE.search(section), section


@pytest.mark.slow
def test_perf_analyzer_concurrency_sweep_reports_server_side_figures(perf_analyzer, served):
    out = run_perf_analyzer(perf_analyzer, served.frontend, "--concurrency-range", "1:16:5")
    assert re.findall(r"^Request concurrency: (\d+)$", out, re.M) == ["1", "6", "11", "16"], out
    _check_server_sections(out, 4)


@pytest.mark.slow
def test_perf_analyzer_request_rate_reports_server_side_figures(perf_analyzer, served):
    """Open-loop Poisson arrivals. perf_analyzer draws them from a fixed seed, and a rate too low
    for the window (20/s in 0.8 s windows) gave window throughputs from 9 to 21/s here, which fail its
    stability check whatever the server does; from 40/s on they pass."""
    out = run_perf_analyzer(perf_analyzer, served.frontend, "--request-rate-range", "40:120:80",
                            "--request-distribution", "poisson")
    # (the rate prints as 120 or 120.00: an earlier warning may have left std::fixed on its stream)
    assert [float(r) for r in re.findall(r"^Request Rate: ([\d.]+) inference", out, re.M)] == [40, 120], out
    _check_server_sections(out, 2)


def test_an_unreachable_package_index_is_a_reason_to_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("NEXUS_TEST_TOOLS", str(tmp_path / "tools"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")     # nothing listens on the discard port
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ToolUnavailable, match=f"pip download tritonclient=={TRITONCLIENT_VERSION} failed"):
        fetch_perf_analyzer()
    assert list((tmp_path / "tools").iterdir()) == []      # no half-filled folder left behind


def test_a_binary_that_cannot_start_is_a_reason_to_skip(tmp_path, monkeypatch):
    tools = tmp_path / "tools"
    for name in (f"perf_analyzer-{TRITONCLIENT_VERSION}", f"cudart-{CUDART_VERSION}", "libb64-0d"):
        (tools / name).mkdir(parents=True)
    binary = tools / f"perf_analyzer-{TRITONCLIENT_VERSION}" / "perf_analyzer"
    binary.write_text("#!/bin/sh\necho 'error while loading shared libraries: libb64.so.0d' >&2\nexit 127\n")
    binary.chmod(0o755)
    monkeypatch.setenv("NEXUS_TEST_TOOLS", str(tools))
    with pytest.raises(ToolUnavailable, match=r"--version failed \(127\): error while loading shared libraries"):
        fetch_perf_analyzer()


def test_a_level_is_read_from_its_csv_or_its_error(tmp_path):
    """What the benchmarks read of a level (harness/perf_analyzer.py), from perf_analyzer 2.50's own
    CSV columns and console lines."""
    csv_path = tmp_path / "level.csv"
    csv_path.write_text("Request Rate,Inferences/Second,Client Send,p50 latency,p90 latency,p95 latency,"
                        "p99 latency,Avg latency\n200,196.5,10,8000,20000,30000,95000,12000\n")
    level = parse_level("m", 200, csv_path, "", 0)
    assert (level.throughput_rps, level.p50_us, level.p99_us) == (196.5, 8000, 95000)
    assert level.passes(slo_ms=100) and not level.passes(slo_ms=90)
    assert not level.passes(slo_ms=100, served_fraction=0.99)           # 196.5 of 200 offered
    assert level.passes(slo_ms=100, served_fraction=0.99, window_s=3.0)  # within the Poisson count's noise
    short = parse_level("m", 200, csv_path, "", 0)
    short.throughput_rps = 180.0
    assert not short.passes(slo_ms=100, served_fraction=0.99, window_s=3.0)   # 10%: 3 sigma is 7%
    failed = parse_level("m", 300, tmp_path / "none.csv", "Request Rate: 300 inference requests per seconds\n"
                         "Failed to maintain requested inference load.\n"
                         "Thread [0] had error: dropped: cannot meet its deadline (0.1 ms left)\n", 99)
    assert failed.error == "dropped: cannot meet its deadline (0.1 ms left)"
    assert not failed.passes(slo_ms=100)
    unstable = parse_level("m", 300, tmp_path / "none.csv",
                           "Failed to obtain stable measurement within 6 measurement windows for request rate 300. "
                           "Please try to increase the --measurement-interval.\n", 99)
    assert unstable.unstable and not unstable.completed
