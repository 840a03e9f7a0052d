"""common/cli_types.py: a bad value ends in argparse's error (usage, exit status 2), naming the flag."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from common.cli_types import non_negative_seconds


@pytest.mark.parametrize("text, value", [("0", 0.0), ("2.5", 2.5), ("1e3", 1000.0)])
def test_seconds_taken(text, value):
    assert non_negative_seconds(text) == value


@pytest.mark.parametrize("text, why", [("-1", "0 or more"), ("nan", "0 or more"), ("inf", "finite"),
                                       ("-inf", "finite"), ("soon", "must be a number of seconds")])
def test_seconds_refused(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        non_negative_seconds(text)


def test_the_simulated_change_benchmark_refuses_a_negative_horizon_before_it_runs(tmp_path):
    """``--known-rates-ahead-s -1`` was a ValueError from deep inside the first case's set-up."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.sim_change", "--known-rates-ahead-s", "-1",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "argument --known-rates-ahead-s: must be a finite number of seconds, 0 or more, got '-1'" in done.stderr
    assert "Traceback" not in done.stderr
    assert not any(tmp_path.iterdir())
