"""Every benchmark driver imports and parses its arguments (``python -m benchmarks.NAME --help``), so a
rename inside the product that breaks a driver's imports fails here rather than on the next run."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# benchmarks/triton_model.py runs under PyTriton's own interpreter, without this project: not a driver.
NOT_DRIVERS = {"__init__", "triton_model"}
DRIVERS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in NOT_DRIVERS)


def test_the_drivers_are_found():
    assert {"elastic", "plan_quality", "serving", "takeover"} <= set(DRIVERS)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_driver_imports_and_prints_its_usage(driver):
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{driver}", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


SMOKE_DRIVERS = sorted(d for d in DRIVERS if "--smoke" in (ROOT / "benchmarks" / f"{d}.py").read_text())


def test_the_fleet_simulation_has_a_smoke_mode():
    assert "fleet_sim" in SMOKE_DRIVERS


@pytest.mark.parametrize("driver", SMOKE_DRIVERS)
def test_a_driver_with_a_smoke_mode_runs_it_to_the_end(driver, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{driver}", "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.stat().st_size > 0
