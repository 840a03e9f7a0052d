"""`nexus models upload` through a connection that breaks: the CLI sends the upload again, and the
scheduler stores it once (nexus/scheduler_client.py, globalsched/state/modeldb.py). On real processes,
a TCP relay between them (tests/tcp_relay.py) cuts the upload midway, or loses the scheduler's answer."""

from __future__ import annotations

import json

import pytest

from common.sample_models import backbone_variant, model_bytes
from tests.conftest import NexusProcess, nexus_cli
from tests.tcp_relay import TcpRelay

pytestmark = pytest.mark.slow


@pytest.fixture()
def scheduler(tmp_path):
    proc = NexusProcess(tmp_path / "scheduler.log", "scheduler", "--listen", "127.0.0.1:0",
                        "--data-dir", str(tmp_path / "db"))
    yield proc
    assert proc.stop() == 0


def _versions(address: str, name: str) -> list[int]:
    result = nexus_cli("models", "list", "--scheduler", address, "--json")
    assert result.returncode == 0, result.stderr
    return sorted(m["version"] or 1 for m in json.loads(result.stdout) if m["name"] == name)


def test_an_upload_cut_off_midway_is_sent_again_and_stored_once(scheduler, tmp_path):
    model = tmp_path / "big.onnx"
    model.write_bytes(model_bytes(backbone_variant(3)))        # about 5 MB: many chunks
    relay = TcpRelay(scheduler.address, cut_after_bytes=model.stat().st_size // 2)
    try:
        result = nexus_cli("models", "upload", str(model), "--name", "big", "--no-wait",
                           "--scheduler", relay.address)
        assert result.returncode == 0, result.stderr
        assert "uploaded big version 1" in result.stdout, result.stdout
        assert relay.cut == 1 and relay.connections >= 2          # it broke once, and was sent again
        assert f"no scheduler took UploadModel ({relay.address}); asking again in 0.25 s" in result.stderr
        assert _versions(scheduler.address, "big") == [1]
    finally:
        relay.close()


def test_an_upload_that_breaks_every_time_fails_with_the_cause(scheduler, tmp_path):
    model = tmp_path / "big.onnx"
    model.write_bytes(model_bytes(backbone_variant(3)))
    relay = TcpRelay(scheduler.address, cut_after_bytes=model.stat().st_size // 2, cut_connections=100)
    try:
        result = nexus_cli("models", "upload", str(model), "--name", "big", "--no-wait",
                           "--scheduler", relay.address)
        assert result.returncode == 2, result.stdout
        assert f"cannot reach the scheduler at {relay.address}" in result.stderr, result.stderr
        assert relay.cut == 4                     # the first try, and one after each pause
        assert _versions(scheduler.address, "big") == []
    finally:
        relay.close()


def test_an_upload_whose_reply_was_lost_is_sent_again_and_answered_with_the_stored_version(scheduler, tmp_path):
    model = tmp_path / "big.onnx"
    model.write_bytes(model_bytes(backbone_variant(3)))
    relay = TcpRelay(scheduler.address, cut_after_bytes=model.stat().st_size, lose_replies=True)
    try:
        result = nexus_cli("models", "upload", str(model), "--name", "big", "--no-wait",
                           "--scheduler", relay.address)
        assert result.returncode == 0, result.stderr
        assert "uploaded big version 1" in result.stdout, result.stdout
        assert relay.cut == 1 and relay.connections >= 2
        assert _versions(scheduler.address, "big") == [1]
        assert "sent again: answered with version 1, which it stored" in scheduler.log_path.read_text()
    finally:
        relay.close()
