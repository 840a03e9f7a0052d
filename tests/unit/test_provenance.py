"""harness/provenance.py: a benchmark run records its command, commit, CPU and load average, and marks
a run on a busy machine; the record lands beside each output the run wrote."""

from __future__ import annotations

import json

from harness.provenance import QUIET_LOAD, Provenance, commit, cpu_model


def test_a_run_above_the_quiet_load_is_marked(tmp_path):
    run = Provenance(["--rate", "10"], [])
    run.loads = [0.4, QUIET_LOAD + 0.1, 0.9]
    record = run.record()
    assert record["quiet"] is False and "busy machine" in record["mark"]
    assert record["load_average_1m"] == {"min": 0.4, "max": QUIET_LOAD + 0.1, "samples": 3}
    assert record["command"].endswith("--rate 10")
    run.loads = [0.4, QUIET_LOAD]
    assert run.record()["quiet"] is True and run.record()["mark"] == ""


def test_the_record_lands_beside_each_output_written(tmp_path):
    written, missing = tmp_path / "out.json", tmp_path / "never.json"
    run = Provenance([], [written, missing])
    written.write_text("{}")
    run.finish()
    record = json.loads((tmp_path / "out.json.provenance.json").read_text())
    assert record["commit"] == commit() and record["cpu"] == cpu_model()
    assert not (tmp_path / "never.json.provenance.json").exists()


def test_the_cpu_and_commit_are_named():
    assert "cores" in cpu_model()
    assert commit() != ""


def test_an_output_the_run_did_not_write_keeps_its_record(tmp_path):
    """A run refused at its arguments writes nothing: the record of the run that drew the file stays."""
    plot = tmp_path / "plot.png"
    plot.write_bytes(b"png")
    earlier = tmp_path / "plot.png.provenance.json"
    earlier.write_text('{"commit": "earlier"}')
    Provenance(["--late-requests", "maybe"], [plot]).finish()
    assert earlier.read_text() == '{"commit": "earlier"}'
