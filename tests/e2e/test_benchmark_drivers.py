"""Every benchmark driver imports and parses its arguments (``python -m benchmarks.NAME --help``) and runs
its seconds-long smoke mode to the end (``--smoke``), so a change inside the product that breaks a
driver fails here rather than on the next real run."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# benchmarks/triton_model.py runs under PyTriton's own interpreter, without this project: not a driver.
NOT_DRIVERS = {"__init__", "triton_model"}
DRIVERS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in NOT_DRIVERS)
# ONNX Runtime's own file in the temporary directory: one, which every process that loads it rewrites
ORT_SESSION_FILE = ".ses"


def test_the_drivers_are_found():
    assert {"elastic", "plan_quality", "serving", "takeover"} <= set(DRIVERS)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_driver_imports_and_prints_its_usage(driver):
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{driver}", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


SMOKE_DRIVERS = sorted(d for d in DRIVERS if "add_smoke(" in (ROOT / "benchmarks" / f"{d}.py").read_text())


def test_every_driver_has_a_smoke_mode():
    assert set(SMOKE_DRIVERS) == set(DRIVERS), sorted(set(DRIVERS) - set(SMOKE_DRIVERS))


@pytest.mark.slow
@pytest.mark.parametrize("driver", SMOKE_DRIVERS)
def test_a_driver_runs_its_smoke_mode_to_the_end(driver, tmp_path):
    """``--smoke``: the driver end to end at tiny sizes (harness/smoke.py); its output goes to tmp_path,
    and it leaves nothing in the temporary directory (its working folders are removed: harness/scratch.py)."""
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="driver-tmpdir-"))
    scratch.chmod(0o755)                    # PostgreSQL's user reads its password file below it
    try:
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{driver}", "--smoke", "--smoke-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env=dict(os.environ, TMPDIR=str(scratch)))
        left = sorted(p.name for p in scratch.iterdir() if p.name != ORT_SESSION_FILE)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if proc.returncode != 0:
        # pytest.fail, not an assert's message: pytest cuts an assert's explanation short under -q, and
        # the one failure CI saw (serving, 2026-12-04) lost its traceback that way
        pytest.fail(f"exit status {proc.returncode}\n--- stdout (tail) ---\n{proc.stdout[-2000:]}\n"
                    f"--- stderr (tail) ---\n{proc.stderr[-3000:]}", pytrace=False)
    assert left == []


@pytest.mark.parametrize("args, message", [
    (["--models", "0"], "--models, --batch and --repeats must be at least 1, and --fetch-ms at least 0"),
    (["--fetch-ms", "-1"], "--models, --batch and --repeats must be at least 1, and --fetch-ms at least 0"),
    (["--before", "/nonexistent"], "--before /nonexistent: no backend/model_table.py there"),
])
def test_table_loads_refuses_bad_arguments_before_measuring(args, message):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.table_loads", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and not proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--path-cores", "0,x"], "--path-cores: expected numbers separated by commas, got '0,x'"),
    (["--path-cores", "0.2,0"], "--path-cores: 0 first, then shares of a core below 1"),
    (["--path-cores", "0,1.5"], "--path-cores: 0 first, then shares of a core below 1"),
    (["--seconds", "0"], "--seconds and --burst-ms must be positive, --repeats and --batch at least 1"),
    (["--batch", "0"], "--seconds and --burst-ms must be positive, --repeats and --batch at least 1"),
])
def test_layout_path_share_refuses_bad_arguments_before_measuring(args, message):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.layout_path_share", *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr and not proc.stdout
