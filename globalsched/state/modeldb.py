"""The durable model database: metadata plus content-addressed model files, on SQLite or PostgreSQL.

Layout under the data directory, with SQLite (the embedded default)::

    nexus.db                 SQLite: model versions, profiles (per version and device type), sessions,
                             the measured profiles in use (per version, globalsched/state/profile_book.py)
    blobs/ab/abcdef...       model files, named by their SHA-256
    tmp/                     uploads in progress (removed on failure)

With ``database_url`` (``postgresql://...``, the production option) the same tables live in that
PostgreSQL database, the model files too (globalsched/state/database/blobs.py says why), and the data
directory holds only ``tmp/`` and ``blob-cache/``, a local copy of the files this scheduler has read.
Every scheduler of a cluster opens the same URL; one of them writes (the leader).

Versions (common/version_policy.py): a model is a name with versions 1, 2, ...; each version has its own
file, input/output description, prefix group, warm-up samples and profiles, and is addressed by its
version key (``name:version``, version 1's is the bare name). What is served is per name: whether
the model is loaded (its session, with the SLO), its minimum replicas, serving settings and version
policy; :meth:`ModelDatabase.served_versions` applies the policy to the stored versions. An upload
without a version adds the next one after the newest (1 for a new model); an upload of a stored
version replaces that version.

Schema versions (SQLite's ``PRAGMA user_version``, PostgreSQL's ``nexus_schema`` table): 2 has
versions. A SQLite database of schema 1 (one file per name) is migrated when opened, in one
transaction: every model becomes version 1 of itself. A PostgreSQL database starts at schema 2; a
newer schema than this release's is refused on both.

Contract: an upload is validated completely before anything is registered, and registration is one
transaction, so a failed upload leaves no model behind. An upload that carries the client's id is
registered at most once: the id is stored in the same transaction, and a retry with it (the client
could not tell whether the first arrived) returns what the first stored. Blobs are immutable; a blob that no
model row references is garbage and is removed at start-up.

Threads and the event loop: uploads run in a thread (``asyncio.to_thread``); the long parts of an
upload (streaming to disk, hashing, validating, choosing the prefix group) hold only
``_upload_lock``, which nothing on the scheduler's event loop takes. ``_lock`` guards the metadata
connection and is held for one statement, or for the registration transaction (a few statements),
so a metadata read on the loop waits at most that long. Model files are never read on the loop:
:meth:`open_blob` and the reads go through a thread.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Iterable

from common.late_requests import LateRequests
from common.model_io import ModelFileError, io_to_json, onnx_io, parse_io_json, torch_archive_check
from common.profile import Profile, ProfileError
from common.tensors import TensorSpec
from common.warmup_spec import WarmupError, WarmupSample, check_samples
from common.warmup_spec import from_json as warmup_from_json, to_json as warmup_to_json
from common.version_policy import DEFAULT_POLICY, VersionPolicy, split_key, version_key
from globalsched.state.database.blobs import FileBlobStore, PostgresBlobStore
from globalsched.planning.prefix_groups import joining_members, prefix_share
from globalsched.state.database.connection import SCHEMA_LOCK_KEY, Dialect, PostgresConnection, SqliteConnection, upsert

log = logging.getLogger("nexus.scheduler")

RUNTIMES = ("onnxruntime", "torch", "emulated")
MAX_MIN_REPLICAS = 64

SCHEMA_VERSION = 2
MAX_VERSION = 2**63 - 1        # Triton's versions are int64
UPLOAD_ID_KEPT_MS = 24 * 3600 * 1000    # how long an upload's id is remembered (a retry within it is answered)
MAX_UPLOAD_ID_CHARS = 128

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL,
    version BIGINT NOT NULL CHECK (version >= 1),
    sha256 TEXT NOT NULL,
    runtime TEXT NOT NULL,
    size_bytes BIGINT NOT NULL,
    io_json TEXT NOT NULL,
    default_slo_ms DOUBLE PRECISION NOT NULL,
    prefix_group TEXT NOT NULL DEFAULT '',
    prefix_signature TEXT NOT NULL DEFAULT '',
    created_ms BIGINT NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS profiles (
    model TEXT NOT NULL,
    version BIGINT NOT NULL,
    device_type TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    PRIMARY KEY (model, version, device_type),
    FOREIGN KEY (model, version) REFERENCES models(name, version) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS model_warmup (
    model TEXT NOT NULL,
    version BIGINT NOT NULL,
    samples_json TEXT NOT NULL,
    PRIMARY KEY (model, version),
    FOREIGN KEY (model, version) REFERENCES models(name, version) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS sessions (
    model TEXT PRIMARY KEY,
    slo_ms DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS model_replicas (
    model TEXT PRIMARY KEY,
    min_replicas INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS model_serving (
    model TEXT PRIMARY KEY,
    expected_rate_rps DOUBLE PRECISION NOT NULL,
    batch_cap INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS model_late_requests (
    model TEXT PRIMARY KEY,
    action TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS version_policies (
    model TEXT PRIMARY KEY,
    policy_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS measured_profiles (
    model TEXT NOT NULL,
    version BIGINT NOT NULL,
    device_type TEXT NOT NULL,
    basis TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    raise_streak INTEGER NOT NULL,
    margin DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (model, version, device_type),
    FOREIGN KEY (model, version) REFERENCES models(name, version) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS model_uploads (
    upload_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    version BIGINT NOT NULL,
    created_ms BIGINT NOT NULL
)
"""

# Schema 1 -> 2: each table's rows, copied into the new table (every model becomes its version 1).
_MIGRATION_1_TO_2 = (
    ("models", "INSERT INTO models SELECT name, 1, sha256, runtime, size_bytes, io_json, default_slo_ms, "
               "prefix_group, prefix_signature, created_ms FROM models_v1"),
    ("profiles", "INSERT INTO profiles SELECT model, 1, device_type, profile_json FROM profiles_v1"),
    ("model_warmup", "INSERT INTO model_warmup SELECT model, 1, samples_json FROM model_warmup_v1"),
    ("sessions", "INSERT INTO sessions SELECT model, slo_ms FROM sessions_v1"),
    ("model_replicas", "INSERT INTO model_replicas SELECT model, min_replicas FROM model_replicas_v1"),
    ("model_serving", "INSERT INTO model_serving SELECT model, expected_rate_rps, batch_cap FROM model_serving_v1"),
    ("measured_profiles", "INSERT INTO measured_profiles SELECT model, 1, device_type, basis, profile_json, "
                          "raise_streak, margin FROM measured_profiles_v1"),
)


class UploadError(ValueError):
    """An upload refused; nothing was registered. The message says why."""


@dataclass(frozen=True)
class ModelRecord:
    """One stored version of a model."""

    name: str
    sha256: str
    runtime: str
    size_bytes: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    default_slo_ms: float
    prefix_group: str
    created_ms: int
    warmup: tuple[WarmupSample, ...] = ()     # config.pbtxt's model_warmup; empty: the backends' default
    version: int = 1

    @property
    def key(self) -> str:
        """The version key (common/version_policy.py): the session name this version is served under."""
        return version_key(self.name, self.version)


@dataclass(frozen=True)
class ServingSettings:
    """How a model is to be served beyond its SLO: the rate to plan for before one is measured (0: the
    scheduler's default), the largest batch (config.pbtxt's max_batch_size; 0: no cap) and what
    becomes of its late requests (common/late_requests.py; stored apart from the other two, set at
    upload only when given)."""

    expected_rate_rps: float = 0.0
    batch_cap: int = 0
    late_requests: LateRequests = LateRequests.DROP


@dataclass(frozen=True)
class SessionRecord:
    """A loaded model (by name: its versions are served as its version policy selects) and its SLO."""

    model: str
    slo_ms: float


class ModelDatabase:
    """Thread-safe access to the model database in ``data_dir``.

    Methods about one version take its version key (``name:version``, the bare name for version 1);
    methods about what is served (sessions, replicas, serving settings, the version policy) take the
    model's name."""

    def __init__(self, data_dir: pathlib.Path, max_upload_bytes: int = 512 * 1024 * 1024,
                 read_only: bool = False, database_url: str = "") -> None:
        """``read_only``: read a database another process (a running scheduler) owns: nothing is
        created, migrated or collected, and a directory without a database is an error
        (FileNotFoundError; RuntimeError for another schema version). ``database_url``: the metadata
        and the model files are in this PostgreSQL database (ConnectionError when it cannot be
        reached, :class:`~globalsched.state.database.connection.DatabaseUrlError` for a malformed URL)."""
        self.data_dir = pathlib.Path(data_dir)
        self.tmp_dir = self.data_dir / "tmp"
        self.max_upload_bytes = max_upload_bytes
        self._upload_lock = threading.Lock()
        self.profiles_version = 0       # bumps whenever a model or a table is stored (readers cache by it)
        self._db: SqliteConnection | PostgresConnection
        if database_url:
            self._db = PostgresConnection(database_url)
            self.describe = self._db.describe
            try:
                self.blobs = PostgresBlobStore(database_url, self.data_dir / "blob-cache", read_only)
            except BaseException:
                self._db.close()
                raise
        else:
            path = self.data_dir / "nexus.db"
            self.describe = str(path)
            if read_only and not path.is_file():
                raise FileNotFoundError(f"{self.data_dir}: no model database here (no nexus.db)")
            if not read_only:
                self.data_dir.mkdir(parents=True, exist_ok=True)
            self._db = SqliteConnection(path, read_only)
            self.blobs = FileBlobStore(self.data_dir / "blobs")
        self._lock = self._db.lock
        self._sql = self._db
        self._db = _CountedWrites(self._db)
        self.keep_reads = False         # cache reads until the next write (:meth:`_read`)
        self._reads: dict[tuple, object] = {}
        self._reads_at = -1             # the write count the cached reads were made at
        if read_only:
            version = self._schema_version()
            if version != SCHEMA_VERSION:
                self.close()
                raise RuntimeError(f"{self.describe} has schema {version}; this release reads {SCHEMA_VERSION}")
            return
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self._open_schema()
        if self._db.dialect is Dialect.SQLITE:
            self._db.execute("PRAGMA foreign_keys = ON")
        self._collect_garbage()

    @property
    def dialect(self) -> Dialect:
        return self._db.dialect

    @property
    def sql(self) -> SqliteConnection | PostgresConnection:
        """The metadata connection, for the stores that keep their tables beside the models' (queries)."""
        return self._sql

    def forget_reads(self) -> None:
        """Read the database afresh from now on (another process may have written it)."""
        with self._lock:
            self._reads.clear()

    def _read(self, key: tuple, read):
        """``read()``, or what it returned before when nothing was written since and :attr:`keep_reads`
        holds (the scheduler that leads is the database's only writer: a plan reads each model's
        records several times, and thousands of models were thousands of statements at every
        evaluation). What is returned is shared: callers do not change it."""
        if not self.keep_reads:
            return read()
        with self._lock:
            if self._db.writes != self._reads_at:
                self._reads.clear()
                self._reads_at = self._db.writes
            try:
                return self._reads[key]
            except KeyError:
                value = self._reads[key] = read()
                return value

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if isinstance(self.blobs, PostgresBlobStore):
            self.blobs.close()

    # ---- schema ------------------------------------------------------------------------------------

    def _schema_version(self) -> int:
        if self._db.dialect is Dialect.SQLITE:
            return self._db.execute("PRAGMA user_version").fetchone()[0]
        row = self._db.execute("SELECT to_regclass('nexus_schema') IS NOT NULL").fetchone()
        if not row[0]:
            return 0
        row = self._db.execute("SELECT version FROM nexus_schema").fetchone()
        return row[0] if row else 0

    def _open_schema(self) -> None:
        version = self._schema_version()
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.describe} has schema {version}, newer than this release's "
                               f"{SCHEMA_VERSION}: use the release that wrote it")
        if self._db.dialect is Dialect.POSTGRESQL:
            self._open_postgres_schema(version)
        else:
            self._open_sqlite_schema(version)

    def _open_postgres_schema(self, version: int) -> None:
        """Create the schema in one transaction, under an advisory lock so that schedulers started
        together do not race to create it."""
        with self._db.transaction():
            self._db.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
            for statement in _SCHEMA.split(";"):
                self._db.execute(statement)
            self._db.execute("CREATE TABLE IF NOT EXISTS nexus_schema (version INTEGER NOT NULL)")
            if not self._db.execute("SELECT 1 FROM nexus_schema").fetchone():
                self._db.execute("INSERT INTO nexus_schema VALUES (?)", (SCHEMA_VERSION,))
        if version == 0:
            log.info("model database created in %s (schema %d)", self.describe, SCHEMA_VERSION)

    def _open_sqlite_schema(self, version: int) -> None:
        """Create the schema, or migrate an older one to it (one transaction: all or nothing).
        Foreign keys are off meanwhile (SQLite applies that pragma only outside a transaction)."""
        if version == SCHEMA_VERSION:
            self._db.executescript(_SCHEMA)       # tables added since, within the schema version
            return
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(models)")}
        old = bool(columns) and "version" not in columns         # schema 1: one file per name
        self._db.execute("PRAGMA foreign_keys = OFF")
        with self._db.transaction():
            present = {row[0] for row in self._db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            moved = []
            if old:
                for table, _ in _MIGRATION_1_TO_2:
                    if table in present:
                        self._db.execute(f"ALTER TABLE {table} RENAME TO {table}_v1")
                        moved.append(table)
            for statement in _SCHEMA.split(";"):
                self._db.execute(statement)
            for table, copy in _MIGRATION_1_TO_2:
                if table in moved:
                    self._db.execute(copy)
            for table in reversed(moved):
                self._db.execute(f"DROP TABLE {table}_v1")
            broken = self._db.execute("PRAGMA foreign_key_check").fetchall()
            if broken:
                raise RuntimeError(f"migrating {self.describe}: rows without their model: {broken[:3]}")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        if old:
            count = self._db.execute("SELECT COUNT(*) FROM models").fetchone()[0]
            log.info("model database migrated to schema %d: %d models are their version 1", SCHEMA_VERSION, count)

    # ---- blobs -----------------------------------------------------------------------------------

    def open_blob(self, sha256: str) -> BinaryIO:
        """The model file with this SHA-256, open for reading (blocking: call it from a thread);
        KeyError when there is none. The open file stays readable if the model is replaced meanwhile."""
        return self.blobs.open(sha256)

    def read_blob(self, sha256: str) -> bytes:
        with self.open_blob(sha256) as f:
            return f.read()

    def warm_blob_cache(self) -> int:
        """Copy every model file into this scheduler's local cache (a standby, so that a takeover serves
        backends' downloads from disk); the number copied. Blocking."""
        copied = 0
        if isinstance(self.blobs, PostgresBlobStore):
            cached = self.blobs.cache.names()
            for sha in sorted(self._referenced() - cached):
                try:
                    self.blobs.open(sha).close()
                    copied += 1
                except KeyError:        # removed meanwhile
                    pass
        return copied

    def _referenced(self) -> set[str]:
        return {row[0] for row in self._db.execute("SELECT sha256 FROM models")}

    def _collect_garbage(self) -> None:
        for leftover in self.tmp_dir.iterdir():
            leftover.unlink(missing_ok=True)
        self.blobs.collect(self._referenced())

    # ---- upload ------------------------------------------------------------------------------------

    def add_model(self, name: str, chunks: Iterable[bytes], *, runtime: str = "onnxruntime",
                  profile_json: str = "", slo_ms: float = 0.0, io_json: str = "", default_slo_ms: float = 100.0,
                  create_session: bool = True, prefix_fn=None, min_replicas: int = 0,
                  serving: ServingSettings = ServingSettings(),
                  warmup: tuple[WarmupSample, ...] = (), version: int = 0,
                  version_policy: VersionPolicy | None = None,
                  late_requests: LateRequests | None = None, upload_id: str = "") -> ModelRecord:
        """Validate and register a version of a model streamed as ``chunks``; raise :class:`UploadError`
        if refused.

        ``version`` 0 adds the next version after the newest (1 for a new model); a stored version is
        replaced (its profiles are kept when the file is the same). ``version_policy`` (None: the stored one, else Triton's default, the latest version)
        and, when given, ``slo_ms``, ``min_replicas``, ``serving`` (its rate and batch cap) and
        ``late_requests`` apply to the model (every version); ``create_session`` loads the model if it is not loaded.

        ``upload_id`` (optional, the client's): an upload with the id of one stored within
        :data:`UPLOAD_ID_KEPT_MS` registers nothing and returns the version that one stored, so a client
        may send an upload again when it cannot tell whether the first arrived (:meth:`uploaded`).

        ``prefix_fn(model_bytes, existing: dict[key, (sha256, group, signature)]) -> (group, signature)``
        assigns the version to a prefix group (optional; ONNX models only, see
        :func:`globalsched.planning.prefix_groups.assign_prefix_group`). Stored versions in no group whose
        signature lists the new group id join it in the same transaction, so every version sharing
        the prefix ends up with the same group id.
        """
        _check_name(name)
        if runtime not in RUNTIMES:
            raise UploadError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
        if not 0 <= version <= MAX_VERSION:
            raise UploadError(f"version must be a positive integer (0: the next one), got {version}")
        if slo_ms < 0:
            raise UploadError(f"slo_ms must be positive, got {slo_ms}")
        if min_replicas < 0 or min_replicas > MAX_MIN_REPLICAS:
            raise UploadError(f"min_replicas must be between 0 and {MAX_MIN_REPLICAS}, got {min_replicas}")
        if not serving.expected_rate_rps >= 0 or serving.expected_rate_rps == float("inf"):
            raise UploadError(f"expected_rate_rps must be a rate of at least 0, got {serving.expected_rate_rps}")
        if serving.batch_cap < 0:
            raise UploadError(f"batch_cap must be at least 0, got {serving.batch_cap}")
        if len(upload_id) > MAX_UPLOAD_ID_CHARS or not upload_id.isprintable():
            raise UploadError(f"upload_id must be at most {MAX_UPLOAD_ID_CHARS} printable characters, "
                              f"got {upload_id[:MAX_UPLOAD_ID_CHARS]!r}{'...' if len(upload_id) > MAX_UPLOAD_ID_CHARS else ''}")
        profile = None
        if profile_json:
            try:
                profile = Profile.from_json(profile_json, "profile")
            except ProfileError as exc:
                raise UploadError(f"invalid profile: {exc}") from None
            if not profile.device_type:
                raise UploadError("invalid profile: 'device_type' is required to know which device it describes")
        fd, tmp_name = tempfile.mkstemp(dir=self.tmp_dir)
        tmp = pathlib.Path(tmp_name)
        try:
            digest = hashlib.sha256()
            size = 0
            with os.fdopen(fd, "wb") as out:
                for chunk in chunks:
                    size += len(chunk)
                    if size > self.max_upload_bytes:
                        raise UploadError(f"model file exceeds the upload limit of {self.max_upload_bytes} bytes")
                    digest.update(chunk)
                    out.write(chunk)
            if size == 0:
                raise UploadError("empty model file")
            data = tmp.read_bytes()
            try:
                if runtime == "torch":
                    torch_archive_check(data)
                    if not io_json:
                        raise UploadError("torch models need an io description (inputs and outputs)")
                    inputs, outputs = parse_io_json(io_json)
                else:
                    inputs, outputs = onnx_io(data)
                    if io_json:
                        inputs, outputs = parse_io_json(io_json)
            except ModelFileError as exc:
                raise UploadError(str(exc)) from None
            try:
                check_samples(warmup, inputs, serving.batch_cap)
            except WarmupError as exc:
                raise UploadError(f"warm-up: {exc}") from None
            upload = _Upload(name, version, digest.hexdigest(), runtime, size, inputs, outputs, profile, slo_ms,
                             default_slo_ms, create_session, min_replicas, serving, tuple(warmup), version_policy,
                             late_requests, upload_id)
            # One upload at a time from here: the version number and the prefix group are chosen from
            # the versions stored now, so two uploads never take one number, and two variants uploaded
            # concurrently still find each other (readers are not blocked).
            with self._upload_lock:
                return self._register(upload, data, tmp, prefix_fn)
        finally:
            tmp.unlink(missing_ok=True)

    def _register(self, u: "_Upload", data: bytes, tmp: pathlib.Path, prefix_fn) -> ModelRecord:
        if u.upload_id and (stored := self.uploaded(u.upload_id, u.name)) is not None:
            return stored
        version = u.version or self._next_version(u.name)
        key = version_key(u.name, version)
        prefix_group, signature, joining = "", "", []
        if prefix_fn is not None and u.runtime == "onnxruntime":
            existing = self._signatures(exclude=key)
            prefix_group, signature = prefix_fn(data, existing)
            joining = _joining(prefix_group, existing)
        self.blobs.put(u.sha256, tmp)
        with self._lock:
            newest = self._db.execute("SELECT default_slo_ms FROM models WHERE name=? ORDER BY version DESC LIMIT 1",
                                      (u.name,)).fetchone()
            slo_ms = u.slo_ms or (newest[0] if newest else u.default_slo_ms)
            record = ModelRecord(u.name, u.sha256, u.runtime, u.size, u.inputs, u.outputs, slo_ms,
                                 prefix_group, int(time.time() * 1000), u.warmup, version)
            try:
                with self._db.transaction():
                    old = self._db.execute("SELECT sha256 FROM models WHERE name=? AND version=?",
                                           (u.name, version)).fetchone()
                    # The same file again keeps its profiles (they measure the file); another file drops them.
                    kept = self._db.execute("SELECT device_type, profile_json FROM profiles WHERE model=? AND version=?",
                                            (u.name, version)).fetchall() if old and old[0] == u.sha256 else []
                    self._db.execute("DELETE FROM models WHERE name=? AND version=?", (u.name, version))
                    self._db.execute(
                        "INSERT INTO models VALUES (?,?,?,?,?,?,?,?,?,?)",
                        (u.name, version, u.sha256, u.runtime, u.size, io_to_json(u.inputs, u.outputs), slo_ms,
                         prefix_group, signature, record.created_ms))
                    for device_type, profile_json in kept:
                        self._db.execute("INSERT INTO profiles VALUES (?,?,?,?)", (u.name, version, device_type, profile_json))
                    if joining:
                        self.set_prefix_group(joining, prefix_group)
                    if u.profile is not None:
                        self._db.execute(_UPSERT_PROFILE,
                                         (u.name, version, u.profile.device_type, u.profile.to_json()))
                    if u.create_session:
                        self._db.execute("INSERT INTO sessions VALUES (?,?) ON CONFLICT (model) DO "
                                         + ("UPDATE SET slo_ms=excluded.slo_ms" if u.slo_ms else "NOTHING"),
                                         (u.name, slo_ms))
                    if u.min_replicas:
                        self._db.execute(_UPSERT_REPLICAS, (u.name, u.min_replicas))
                    if (u.serving.expected_rate_rps, u.serving.batch_cap) != (0.0, 0):
                        self._db.execute(_UPSERT_SERVING,
                                         (u.name, u.serving.expected_rate_rps, u.serving.batch_cap))
                    if u.late_requests is not None:
                        self._db.execute(_UPSERT_LATE, (u.name, u.late_requests.value))
                    if u.warmup:
                        self._db.execute("INSERT INTO model_warmup VALUES (?,?,?)",
                                         (u.name, version, warmup_to_json(u.warmup)))
                    if u.version_policy is not None:
                        self._db.execute(_UPSERT_POLICY,
                                         (u.name, u.version_policy.to_json()))
                    if u.upload_id:
                        self._db.execute("DELETE FROM model_uploads WHERE created_ms < ?",
                                         (record.created_ms - UPLOAD_ID_KEPT_MS,))
                        self._db.execute(_UPSERT_UPLOAD, (u.upload_id, u.name, version, record.created_ms))
            except BaseException:
                self._collect_unreferenced(u.sha256)
                raise
            self.profiles_version += 1
            if old and old[0] != u.sha256:
                self._collect_unreferenced(old[0])
        return record

    def uploaded(self, upload_id: str, name: str) -> ModelRecord | None:
        """The version that the upload with this id stored, while it is stored and the id remembered
        (None: no such upload); UploadError when that upload was of another model."""
        with self._lock:
            row = self._db.execute("SELECT name, version, created_ms FROM model_uploads WHERE upload_id=?",
                                   (upload_id,)).fetchone()
        if row is None or row[2] < time.time() * 1000 - UPLOAD_ID_KEPT_MS:
            return None
        if row[0] != name:
            raise UploadError(f"upload id {upload_id!r} was an upload of model {row[0]!r}, not of {name!r}")
        return self.model(version_key(row[0], row[1]))

    def _next_version(self, name: str) -> int:
        with self._lock:
            newest = self._db.execute("SELECT MAX(version) FROM models WHERE name=?", (name,)).fetchone()[0]
        if newest is not None and newest >= MAX_VERSION:
            raise UploadError(f"model {name!r} has version {newest}, the largest there is: give --version")
        return (newest or 0) + 1

    def _collect_unreferenced(self, sha: str) -> None:
        if not self._db.execute("SELECT 1 FROM models WHERE sha256=?", (sha,)).fetchone():
            self.blobs.delete(sha)

    def _signatures(self, exclude: str) -> dict[str, tuple[str, str, str]]:
        """Every stored version but ``exclude`` by version key: (sha256, prefix group, signature)."""
        with self._lock:
            rows = self._db.execute("SELECT name, version, sha256, prefix_group, prefix_signature FROM models").fetchall()
        return {k: (r[2], r[3], r[4]) for r in rows if (k := version_key(r[0], r[1])) != exclude}

    def prefix_signature(self, key: str) -> str:
        """The stored prefix signature (JSON, see globalsched/planning/prefix_groups.py) of a version; "" if none."""
        with self._lock:
            row = self._db.execute("SELECT prefix_signature FROM models WHERE name=? AND version=?",
                                   split_key(key)).fetchone()
        return row[0] if row else ""

    def prefix_share(self, key: str) -> float | None:
        """The fraction of a version's weights in its prefix group's prefix (None: no group or unknown)."""
        record = self.model(key)
        if record is None or not record.prefix_group:
            return None
        return prefix_share(self.prefix_signature(key), record.prefix_group)

    def set_prefix_group(self, keys: Iterable[str], group: str) -> None:
        with self._lock:
            for key in keys:
                self._db.execute("UPDATE models SET prefix_group=? WHERE name=? AND version=?", (group, *split_key(key)))

    # ---- versions ----------------------------------------------------------------------------------

    def models(self) -> list[ModelRecord]:
        """Every stored version, by name and version."""
        def read():
            with self._lock:
                rows = self._db.execute(_SELECT_MODELS + " ORDER BY m.name, m.version").fetchall()
            return tuple(_record(r) for r in rows)
        return list(self._read(("models",), read))

    def model(self, key: str) -> ModelRecord | None:
        """The stored version with this version key, or None."""
        def read():
            with self._lock:
                row = self._db.execute(_SELECT_MODELS + " WHERE m.name=? AND m.version=?", split_key(key)).fetchone()
            return _record(row) if row else None
        return self._read(("model", key), read)

    def versions(self, name: str) -> list[ModelRecord]:
        """The stored versions of model ``name``, oldest first (none: an unknown model)."""
        def read():
            with self._lock:
                rows = self._db.execute(_SELECT_MODELS + " WHERE m.name=? ORDER BY m.version", (name,)).fetchall()
            return tuple(_record(r) for r in rows)
        return list(self._read(("versions", name), read))

    def version_policy(self, name: str) -> VersionPolicy:
        def read():
            with self._lock:
                row = self._db.execute("SELECT policy_json FROM version_policies WHERE model=?", (name,)).fetchone()
            return VersionPolicy.from_json(row[0]) if row else DEFAULT_POLICY
        return self._read(("version_policy", name), read)

    def served_versions(self, name: str) -> tuple[int, ...]:
        """The stored versions of ``name`` that its version policy selects, ascending."""
        return self.version_policy(name).select(r.version for r in self.versions(name))

    def newest(self, name: str) -> ModelRecord | None:
        """What the bare name means (a query's stage, ``nexus models`` by name): the newest version
        the policy serves, else the newest stored; None for an unknown model."""
        records = self.versions(name)
        served = self.version_policy(name).select(r.version for r in records)
        return next((r for r in reversed(records) if not served or r.version == served[-1]), None)

    # ---- profiles ----------------------------------------------------------------------------------

    def add_profile(self, key: str, profile: Profile) -> None:
        if not profile.device_type:
            raise ProfileError("profile.device_type: required")
        name, version = split_key(key)
        with self._lock:
            if not self._db.execute("SELECT 1 FROM models WHERE name=? AND version=?", (name, version)).fetchone():
                raise KeyError(_unknown(name, version, self._db))
            self._db.execute(_UPSERT_PROFILE,
                             (name, version, profile.device_type, profile.to_json()))
            self.profiles_version += 1

    def profiles(self, key: str) -> dict[str, Profile]:
        def read():
            with self._lock:
                rows = self._db.execute("SELECT device_type, profile_json FROM profiles WHERE model=? AND version=?",
                                        split_key(key)).fetchall()
            return {r[0]: Profile.from_json(r[1]) for r in rows}
        return dict(self._read(("profiles", key), read))

    def profile_texts(self) -> dict[str, dict[str, str]]:
        """Every stored version's tables as stored (JSON text), by version key and device type, in one
        read; a version without a table maps to {}."""
        with self._lock:
            rows = self._db.execute("SELECT model, version, device_type, profile_json FROM profiles").fetchall()
        out: dict[str, dict[str, str]] = {m.key: {} for m in self.models()}
        for name, version, device_type, text in rows:
            out.setdefault(version_key(name, version), {})[device_type] = text
        return out

    def save_measured(self, key: str, device_type: str, basis: str, profile: Profile, raise_streak: int,
                      margin: float) -> None:
        """Keep the measured profile in use for (version key, device type) (globalsched/state/profile_book.py);
        a version no longer stored is ignored."""
        name, version = split_key(key)
        with self._lock:
            if self._db.execute("SELECT 1 FROM models WHERE name=? AND version=?", (name, version)).fetchone():
                self._db.execute(_UPSERT_MEASURED,
                                 (name, version, device_type, basis, profile.to_json(), raise_streak, margin))

    def delete_measured(self, key: str, device_type: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM measured_profiles WHERE model=? AND version=? AND device_type=?",
                             (*split_key(key), device_type))

    def measured_profiles(self) -> list[tuple[str, str, str, Profile, int, float]]:
        """(version key, device type, basis, profile, raise streak, margin) of every kept measured profile."""
        with self._lock:
            rows = self._db.execute("SELECT model, version, device_type, basis, profile_json, raise_streak, margin "
                                    "FROM measured_profiles ORDER BY model, version, device_type").fetchall()
        return [(version_key(r[0], r[1]), r[2], r[3], Profile.from_json(r[4]), r[5], r[6]) for r in rows]

    # ---- serving (per model name) ------------------------------------------------------------------

    def sessions(self) -> list[SessionRecord]:
        def read():
            with self._lock:
                rows = self._db.execute("SELECT model, slo_ms FROM sessions ORDER BY model").fetchall()
            return tuple(SessionRecord(r[0], r[1]) for r in rows)
        return list(self._read(("sessions",), read))

    def set_session(self, model: str, slo_ms: float) -> None:
        with self._lock:
            self._known(model)
            self._db.execute(_UPSERT_SESSION, (model, slo_ms))

    def min_replicas(self, model: str) -> int:
        """Backends each of the model's sessions keeps at least; 0: the scheduler's default."""
        def read():
            with self._lock:
                row = self._db.execute("SELECT min_replicas FROM model_replicas WHERE model=?", (model,)).fetchone()
            return row[0] if row else 0
        return self._read(("min_replicas", model), read)

    def set_min_replicas(self, model: str, min_replicas: int) -> None:
        if min_replicas < 0 or min_replicas > MAX_MIN_REPLICAS:
            raise ValueError(f"min_replicas must be between 0 and {MAX_MIN_REPLICAS}, got {min_replicas}")
        with self._lock:
            self._known(model)
            self._db.execute(_UPSERT_REPLICAS, (model, min_replicas))

    def serving(self, model: str) -> ServingSettings:
        def read():
            with self._lock:
                row = self._db.execute("SELECT expected_rate_rps, batch_cap FROM model_serving WHERE model=?",
                                       (model,)).fetchone()
                late = self._db.execute("SELECT action FROM model_late_requests WHERE model=?", (model,)).fetchone()
            rate, cap = row if row else (0.0, 0)
            return ServingSettings(rate, cap, LateRequests(late[0]) if late else LateRequests.DROP)
        return self._read(("serving", model), read)

    def remove_session(self, model: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM sessions WHERE model=?", (model,))
        return cur.rowcount > 0

    def _known(self, model: str) -> None:
        if not self._db.execute("SELECT 1 FROM models WHERE name=?", (model,)).fetchone():
            raise KeyError(f"unknown model {model!r}")


class _CountedWrites:
    """The metadata connection as the model database uses it, counting the statements that may have
    written (anything but a SELECT, and every transaction's end, committed or not): a read cached at
    the same count is still true (:meth:`ModelDatabase._read`). Counted under the connection's lock,
    after the statement, so that no read made before a write is cached at the count after it."""

    def __init__(self, conn: SqliteConnection | PostgresConnection) -> None:
        self.conn = conn
        self.lock = conn.lock
        self.dialect = conn.dialect
        self.describe = conn.describe
        self.writes = 0

    def execute(self, sql: str, params=()):
        with self.lock:
            try:
                return self.conn.execute(sql, params)
            finally:
                if sql.lstrip()[:6].upper() != "SELECT":
                    self.writes += 1

    def executescript(self, script: str) -> None:
        self._counted(self.conn.executescript, script)

    def create_tables(self, script: str) -> None:
        self._counted(self.conn.create_tables, script)

    def _counted(self, run, *args):
        with self.lock:
            try:
                return run(*args)
            finally:
                self.writes += 1

    @contextlib.contextmanager
    def transaction(self):
        with self.lock:
            try:
                with self.conn.transaction():
                    yield
            finally:
                self.writes += 1

    def close(self) -> None:
        self.conn.close()


@dataclass(frozen=True)
class _Upload:
    """A validated upload, on its way into the database."""

    name: str
    version: int                          # 0: the next one
    sha256: str
    runtime: str
    size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    profile: Profile | None
    slo_ms: float                         # 0: the newest version's, else the default
    default_slo_ms: float
    create_session: bool
    min_replicas: int
    serving: ServingSettings
    warmup: tuple[WarmupSample, ...]
    version_policy: VersionPolicy | None
    late_requests: LateRequests | None           # None: the model's stays
    upload_id: str                               # "": none (every upload adds or replaces a version)


def _unknown(name: str, version: int, db) -> str:
    stored = [r[0] for r in db.execute("SELECT version FROM models WHERE name=? ORDER BY version", (name,))]
    if not stored:
        return f"unknown model {name!r}"
    return f"model {name!r} has no version {version} (stored: {', '.join(map(str, stored))})"


def _joining(group: str, existing: dict[str, tuple[str, str, str]]) -> list[str]:
    """Stored versions in no group whose signature lists ``group`` (they join the newcomer's group)."""
    if not group:
        return []
    return joining_members(group, existing)


def _check_name(name: str) -> None:
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name) or name[0] == ".":
        raise UploadError(f"invalid model name {name!r}: use 1-128 letters, digits, '-', '_' or '.'")


_UPSERT_PROFILE = upsert("profiles", ("model", "version", "device_type", "profile_json"),
                         ("model", "version", "device_type"))
_UPSERT_REPLICAS = upsert("model_replicas", ("model", "min_replicas"), ("model",))
_UPSERT_SERVING = upsert("model_serving", ("model", "expected_rate_rps", "batch_cap"), ("model",))
_UPSERT_LATE = upsert("model_late_requests", ("model", "action"), ("model",))
_UPSERT_UPLOAD = upsert("model_uploads", ("upload_id", "name", "version", "created_ms"), ("upload_id",))
_UPSERT_POLICY = upsert("version_policies", ("model", "policy_json"), ("model",))
_UPSERT_MEASURED = upsert("measured_profiles", ("model", "version", "device_type", "basis", "profile_json",
                                                "raise_streak", "margin"), ("model", "version", "device_type"))
_UPSERT_SESSION = upsert("sessions", ("model", "slo_ms"), ("model",))

_SELECT_MODELS = ("SELECT m.name, m.sha256, m.runtime, m.size_bytes, m.io_json, m.default_slo_ms, m.prefix_group, "
                  "m.created_ms, w.samples_json, m.version FROM models m LEFT JOIN model_warmup w "
                  "ON w.model = m.name AND w.version = m.version")


def _record(row) -> ModelRecord:
    io = json.loads(row[4])
    return ModelRecord(row[0], row[1], row[2], row[3],
                       tuple(TensorSpec.from_json_obj(t) for t in io["inputs"]),
                       tuple(TensorSpec.from_json_obj(t) for t in io["outputs"]),
                       row[5], row[6], row[7], warmup_from_json(row[8] or ""), row[9])
