"""Model versions without processes: version keys and policies, the model database's versions and its
migration from the schema without them, which versions the scheduler plans, and the frontend's
resolution of a requested version."""

from __future__ import annotations

import json
import sqlite3

import grpc
import pytest

from common.pb import control, model_config
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.version_policy import (DEFAULT_POLICY, PolicyKind, VersionError, VersionPolicy, from_pb, parse_version,
                             split_key, to_pb, version_key)
from common.warmup_spec import WarmupData, WarmupInput, WarmupSample
from frontend.frontend_state import FrontendState
from frontend.requests import RequestError
from frontend.routing import RoutingTable
from globalsched.state.modeldb import SCHEMA_VERSION, ModelDatabase, ServingSettings, UploadError
from globalsched.planning.version_rollout import rates_for_versions, versions_to_plan

V1, V2 = model_bytes(mlp_small()), model_bytes(mlp_small(hidden=32))
CPU = Profile.from_json(Profile.linear(0.1, 1.0, 8, device_type="cpu").to_json())   # as stored


# ---- keys and policies -----------------------------------------------------------------------------

def test_version_keys_round_trip_and_version_1_is_the_bare_name():
    assert version_key("mlp", 1) == "mlp" and version_key("mlp", 12) == "mlp:12"
    for key in ("mlp", "mlp:12", "q/stage", "a.b-c_d:3"):
        assert version_key(*split_key(key)) == key
    assert split_key("q/stage") == ("q/stage", 1) and split_key("m:x") == ("m:x", 1)
    assert parse_version("7") == 7
    for bad in ("0", "-1", "x", "", "1.5"):
        with pytest.raises(VersionError, match="not a positive integer"):
            parse_version(bad)


def test_policies_select_as_triton_does():
    stored = [3, 1, 2, 5]
    assert DEFAULT_POLICY.select(stored) == (5,)
    assert VersionPolicy(PolicyKind.LATEST, num_versions=2).select(stored) == (3, 5)
    assert VersionPolicy(PolicyKind.LATEST, num_versions=9).select(stored) == (1, 2, 3, 5)
    assert VersionPolicy(PolicyKind.ALL).select(stored) == (1, 2, 3, 5)
    assert VersionPolicy(PolicyKind.SPECIFIC, versions=(2, 4)).select(stored) == (2,)
    assert DEFAULT_POLICY.select([]) == ()
    for policy in (VersionPolicy(PolicyKind.ALL), VersionPolicy(PolicyKind.SPECIFIC, versions=(1, 3)),
                   VersionPolicy(PolicyKind.LATEST, num_versions=3)):
        assert from_pb(to_pb(policy)) == policy == VersionPolicy.from_json(policy.to_json())
    assert from_pb(model_config.ModelVersionPolicy()) == DEFAULT_POLICY      # none chosen: Triton's default
    assert VersionPolicy(PolicyKind.SPECIFIC, versions=(1, 3)).describe() == "specific { versions: [1, 3] }"


@pytest.mark.parametrize("make, message", [
    (lambda: VersionPolicy(PolicyKind.LATEST, num_versions=0), "num_versions must be at least 1, got 0"),
    (lambda: VersionPolicy(PolicyKind.SPECIFIC), "list at least one version"),
    (lambda: VersionPolicy(PolicyKind.SPECIFIC, versions=(2, -1)), "versions must be positive, got -1"),
])
def test_bad_policies_are_refused_saying_why(make, message):
    with pytest.raises(VersionError, match=message):
        make()


# ---- the model database ----------------------------------------------------------------------------

def test_uploads_add_versions_and_the_policy_chooses_what_is_served(tmp_path):
    db = ModelDatabase(tmp_path)
    first = db.add_model("mlp", [V1], profile_json=CPU.to_json(), slo_ms=40, min_replicas=2)
    db.add_model("mlp", [V1], version=1)                                 # the same file again
    assert db.profiles("mlp") == {"cpu": CPU}                            # keeps the profiles that measure it
    second = db.add_model("mlp", [V2])                                   # no version: the next one
    assert (first.version, first.key, second.version, second.key) == (1, "mlp", 2, "mlp:2")
    assert second.default_slo_ms == 40                                   # the model's SLO carries over
    assert [r.version for r in db.versions("mlp")] == [1, 2] and db.versions("nope") == []
    assert db.model("mlp").sha256 == first.sha256 and db.model("mlp:2").sha256 == second.sha256
    assert db.profiles("mlp") and db.profiles("mlp:2") == {}             # profiles are per version
    assert db.min_replicas("mlp") == 2 and [s.model for s in db.sessions()] == ["mlp"]
    assert db.served_versions("mlp") == (2,) and db.newest("mlp").version == 2
    db.add_model("mlp", [V1], version=5, version_policy=VersionPolicy(PolicyKind.SPECIFIC, versions=(1, 5)))
    assert db.served_versions("mlp") == (1, 5) and db.newest("mlp").version == 5
    assert db.add_model("mlp", [V2], version=1).sha256 == second.sha256    # a stored version is replaced
    assert db.model("mlp").sha256 == second.sha256 and db.profiles("mlp") == {}
    assert db.add_model("mlp", [V1]).version == 6                        # after the newest, not after the last
    db.add_model("other", [V1], create_session=False, version_policy=VersionPolicy(PolicyKind.SPECIFIC,
                                                                                   versions=(9,)))
    assert db.served_versions("other") == () and db.newest("other").version == 1      # none served: newest stored
    db.close()
    again = ModelDatabase(tmp_path)                                      # durable
    assert [(r.name, r.version) for r in again.models()] == [("mlp", 1), ("mlp", 2), ("mlp", 5), ("mlp", 6),
                                                            ("other", 1)]
    assert again.version_policy("mlp") == VersionPolicy(PolicyKind.SPECIFIC, versions=(1, 5))
    again.close()


def test_bad_versions_and_profiles_of_unknown_versions_are_refused(tmp_path):
    db = ModelDatabase(tmp_path)
    with pytest.raises(UploadError, match="version must be a positive integer .* got -2"):
        db.add_model("mlp", [V1], version=-2)
    with pytest.raises(UploadError, match="invalid model name 'mlp:2'"):
        db.add_model("mlp:2", [V1])                                       # ':' would make keys ambiguous
    assert db.models() == []
    db.add_model("mlp", [V1])
    with pytest.raises(KeyError, match=r"model 'mlp' has no version 3 \(stored: 1\)"):
        db.add_profile("mlp:3", CPU)
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        db.add_profile("nope", CPU)
    db.add_model("mlp", [V1], version=2**63 - 1)
    with pytest.raises(UploadError, match="the largest there is: give --version"):
        db.add_model("mlp", [V2])
    db.close()


# The schema of releases before versions (schema 1): one file per model name.
SCHEMA_1 = """
CREATE TABLE models (name TEXT PRIMARY KEY, sha256 TEXT NOT NULL, runtime TEXT NOT NULL, size_bytes INTEGER NOT NULL,
    io_json TEXT NOT NULL, default_slo_ms REAL NOT NULL, prefix_group TEXT NOT NULL DEFAULT '',
    prefix_signature TEXT NOT NULL DEFAULT '', created_ms INTEGER NOT NULL);
CREATE TABLE profiles (model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE, device_type TEXT NOT NULL,
    profile_json TEXT NOT NULL, PRIMARY KEY (model, device_type));
CREATE TABLE sessions (model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE, slo_ms REAL NOT NULL);
CREATE TABLE model_replicas (model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    min_replicas INTEGER NOT NULL);
CREATE TABLE model_serving (model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    expected_rate_rps REAL NOT NULL, batch_cap INTEGER NOT NULL);
CREATE TABLE measured_profiles (model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
    device_type TEXT NOT NULL, basis TEXT NOT NULL, profile_json TEXT NOT NULL, raise_streak INTEGER NOT NULL,
    margin REAL NOT NULL, PRIMARY KEY (model, device_type));
CREATE TABLE model_warmup (model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    samples_json TEXT NOT NULL);
"""


def _schema_1_database(path, with_warmup_table: bool = True) -> tuple[str, str]:
    """A database as releases before versions wrote it, holding 'mlp' (served, with everything) and
    'stored' (not served); returns their files' sha256."""
    import hashlib

    path.mkdir(parents=True)
    db = sqlite3.connect(path / "nexus.db")
    schema = SCHEMA_1 if with_warmup_table else SCHEMA_1[:SCHEMA_1.index("CREATE TABLE model_warmup")]
    db.executescript(schema)
    io = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [64]}],
                     "outputs": [{"name": "logits", "datatype": "FP32", "shape": [10]}]})
    shas = []
    for name, data in (("mlp", V1), ("stored", V2)):
        sha = hashlib.sha256(data).hexdigest()
        (path / "blobs" / sha[:2]).mkdir(parents=True, exist_ok=True)
        (path / "blobs" / sha[:2] / sha).write_bytes(data)
        db.execute("INSERT INTO models VALUES (?,?,?,?,?,?,?,?,?)", (name, sha, "onnxruntime", len(data), io, 40.0,
                                                                     "", "", 1))
        shas.append(sha)
    db.execute("INSERT INTO profiles VALUES ('mlp', 'cpu', ?)", (CPU.to_json(),))
    db.execute("INSERT INTO sessions VALUES ('mlp', 35.0)")
    db.execute("INSERT INTO model_replicas VALUES ('mlp', 2)")
    db.execute("INSERT INTO model_serving VALUES ('mlp', 12.5, 8)")
    db.execute("INSERT INTO measured_profiles VALUES ('mlp', 'cpu', 'table', ?, 1, 0.05)", (CPU.to_json(),))
    if with_warmup_table:
        sample = WarmupSample("zeros", 2, (WarmupInput("input", "FP32", (64,), WarmupData.ZERO),), 1)
        from common.warmup_spec import to_json
        db.execute("INSERT INTO model_warmup VALUES ('mlp', ?)", (to_json((sample,)),))
    db.commit()
    db.close()
    return shas[0], shas[1]


@pytest.mark.parametrize("with_warmup_table", [True, False])
def test_a_database_from_before_versions_is_migrated_its_models_becoming_version_1(tmp_path, with_warmup_table):
    path = tmp_path / "db"
    sha_mlp, sha_stored = _schema_1_database(path, with_warmup_table)
    db = ModelDatabase(path)
    assert [(r.name, r.version, r.sha256) for r in db.models()] == [("mlp", 1, sha_mlp), ("stored", 1, sha_stored)]
    assert db.profiles("mlp") == {"cpu": CPU} and db.served_versions("mlp") == (1,)
    assert [(s.model, s.slo_ms) for s in db.sessions()] == [("mlp", 35.0)]
    assert db.min_replicas("mlp") == 2 and db.serving("mlp") == ServingSettings(12.5, 8)
    assert len(db.model("mlp").warmup) == (1 if with_warmup_table else 0)
    assert db.measured_profiles() == [("mlp", "cpu", "table", CPU, 1, 0.05)]   # kept, as version 1's
    assert db.read_blob(sha_mlp) == V1 and db.read_blob(sha_stored) == V2     # no blob was collected
    assert db.add_model("mlp", [V2]).key == "mlp:2"                            # and it takes versions now
    db.add_profile("mlp:2", CPU)
    db.save_measured("mlp:2", "cpu", "table", CPU, 0, 0.1)
    db.save_measured("gone:3", "cpu", "table", CPU, 0, 0.1)                    # a version not stored: ignored
    db.close()
    raw = sqlite3.connect(path / "nexus.db")
    assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert not [t for (t,) in raw.execute("SELECT name FROM sqlite_master WHERE name LIKE '%_v1'")]
    assert raw.execute("PRAGMA foreign_key_check").fetchall() == []
    raw.close()
    again = ModelDatabase(path)                     # opening a migrated database again changes nothing
    assert [r.key for r in again.models()] == ["mlp", "mlp:2", "stored"] and again.profiles("mlp:2") == {"cpu": CPU}
    assert [row[:2] for row in again.measured_profiles()] == [("mlp", "cpu"), ("mlp:2", "cpu")]
    again.delete_measured("mlp:2", "cpu")
    assert [row[:2] for row in again.measured_profiles()] == [("mlp", "cpu")]
    again.close()


def test_a_database_of_a_newer_schema_is_refused(tmp_path):
    db = sqlite3.connect(tmp_path / "nexus.db")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(RuntimeError, match=f"has schema {SCHEMA_VERSION + 1}, newer than this release's"):
        ModelDatabase(tmp_path)


# ---- which versions the scheduler plans ------------------------------------------------------------

def test_an_old_version_serves_until_the_new_one_is_routed_and_its_grace_is_over():
    # v1 served; v2 uploaded with the default policy: plan both until v2 is routed, then 2 s more.
    assert versions_to_plan([2], {1: 0.0}, now_s=10.0) == (1, 2)
    assert versions_to_plan([2], {1: 0.0, 2: 10.0}, now_s=11.0, grace_s=2.0) == (1, 2)
    assert versions_to_plan([2], {1: 0.0, 2: 10.0}, now_s=12.0, grace_s=2.0) == (2,)
    assert versions_to_plan([2], {}, now_s=0.0) == (2,)                  # nothing routed (a fresh scheduler)
    assert versions_to_plan([1, 2], {1: 0.0}, now_s=99.0) == (1, 2)      # policy all: nothing retires
    assert versions_to_plan([], {1: 0.0}, now_s=99.0) == (1,)            # a policy selecting nothing stored


def test_the_newest_version_is_planned_for_the_demand_moving_to_it():
    rates = {"mlp": 30.0, "mlp:2": 5.0, "mlp:3": 1.0, "other": 7.0, "q/mlp": 2.0}
    # Policy latest: versions 1 and 2 (retiring, or gone) hand their demand to 3.
    assert rates_for_versions({"mlp": [3]}, rates) == {**rates, "mlp:3": 36.0}
    # Policy all: a version asked for by number keeps its own demand.
    assert rates_for_versions({"mlp": [1, 2, 3]}, rates) == rates
    assert rates_for_versions({"new": [1]}, {"other": 3.0}) == {"other": 3.0}   # none measured: no rate made up
    assert rates_for_versions({"mlp": []}, rates) == rates                       # selecting none keeps its rates
    # Several models in one pass: each hands its retired versions' demand to its own newest.
    both = rates_for_versions({"mlp": [3], "other": [2]}, {**rates, "other:2": 1.0})
    assert both["mlp:3"] == 36.0 and both["other:2"] == 8.0 and both["q/mlp"] == 2.0


# ---- the frontend's resolution ---------------------------------------------------------------------

def _desc(name: str, version: int) -> control.ModelDesc:
    return control.ModelDesc(name=name, version=version, runtime="onnxruntime",
                             inputs=[control.TensorDesc(name="input", datatype="FP32", shape=[64])],
                             outputs=[control.TensorDesc(name="logits", datatype="FP32", shape=[10])])


def _route(name: str, version: int, ready: bool, session: str = "") -> control.ModelRoute:
    backends = [control.BackendRoute(node_id="be", address="127.0.0.1:1", weight=1.0)] if ready else []
    key = version_key(name, version)
    return control.ModelRoute(model=_desc(name, version), backends=backends, reason="" if ready else "warming",
                              session=session if session else (key if key != name else ""))


def test_a_request_without_a_version_goes_to_the_newest_ready_one():
    table = RoutingTable.from_proto(control.RoutingTable(
        epoch=1, routes=[_route("m", 1, True), _route("m", 2, True), _route("m", 3, False),
                         _route("m", 2, True, session="q/m")],
        stored=[_desc("m", 4)]))
    state = FrontendState()
    state.table = table
    assert sorted(table.versions["m"]) == [1, 2, 3, 4] and "q/m" in table.models
    newest = state.entry("m")
    assert (newest.name, newest.version, newest.session) == ("m", 2, "m:2")    # 3 has no backend yet
    assert state.entry("m", "1").session == "m" and state.entry("m", "3").reason == "warming"
    assert not state.entry("m", "4").served
    assert [e.version for e in table.served_versions("m")] == [1, 2, 3]
    for version in ("7", "0", "x", "-1"):
        with pytest.raises(RequestError) as info:
            state.entry("m", version)
        assert info.value.code is grpc.StatusCode.NOT_FOUND
        assert str(info.value) == f"model 'm' has no version '{version}' (its versions: 1, 2, 3, 4)"
    for name in ("m:2", "nope"):        # a version key is no model name
        with pytest.raises(RequestError, match=f"unknown model '{name}'"):
            state.entry(name)
    from common.sample_queries import sample_query_json

    state.table = RoutingTable.from_proto(control.RoutingTable(
        epoch=3, queries=[control.QueryInfo(name="traffic", json=sample_query_json("traffic"))]))
    assert state.entry("traffic", "1").name == "traffic" == state.entry("traffic").name
    with pytest.raises(RequestError, match=r"query 'traffic' has no version '2' \(a query has version 1 only\)"):
        state.entry("traffic", "2")
    only_coming = RoutingTable.from_proto(control.RoutingTable(epoch=2, routes=[_route("m", 5, False)],
                                                               stored=[_desc("m", 1)]))
    assert only_coming.newest("m").version == 5          # none ready: the newest served says why


# ---- the scheduler's refusals and reasons (in process) ---------------------------------------------

def _scheduler(tmp_path):
    from common.config import SchedulerConfig
    from globalsched.rpc.service import SchedulerService

    db = ModelDatabase(tmp_path / "db")
    db.add_model("m", [V1], profile_json=CPU.to_json(), slo_ms=50)
    return SchedulerService(SchedulerConfig(data_dir=tmp_path / "db"), db)


async def _chunks(header: control.UploadHeader, data: bytes):
    yield control.UploadChunk(header=header)
    yield control.UploadChunk(data=data)


@pytest.mark.parametrize("header, code, message", [
    (control.UploadHeader(name="m", version=-1), grpc.StatusCode.INVALID_ARGUMENT,
     "upload of 'm' refused: version must be a positive integer (0: the next one), got -1"),
    (control.UploadHeader(name="m", version_policy=model_config.ModelVersionPolicy(latest={})),
     grpc.StatusCode.INVALID_ARGUMENT,
     "upload of 'm' refused: version_policy latest: num_versions must be at least 1, got 0"),
])
def test_uploads_with_a_bad_version_or_policy_are_refused_and_register_nothing(tmp_path, header, code, message):
    import asyncio

    from globalsched.refusal import Refused

    service = _scheduler(tmp_path)
    with pytest.raises(Refused) as info:
        asyncio.run(service.admin.upload(_chunks(header, V2)))
    assert (info.value.code, info.value.message) == (code, message)
    assert [r.key for r in service.db.models()] == ["m"]


def test_a_profile_for_an_unknown_version_is_not_found_and_a_bare_name_means_the_newest(tmp_path):
    import asyncio

    from globalsched.refusal import Refused

    service = _scheduler(tmp_path)
    service.db.add_model("m", [V2])
    with pytest.raises(Refused) as info:
        asyncio.run(service.admin.add_profile(control.ProfileUpload(model="m", version=4, profile_json=CPU.to_json())))
    assert info.value.code is grpc.StatusCode.NOT_FOUND
    assert info.value.message == "model 'm' has no version 4 (stored: 1, 2)"
    asyncio.run(service.admin.add_profile(control.ProfileUpload(model="m", profile_json=CPU.to_json())))
    assert service.db.profiles("m:2") == {"cpu": CPU}


def test_a_policy_selecting_no_stored_version_is_routed_with_the_reason(tmp_path):
    import asyncio

    service = _scheduler(tmp_path)
    service.db.add_model("m", [V2], version=1, version_policy=VersionPolicy(PolicyKind.SPECIFIC, versions=(9,)))

    async def routes():
        plan = await service.control.plan_once()
        return {r.session or r.model.name: r for r in service.distribution.routing_table(plan, 1).routes}

    route = asyncio.run(routes())["m"]
    assert not route.backends and route.model.version == 1
    assert route.reason == "its version_policy (specific { versions: [9] }) selects none of the stored versions (1)"
