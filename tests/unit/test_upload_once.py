"""An upload that carries the client's id is stored once (globalsched/state/modeldb.py,
globalsched/state/model_admin.py): sent again after it was stored, or while it is being stored, it is
answered with the version the first stored; a refused id is refused precisely; and an upload whose
client went away after sending it is still stored and planned."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.config import SchedulerConfig
from common.pb import control
from common.sample_models import mlp_small, model_bytes
from globalsched.planning.replan_trigger import ReplanTrigger
from globalsched.refusal import Refused
from globalsched.state.model_admin import ModelAdmin
from globalsched.state.modeldb import MAX_UPLOAD_ID_CHARS, UPLOAD_ID_KEPT_MS, ModelDatabase, UploadError

MODEL = model_bytes(mlp_small())


# ---- the database --------------------------------------------------------------------------------------


def test_the_same_upload_id_stores_one_version(tmp_path):
    db = ModelDatabase(tmp_path / "db")
    first = db.add_model("m", [MODEL], upload_id="u-1")
    again = db.add_model("m", [MODEL], upload_id="u-1")
    assert (first.version, again.version) == (1, 1)
    assert again == first
    assert [r.version for r in db.versions("m")] == [1]
    assert db.add_model("m", [MODEL], upload_id="u-2").version == 2        # another upload adds one
    assert db.add_model("m", [MODEL]).version == 3                          # and so does one without an id
    assert db.uploaded("u-1", "m") == first
    assert db.uploaded("never-sent", "m") is None


def test_an_upload_id_survives_a_restart(tmp_path):
    db = ModelDatabase(tmp_path / "db")
    stored = db.add_model("m", [MODEL], upload_id="u-1")
    db.close()
    reopened = ModelDatabase(tmp_path / "db")
    assert reopened.add_model("m", [MODEL], upload_id="u-1") == stored
    assert [r.version for r in reopened.versions("m")] == [1]


def test_an_upload_id_of_another_model_or_malformed_is_refused_and_stores_nothing(tmp_path):
    db = ModelDatabase(tmp_path / "db")
    db.add_model("m", [MODEL], upload_id="u-1")
    with pytest.raises(UploadError, match="upload id 'u-1' was an upload of model 'm', not of 'other'"):
        db.add_model("other", [MODEL], upload_id="u-1")
    with pytest.raises(UploadError, match=f"upload_id must be at most {MAX_UPLOAD_ID_CHARS} printable"):
        db.add_model("other", [MODEL], upload_id="x" * (MAX_UPLOAD_ID_CHARS + 1))
    with pytest.raises(UploadError, match="upload_id must be at most"):
        db.add_model("other", [MODEL], upload_id="bad\nid")
    assert [r.name for r in db.models()] == ["m"]


def test_an_upload_id_is_forgotten_after_its_time(tmp_path):
    db = ModelDatabase(tmp_path / "db")
    db.add_model("m", [MODEL], upload_id="old")
    long_ago = int(time.time() * 1000) - UPLOAD_ID_KEPT_MS - 1000
    db.sql.execute("UPDATE model_uploads SET created_ms=? WHERE upload_id='old'", (long_ago,))
    assert db.uploaded("old", "m") is None
    assert db.add_model("m", [MODEL], upload_id="new").version == 2     # and the old id's row goes
    assert db.sql.execute("SELECT upload_id FROM model_uploads").fetchall() == [("new",)]
    assert db.add_model("m", [MODEL], upload_id="old").version == 3


# ---- the admin RPC ---------------------------------------------------------------------------------------


def _admin(tmp_path) -> tuple[ModelAdmin, list[str]]:
    trigger = ReplanTrigger()
    requests: list[str] = []
    trigger.request = lambda why, membership=False: requests.append(why)
    admin = ModelAdmin(SchedulerConfig(data_dir=tmp_path / "db"), ModelDatabase(tmp_path / "db"), {}, trigger)
    return admin, requests


async def _stream(name: str, upload_id: str, after_last=None):
    yield control.UploadChunk(header=control.UploadHeader(name=name, load=True, upload_id=upload_id))
    yield control.UploadChunk(data=MODEL)
    if after_last is not None:
        after_last()


def test_an_upload_sent_again_is_answered_with_the_stored_version_and_plans_once(tmp_path):
    admin, requests = _admin(tmp_path)

    async def run():
        first = await admin.upload(_stream("m", "u-1"))
        again = await admin.upload(_stream("m", "u-1"))
        return first, again
    first, again = asyncio.run(run())
    assert first.model.version == again.model.version == 1
    assert first.model.sha256 == again.model.sha256
    assert requests == ["model m version 1 uploaded"]
    assert [r.version for r in admin.db.versions("m")] == [1]


def test_two_sends_of_one_upload_at_once_store_it_once(tmp_path):
    admin, requests = _admin(tmp_path)

    async def run():
        return await asyncio.gather(admin.upload(_stream("m", "u-1")), admin.upload(_stream("m", "u-1")))
    first, second = asyncio.run(run())
    assert first.model.version == second.model.version == 1
    assert requests == ["model m version 1 uploaded"]


def test_an_upload_id_in_use_by_another_model_is_refused(tmp_path):
    admin, requests = _admin(tmp_path)

    async def run():
        return await asyncio.gather(admin.upload(_stream("m", "u-1")), admin.upload(_stream("other", "u-1")),
                                    return_exceptions=True)
    stored, refused = asyncio.run(run())
    assert stored.model.version == 1
    assert isinstance(refused, Refused) and refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "upload id 'u-1' is in use by an upload of 'm'" in refused.message
    assert [r.name for r in admin.db.models()] == ["m"]

    async def later():
        return await asyncio.gather(admin.upload(_stream("other", "u-1")), return_exceptions=True)
    [refused] = asyncio.run(later())
    assert isinstance(refused, Refused) and "was an upload of model 'm', not of 'other'" in refused.message


def test_an_upload_whose_client_went_away_after_sending_it_is_stored_and_planned(tmp_path):
    admin, requests = _admin(tmp_path)

    async def run():
        loop = asyncio.get_running_loop()
        task = loop.create_task(admin.upload(_stream("m", "", after_last=lambda: loop.call_soon(task.cancel))))
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):             # the store goes on in a thread of its own
            if requests:
                break
            await asyncio.sleep(0.01)
    asyncio.run(run())
    assert requests == ["model m version 1 uploaded"]
    assert "stored" in admin.readiness.stages["m"]


def test_a_store_that_fails_unexpectedly_reaches_the_caller_and_the_log(tmp_path, caplog):
    admin, requests = _admin(tmp_path)
    admin.db.close()                        # every statement now fails: not a refusal, a fault

    async def run():
        return await asyncio.gather(admin.upload(_stream("m", "u-1")), return_exceptions=True)
    [failed] = asyncio.run(run())
    assert isinstance(failed, Exception) and not isinstance(failed, Refused)
    assert "storing an upload failed" in caplog.text
    assert requests == [] and not admin._uploading        # nothing planned; the id is free for a retry
