"""A benchmark run's working folder (harness/scratch.py): gone after a run that ended well, kept and
named after one that raised or that asked to keep it."""

from __future__ import annotations

import shutil

import pytest

from harness.scratch import scratch_dir


def test_the_folder_is_removed_after_a_run_that_ends_well(capsys):
    with scratch_dir("scratch-test-") as scratch:
        (scratch.path / "serve.log").write_text("log")
        (scratch.path / "data").mkdir()
        (scratch.path / "data" / "model.onnx").write_bytes(b"x" * 1000)
        assert scratch.path.name.startswith("scratch-test-")
    assert not scratch.path.exists()
    assert capsys.readouterr().err == ""


def test_the_folder_is_kept_and_named_after_a_run_that_raised(capsys):
    with pytest.raises(RuntimeError, match="the server did not start"):
        with scratch_dir("scratch-test-") as scratch:
            (scratch.path / "serve.log").write_text("what the server said")
            raise RuntimeError("the server did not start")
    try:
        assert (scratch.path / "serve.log").read_text() == "what the server said"
        assert str(scratch.path) in capsys.readouterr().err
    finally:
        shutil.rmtree(scratch.path)


def test_the_folder_is_kept_when_the_driver_asks(capsys):
    with scratch_dir("scratch-test-") as scratch:
        (scratch.path / "serve.log").write_text("a failed check's log")
        scratch.keep = True
    try:
        assert (scratch.path / "serve.log").exists()
        assert str(scratch.path) in capsys.readouterr().err
    finally:
        shutil.rmtree(scratch.path)
