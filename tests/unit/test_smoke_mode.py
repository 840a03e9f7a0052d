"""harness/smoke.py: a driver's ``--smoke`` values replace its defaults but not what the command line
gave, and its output goes to the smoke directory."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from harness.smoke import add_smoke, parse_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--models", type=int, default=100)
    p.add_argument("--out", default="benchmarks/out/x.json")
    p.add_argument("--json", type=pathlib.Path, default=pathlib.Path("benchmarks/out/rows.json"))
    add_smoke(p, duration_s=2.0, models=3)
    return p


def test_without_smoke_nothing_changes():
    args = parse_args(parser(), [], record=False)
    assert (args.duration_s, args.models, args.out) == (60.0, 100, "benchmarks/out/x.json")


def test_smoke_values_and_outputs(tmp_path):
    args = parse_args(parser(), ["--smoke", "--smoke-dir", str(tmp_path)], record=False)
    assert (args.duration_s, args.models) == (2.0, 3)
    assert args.out == str(tmp_path / "x.json")
    assert args.json == tmp_path / "rows.json"


def test_the_command_line_wins_over_smoke_values(tmp_path):
    args = parse_args(parser(), ["--smoke", "--models=7", "--out", "mine.json", "--smoke-dir", str(tmp_path)],
                      record=False)
    assert (args.duration_s, args.models, args.out) == (2.0, 7, "mine.json")


def test_a_smoke_value_for_no_option_is_refused_when_written():
    p = argparse.ArgumentParser()
    with pytest.raises(ValueError, match="no option durations"):
        add_smoke(p, durations=1)
