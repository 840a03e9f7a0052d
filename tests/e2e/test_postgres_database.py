"""The model database on a real PostgreSQL server (harness/postgres.py): the same contract as SQLite's,
shared by every scheduler that opens the URL, the migration from SQLite, and the errors an operator
meets (a password in the URL, an unreachable server, a newer schema, a damaged file)."""

from __future__ import annotations

import numpy as np
import psycopg
import pytest
import tritonclient.grpc as grpcclient

from common.config import ConfigError, SchedulerConfig
from common.database_url import DatabaseUrlError, check_postgres_url, redact
from common.profile import Profile
from common.sample_models import mlp_small, model_bytes
from common.version_policy import PolicyKind, VersionPolicy
from globalsched.state.database.connection import PostgresConnection
from globalsched.state.modeldb import ModelDatabase, ServingSettings, UploadError
from globalsched.state.querydb import QueryStore
from nexus.scheduler_client import upload_model
from tests.conftest import nexus_cli, start_serve

V1, V2 = model_bytes(mlp_small()), model_bytes(mlp_small(hidden=32))
CPU = Profile.from_json(Profile.linear(0.1, 1.0, 8, device_type="cpu").to_json())


# ---- URLs (no server) ------------------------------------------------------------------------------

@pytest.mark.parametrize("url, message", [
    ("postgresql://nexus:secret@db:5432/nexus", "carries a password"),
    ("postgresql://nexus@db:5432/nexus?password=secret", "carries a password"),
    ("mysql://nexus@db/nexus", "expected postgresql://"),
    ("postgresql://nexus@db:5432/", "name the database"),
    ("postgresql://nexus@db:port/nexus", "the port is not a number"),
])
def test_bad_database_urls_are_refused_before_connecting(url, message):
    with pytest.raises(DatabaseUrlError, match=message):
        check_postgres_url(url)
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(database=url).validate()
    assert "secret" not in redact(url) or "password=" in url


def test_a_password_in_the_url_never_reaches_the_log_or_the_error(tmp_path):
    proc = nexus_cli("scheduler", "--database", "postgresql://nexus:hunter2@127.0.0.1:1/x",
                     "--data-dir", str(tmp_path), timeout_s=60)
    assert proc.returncode == 2
    assert "carries a password" in proc.stderr and "hunter2" not in proc.stderr + proc.stdout


def test_an_unreachable_database_stops_the_scheduler_with_the_reason(tmp_path):
    proc = nexus_cli("scheduler", "--database", "postgresql://nexus@127.0.0.1:1/nexus", "--listen", "127.0.0.1:0",
                     "--data-dir", str(tmp_path), timeout_s=60)
    assert proc.returncode != 0
    assert "cannot reach the database postgresql://nexus@127.0.0.1:1/nexus" in proc.stderr
    assert "NEXUS-READY" not in proc.stdout


# ---- the database ----------------------------------------------------------------------------------

def test_every_scheduler_opening_the_url_sees_one_database(pg_url, tmp_path):
    first = ModelDatabase(tmp_path / "a", database_url=pg_url)
    try:
        r1 = first.add_model("mlp", [V1[:100], V1[100:]], slo_ms=80, min_replicas=2,
                             serving=ServingSettings(expected_rate_rps=5.0, batch_cap=16),
                             version_policy=VersionPolicy(PolicyKind.ALL))
        r2 = first.add_model("mlp", [V2], upload_id="u-2")
        first.add_profile(r2.key, CPU)
        first.save_measured(r1.key, "cpu", "served", CPU, 1, 0.15)
        QueryStore.beside(first.sql, tmp_path / "a").put("q", '{"name": "q"}')
        with pytest.raises(UploadError, match="empty model file"):
            first.add_model("empty", [b""])
        with pytest.raises(UploadError):
            first.add_model("broken", [b"not an onnx model"])
    finally:
        first.close()
    second = ModelDatabase(tmp_path / "b", database_url=pg_url)       # another machine: an empty cache
    try:
        assert [(m.name, m.version) for m in second.models()] == [("mlp", 1), ("mlp", 2)]
        assert second.read_blob(r1.sha256) == V1 and second.read_blob(r2.sha256) == V2
        assert (tmp_path / "b" / "blob-cache" / r2.sha256[:2] / r2.sha256).is_file()
        assert second.profiles(r2.key) == {"cpu": CPU}
        assert second.measured_profiles() == [(r1.key, "cpu", "served", CPU, 1, 0.15)]
        assert [(s.model, s.slo_ms) for s in second.sessions()] == [("mlp", 80.0)]
        assert second.min_replicas("mlp") == 2
        assert second.serving("mlp") == ServingSettings(5.0, 16)
        assert second.served_versions("mlp") == (1, 2)
        assert QueryStore.beside(second.sql, tmp_path / "b").all() == {"q": '{"name": "q"}'}
        assert second.add_model("mlp", [V2], upload_id="u-2") == r2      # sent again to the next leader
        assert [m.version for m in second.versions("mlp")] == [1, 2]
        # the same file again keeps its profile; a new file for version 2 drops it and its old file
        assert second.add_model("mlp", [V2], version=2).sha256 == r2.sha256 and second.profiles(r2.key)
        second.add_model("mlp", [V1], version=2)
        assert second.profiles(r2.key) == {}
        assert r2.sha256 not in {r[0] for r in second.sql.execute("SELECT sha256 FROM blobs")}
        assert second.remove_session("mlp") and second.sessions() == []
    finally:
        second.close()


def test_a_lost_connection_is_reopened_between_transactions(pg_url, tmp_path):
    db = ModelDatabase(tmp_path, database_url=pg_url)
    try:
        db.add_model("mlp", [V1])
        pid = db.sql.execute("SELECT pg_backend_pid()").fetchone()[0]
        with psycopg.connect(pg_url, autocommit=True) as admin:
            assert admin.execute("SELECT pg_terminate_backend(%s)", (pid,)).fetchone()[0]
        assert [m.name for m in db.models()] == ["mlp"]
        assert db.sql.execute("SELECT pg_backend_pid()").fetchone()[0] != pid
    finally:
        db.close()


def test_a_newer_schema_is_refused(pg_url, tmp_path):
    ModelDatabase(tmp_path / "a", database_url=pg_url).close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE nexus_schema SET version = 99")
    with pytest.raises(RuntimeError, match="has schema 99, newer than this release's 2"):
        ModelDatabase(tmp_path / "b", database_url=pg_url)


def test_a_damaged_model_file_is_detected_not_served(pg_url, tmp_path):
    db = ModelDatabase(tmp_path / "a", database_url=pg_url)
    record = db.add_model("mlp", [V1])
    db.close()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute("UPDATE blob_chunks SET data = %s WHERE seq = 0", (b"garbage",))
    other = ModelDatabase(tmp_path / "b", database_url=pg_url)
    try:
        with pytest.raises(RuntimeError, match=f"model file {record.sha256} in .* is damaged"):
            other.read_blob(record.sha256)
        assert not (tmp_path / "b" / "blob-cache" / record.sha256[:2] / record.sha256).exists()
        with pytest.raises(KeyError):
            other.read_blob("0" * 64)
    finally:
        other.close()


def test_schedulers_started_together_create_the_schema_once(pg_url, tmp_path):
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        dbs = list(pool.map(lambda i: ModelDatabase(tmp_path / str(i), database_url=pg_url), range(4)))
    for db in dbs:
        db.close()
    conn = PostgresConnection(pg_url)
    assert conn.execute("SELECT COUNT(*), MIN(version) FROM nexus_schema").fetchone() == (1, 2)
    conn.close()


# ---- migration from SQLite ------------------------------------------------------------------------

def test_migrate_copies_a_sqlite_installation_and_refuses_a_second_time(pg_url, tmp_path):
    source = ModelDatabase(tmp_path / "old")
    r1 = source.add_model("mlp", [V1], slo_ms=70, min_replicas=3)
    r2 = source.add_model("mlp", [V2])
    source.add_profile(r2.key, CPU)
    source.add_model("other", [V2], create_session=False)
    queries = QueryStore.beside(source.sql, tmp_path / "old")
    queries.put("q", '{"name": "q"}')
    queries.close()
    source.close()
    proc = nexus_cli("db", "migrate", "--from", f"sqlite:{tmp_path / 'old'}", "--to", pg_url)
    assert proc.returncode == 0, proc.stderr
    assert "2 model files" in proc.stdout and "3 models" in proc.stdout and "1 queries" in proc.stdout
    dest = ModelDatabase(tmp_path / "new", database_url=pg_url)
    try:
        assert [(m.name, m.version, m.sha256) for m in dest.models()] == \
            [("mlp", 1, r1.sha256), ("mlp", 2, r2.sha256), ("other", 1, r2.sha256)]
        assert dest.read_blob(r1.sha256) == V1 and dest.profiles(r2.key) == {"cpu": CPU}
        assert [(s.model, s.slo_ms) for s in dest.sessions()] == [("mlp", 70.0)] and dest.min_replicas("mlp") == 3
        assert QueryStore.beside(dest.sql, tmp_path / "new").all() == {"q": '{"name": "q"}'}
    finally:
        dest.close()
    again = nexus_cli("db", "migrate", "--from", f"sqlite:{tmp_path / 'old'}", "--to", pg_url)
    assert again.returncode == 1 and "already holds models: migrate into an empty database" in again.stderr


def test_migrate_refuses_a_source_whose_model_file_is_missing(pg_url, tmp_path):
    source = ModelDatabase(tmp_path / "old")
    record = source.add_model("mlp", [V1])
    source.close()
    (tmp_path / "old" / "blobs" / record.sha256[:2] / record.sha256).unlink()
    proc = nexus_cli("db", "migrate", "--from", f"sqlite:{tmp_path / 'old'}", "--to", pg_url)
    assert proc.returncode == 1 and f"model file {record.sha256} is missing from its store" in proc.stderr
    dest = ModelDatabase(tmp_path / "new", database_url=pg_url)
    try:
        assert dest.models() == []                      # nothing registered
    finally:
        dest.close()


@pytest.mark.parametrize("args, message", [
    (["--from", "/some/dir", "--to", "postgresql://u@h/d"], "expected sqlite:DIR"),
    (["--from", "sqlite:/nonexistent-dir", "--to", "postgresql://u@h/d"], "no model database here"),
    (["--from", "sqlite:/tmp", "--to", "postgresql://u:pw@h/d"], "--to: the URL carries a password"),
])
def test_migrate_refuses_bad_arguments(args, message):
    proc = nexus_cli("db", "migrate", *args, timeout_s=60)
    assert proc.returncode in (1, 2) and message in proc.stderr


# ---- a cluster on it -------------------------------------------------------------------------------

def _infer(frontend: str) -> np.ndarray:
    x = grpcclient.InferInput("input", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    return grpcclient.InferenceServerClient(frontend).infer("mlp", [x], client_timeout=30).as_numpy("logits")


@pytest.mark.slow
def test_a_cluster_serves_from_postgresql_and_a_new_scheduler_finds_its_models(pg_url, tmp_path):
    model, profile = tmp_path / "mlp.onnx", tmp_path / "profile.json"
    model.write_bytes(V1)
    profile.write_text(Profile.linear(0.1, 1.0, 16, device_type="cpu").to_json())
    first = start_serve(tmp_path / "one", "--database", pg_url, "--no-samples", "--backends", "1")
    try:
        upload_model(first.scheduler, model, "mlp", profile_path=str(profile), slo_ms=200, creds=first.creds)
        first.wait_models_ready(["mlp"])
        expected = _infer(first.frontend)
    finally:
        first.stop()
    assert not (tmp_path / "one" / "db" / "nexus.db").exists()          # nothing went to SQLite
    # the same cluster token: the database holds its fingerprint (tests/e2e/test_scheduler_standby.py)
    second = start_serve(tmp_path / "two", "--database", pg_url, "--no-samples", "--backends", "1",
                           "--token-file", str(tmp_path / "one" / "token"))
    try:
        second.wait_models_ready(["mlp"])        # no upload: the model, its file and profile are in PostgreSQL
        np.testing.assert_allclose(_infer(second.frontend), expected, rtol=1e-5)
    finally:
        second.stop()


def test_tls_to_the_database_verifies_the_server_and_a_wrong_ca_is_refused(tmp_path, monkeypatch):
    from harness.postgres import PostgresServer
    from tests.certs import make_pki

    pki, other = make_pki(tmp_path / "pki"), make_pki(tmp_path / "other", "someone-else")
    try:
        server = PostgresServer(str(pki.cert), str(pki.key))
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        monkeypatch.setenv("PGPASSFILE", str(server.passfile))
        url = server.database()
        db = ModelDatabase(tmp_path / "a", database_url=f"{url}?sslmode=verify-full&sslrootcert={pki.ca}")
        try:
            db.add_model("mlp", [V1])
            assert db.sql.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()").fetchone() == (True,)
        finally:
            db.close()
        with pytest.raises(ConnectionError, match="cannot reach the database .*certificate verify failed"):
            ModelDatabase(tmp_path / "b", database_url=f"{url}?sslmode=verify-full&sslrootcert={other.ca}")
    finally:
        server.stop()
