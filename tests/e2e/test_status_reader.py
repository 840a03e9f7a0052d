"""nexus/scheduler_client.py's StatusReader against real schedulers: it keeps one channel to the
scheduler that answered, passes over one that is not there, says so when none is, dials again once one
is back, and reports a refusal with the scheduler's reason; it fails at once where a one-off read
pauses to ask again."""

from __future__ import annotations

import pytest

from common.security import Credentials
from harness.ports import free_port
from nexus.scheduler_client import AdminCallError, StatusReader, fetch_status
from tests.conftest import NexusProcess


def _scheduler(tmp_path, name: str, port: int, *extra: str) -> NexusProcess:
    return NexusProcess(tmp_path / f"{name}.log", "scheduler", "--listen", f"127.0.0.1:{port}", "--data-dir",
                        str(tmp_path / name), "--metrics-listen", "", *extra)


def test_one_channel_is_kept_to_the_scheduler_that_answers_and_dialled_again_after_it_was_lost(tmp_path,
                                                                                              caplog):
    port, nobody = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    first = _scheduler(tmp_path, "first", port)
    reader = StatusReader(f"127.0.0.1:{nobody},{address}", timeout_s=5.0)
    try:
        status = reader()
        assert reader.address == address and status.devices == ()
        kept = reader._channel
        for _ in range(20):
            reader()
        assert reader._channel is kept and reader.address == address
        first.kill()
        with pytest.raises(AdminCallError, match=f"cannot reach the scheduler at {address}"):
            reader()
        assert "no scheduler took" not in caplog.text          # no pause: its caller reads again soon
        with pytest.raises(AdminCallError, match=f"cannot reach the scheduler at {address}"):
            fetch_status(f"127.0.0.1:{nobody},{address}", timeout_s=5.0)
        assert f"no scheduler took GetStatus (127.0.0.1:{nobody}, {address}); asking again" in caplog.text
        assert reader.address == "" and reader._channel is None
        second = _scheduler(tmp_path, "second", port)
        try:
            assert reader().devices == () and reader.address == address
        finally:
            second.stop()
    finally:
        reader.close()
        first.stop()


def test_a_stalled_scheduler_fails_the_read_and_the_next_read_dials_afresh(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    scheduler = _scheduler(tmp_path, "stalled", port)
    reader = StatusReader(address, timeout_s=1.0)
    try:
        reader()
        assert reader.address == address
        scheduler.pause()
        with pytest.raises(AdminCallError, match="Deadline Exceeded"):
            reader()
        assert reader.address == "" and reader._channel is None
        scheduler.resume()
        assert reader().devices == () and reader.address == address
    finally:
        reader.close()
        scheduler.stop()


def test_a_refusal_raises_the_schedulers_reason(tmp_path):
    token = tmp_path / "cluster.token"
    token.write_text("t" * 64 + "\n")
    port = free_port()
    secured = _scheduler(tmp_path, "secured", port, "--token-file", str(token))
    try:
        wrong = StatusReader(f"127.0.0.1:{port}", timeout_s=5.0, creds=Credentials(token="w" * 64))
        with pytest.raises(AdminCallError) as refused:
            wrong()
        assert "token" in str(refused.value).lower() and "cannot reach" not in str(refused.value)
        assert wrong.address == ""
        right = StatusReader(f"127.0.0.1:{port}", timeout_s=5.0, creds=Credentials(token="t" * 64))
        assert right().devices == () and right.address == f"127.0.0.1:{port}"
        right.close()
    finally:
        secured.stop()
