"""``nexus plan``: the JSON contract, the table, and one-line errors with exit status 2."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from globalsched.planning.plan import Plan, validate_plan
from nexus.plan_files import parse_workload
from nexus.cli import main

WORKLOAD: dict[str, Any] = {
    "gpu": {"name": "gtx1080ti", "memory_mb": 11000},
    "sessions": [
        {"name": "face", "model": "vgg_face", "slo_ms": 200, "rate": 350.0,
         "profile": [{"batch": b, "latency_ms": 5.0 + 1.3 * b, "memory_mb": 900 + 50 * b} for b in range(1, 33)]},
        {"name": "car", "model": "googlenet", "slo_ms": 100, "rate": 120.0,
         "profile": [{"batch": b, "latency_ms": 3.0 + 0.8 * b, "memory_mb": 400 + 20 * b} for b in range(1, 33)]},
    ],
}


def write(tmp_path: Path, obj: Any) -> str:
    path = tmp_path / "workload.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_json_output_follows_the_contract(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", write(tmp_path, WORKLOAD), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out)[:5] == ["solver", "num_gpus", "lower_bound", "solve_ms", "gpus"]
    assert out["solver"] == "squishy" and out["num_gpus"] == len(out["gpus"]) >= out["lower_bound"] >= 1
    assert 1 <= out["lower_bound_throughput_only"] <= out["lower_bound"]
    for gpu in out["gpus"]:
        assert set(gpu) <= {"id", "duty_cycle_ms", "sessions", "prefix_groups"}
        for s in gpu["sessions"]:
            assert set(s) == {"session", "batch", "throughput"}
    w = parse_workload(WORKLOAD)
    assert validate_plan(Plan.from_json_obj(out), list(w.sessions), w.gpu) == []


def test_burst_sigma_gives_loads_and_a_valid_pooled_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", write(tmp_path, WORKLOAD), "--json", "--burst-sigma", "1.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(0 < s["load_rps"] <= s["throughput"] + 1e-9 for g in out["gpus"] for s in g["sessions"])
    w = parse_workload(WORKLOAD)
    assert validate_plan(Plan.from_json_obj(out), list(w.sessions), w.gpu, burst_sigma=1.5) == []
    assert main(["plan", write(tmp_path, WORKLOAD), "--burst-sigma", "-1"]) == 2
    assert "burst_sigma: must not be negative" in capsys.readouterr().err


@pytest.mark.parametrize("solver", ["squishy", "cpsat", "cpsat-lns", "nexus", "batch-oblivious", "one-per-gpu"])
def test_every_solver_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str], solver: str) -> None:
    assert main(["plan", write(tmp_path, WORKLOAD), "--solver", solver, "--json", "--time-limit-s", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["solver"] == solver and out["num_gpus"] >= out["lower_bound"]


def test_table_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = copy.deepcopy(WORKLOAD)
    obj["queries"] = [{"name": "q", "slo_ms": 300, "rate": 10,
                       "stages": [{"name": "det", "model": "ssd", "profile": WORKLOAD["sessions"][0]["profile"]},
                                  {"name": "rec", "model": "rn", "profile": WORKLOAD["sessions"][1]["profile"]}],
                       "edges": [{"parent": "det", "child": "rec", "gamma": 3}]}]
    assert main(["plan", write(tmp_path, obj)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("solver squishy: ") and "lower bound" in out
    assert "face (" in out and "q/rec (" in out
    assert "query q: tree-dp split: det " in out


def test_queries_appear_in_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = copy.deepcopy(WORKLOAD)
    obj["queries"] = [{"name": "q", "slo_ms": 300, "rate": 10,
                       "stages": [{"name": "det", "model": "ssd", "profile": WORKLOAD["sessions"][0]["profile"]}]}]
    assert main(["plan", write(tmp_path, obj), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["queries"][0]["name"] == "q" and set(out["queries"][0]["budgets_ms"]) == {"det"}
    assert any(s["session"] == "q/det" for g in out["gpus"] for s in g["sessions"])


def _error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith("nexus plan: error: ")
    return err


def test_malformed_file_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = copy.deepcopy(WORKLOAD)
    obj["sessions"][1]["slo_ms"] = -3
    assert main(["plan", write(tmp_path, obj)]) == 2
    assert _error(capsys) == "nexus plan: error: sessions[1].slo_ms: must be positive, got -3"


def test_infeasible_session_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = copy.deepcopy(WORKLOAD)
    obj["sessions"][0]["slo_ms"] = 12  # 2*l(1) = 12.6
    assert main(["plan", write(tmp_path, obj), "--json"]) == 2
    err = _error(capsys)
    assert "session 'face'" in err and "2*l(1) = 12.6 ms" in err


def test_margins_make_a_session_infeasible(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    obj = copy.deepcopy(WORKLOAD)
    obj["sessions"][1]["slo_ms"] = 10  # 2*l(1) = 7.6; with 3 ms of margins only 7 ms remain
    assert main(["plan", write(tmp_path, obj), "--network-ms", "2", "--preprocess-ms", "1"]) == 2
    assert "session 'car'" in _error(capsys)
    assert main(["plan", write(tmp_path, obj), "--network-ms", "-1"]) == 2
    assert "network_ms: must not be negative" in _error(capsys)


def test_missing_file_and_bad_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(tmp_path / "nope.json")]) == 2
    assert "cannot read" in _error(capsys)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["plan", str(bad)]) == 2
    assert "not valid JSON" in _error(capsys)


def test_unknown_solver_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", write(tmp_path, WORKLOAD), "--solver", "magic"])
    assert exc.value.code == 2
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_published_nexus_plan_that_overcommits_memory_exits_1(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"batch": b, "latency_ms": 5.0 + b, "memory_mb": 6000} for b in range(1, 9)]
    obj = {"gpu": {"name": "small", "memory_mb": 11000},
           "sessions": [{"name": n, "model": n, "slo_ms": 200, "rate": 10, "profile": rows} for n in ("a", "b")]}
    assert main(["plan", write(tmp_path, obj), "--solver", "nexus", "--json"]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["num_gpus"] == 1 and "needs 12000 MB" in out["violations"][0]
    assert "nexus plan: invalid plan: gpu 0: needs 12000 MB > 11000 MB" in captured.err
    assert main(["plan", write(tmp_path, obj), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_gpus"] == 2


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "nexus", "plan", write(tmp_path, WORKLOAD), "--json"],
                          capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["solver"] == "squishy"
