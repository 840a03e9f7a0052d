"""The model database's cached reads (``keep_reads``, the leading scheduler's): every write through
the database is seen by the next read, and what another process writes is seen once the cache is
forgotten (a scheduler taking the lead forgets it)."""

from __future__ import annotations

import pytest

from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.version_policy import PolicyKind, VersionPolicy
from globalsched.state.modeldb import ModelDatabase, ServingSettings

MLP = model_bytes(mlp_small())
CPU = Profile.linear(0.1, 1.0, 8, device_type="cpu")


def _reads(db: ModelDatabase) -> tuple:
    return (db.model("mlp"), db.model("mlp:2"), [r.key for r in db.models()], [r.version for r in db.versions("mlp")],
            db.version_policy("mlp"), db.served_versions("mlp"), sorted(db.profiles("mlp")), db.sessions(),
            db.min_replicas("mlp"), db.serving("mlp"))


@pytest.fixture
def db(tmp_path):
    db = ModelDatabase(tmp_path)
    db.add_model("mlp", [MLP], profile_json=CPU.to_json(), slo_ms=50)
    db.keep_reads = True
    yield db
    db.close()


def test_every_write_is_seen_by_the_next_read(db, tmp_path):
    fresh = ModelDatabase(tmp_path)          # reads the file every time: what the truth is

    def same() -> None:
        assert _reads(db) == _reads(fresh)

    same()
    db.set_min_replicas("mlp", 2)
    same()
    db.set_session("mlp", 80.0)
    same()
    db.add_profile("mlp", Profile.linear(0.2, 2.0, 8, device_type="t4"))
    same()
    db.add_model("mlp", [MLP], version=2, serving=ServingSettings(30.0, 4),
                 version_policy=VersionPolicy(PolicyKind.SPECIFIC, versions=(2,)))
    same()
    assert db.served_versions("mlp") == (2,) and db.serving("mlp").batch_cap == 4
    assert db.remove_session("mlp")
    same()
    assert db.sessions() == []
    fresh.close()


def test_a_read_is_kept_until_a_write_and_another_writer_is_seen_once_forgotten(db, tmp_path):
    assert db.min_replicas("mlp") == 0
    other = ModelDatabase(tmp_path)           # another process writes (a scheduler that led before)
    other.set_min_replicas("mlp", 3)
    assert db.min_replicas("mlp") == 0        # kept: this one is the only writer while it leads
    db.forget_reads()
    assert db.min_replicas("mlp") == 3
    other.set_min_replicas("mlp", 1)
    db.set_session("mlp", 60.0)               # its own write: everything is read again
    assert db.min_replicas("mlp") == 1
    db.keep_reads = False                     # not leading: every read is fresh
    other.set_min_replicas("mlp", 4)
    assert db.min_replicas("mlp") == 4
    other.close()


def test_a_refused_write_leaves_no_stale_read(db):
    before = _reads(db)
    with pytest.raises(KeyError):
        db.set_min_replicas("nope", 1)
    with pytest.raises(ValueError):
        db.set_min_replicas("mlp", -1)
    assert _reads(db) == before
    callers_copy = db.models()
    callers_copy.clear()                      # a caller's list is its own
    assert [r.key for r in db.models()] == ["mlp"]
