"""The durable model database: SQLite metadata plus content-addressed model files.

Layout under the data directory::

    nexus.db                 SQLite: model versions, profiles (per version and device type), sessions,
                             the measured profiles in use (per version, globalsched/profile_book.py)
    blobs/ab/abcdef...       model files, named by their SHA-256
    tmp/                     uploads in progress (removed on failure)

Versions (common/versions.py): a model is a name with versions 1, 2, ...; each version has its own
file, input/output description, prefix group, warm-up samples and profiles, and is addressed by its
version key (``name:version``, version 1's is the bare name). What is served is per name: whether
the model is loaded (its session, with the SLO), its minimum replicas, serving settings and version
policy; :meth:`ModelDatabase.served_versions` applies the policy to the stored versions. An upload
without a version adds the next one after the newest (1 for a new model); an upload of a stored
version replaces that version.

Schema versions (``PRAGMA user_version``): 2 has versions. A database of schema 1 (one file per
name) is migrated when opened, in one transaction: every model becomes version 1 of itself.

Contract: an upload is validated completely before anything is registered, and registration is one
SQLite transaction, so a failed upload leaves no model behind. Blobs are immutable; a blob that no
model row references is garbage and is removed at start-up.

Threads and the event loop: uploads run in a thread (``asyncio.to_thread``); the long parts of an
upload (streaming to disk, hashing, validating, choosing the prefix group) hold only
``_upload_lock``, which nothing on the scheduler's event loop takes. ``_lock`` guards the SQLite
connection and is held for one statement, or for the registration transaction (a few statements),
so a metadata read on the loop waits at most that long. Model files are never read on the loop:
:meth:`open_blob` and the reads go through a thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Iterable

from common.model_io import ModelFileError, io_to_json, onnx_io, parse_io_json, torch_archive_check
from common.profile import Profile, ProfileError
from common.tensors import TensorSpec
from common.warmup import WarmupError, WarmupSample, check_samples
from common.warmup import from_json as warmup_from_json, to_json as warmup_to_json
from common.versions import DEFAULT_POLICY, VersionPolicy, split_key, version_key

log = logging.getLogger("nexus.scheduler")

RUNTIMES = ("onnxruntime", "torch", "emulated")
MAX_MIN_REPLICAS = 64

SCHEMA_VERSION = 2
MAX_VERSION = 2**63 - 1        # Triton's versions are int64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL,
    version INTEGER NOT NULL CHECK (version >= 1),
    sha256 TEXT NOT NULL,
    runtime TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    io_json TEXT NOT NULL,
    default_slo_ms REAL NOT NULL,
    prefix_group TEXT NOT NULL DEFAULT '',
    prefix_signature TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS profiles (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    device_type TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    PRIMARY KEY (model, version, device_type),
    FOREIGN KEY (model, version) REFERENCES models(name, version) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS model_warmup (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    samples_json TEXT NOT NULL,
    PRIMARY KEY (model, version),
    FOREIGN KEY (model, version) REFERENCES models(name, version) ON DELETE CASCADE
);
CREATE TABLE IF NOT EXISTS sessions (
    model TEXT PRIMARY KEY,
    slo_ms REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS model_replicas (
    model TEXT PRIMARY KEY,
    min_replicas INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS model_serving (
    model TEXT PRIMARY KEY,
    expected_rate_rps REAL NOT NULL,
    batch_cap INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS version_policies (
    model TEXT PRIMARY KEY,
    policy_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS measured_profiles (
    model TEXT NOT NULL,
    version INTEGER NOT NULL,
    device_type TEXT NOT NULL,
    basis TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    raise_streak INTEGER NOT NULL,
    margin REAL NOT NULL,
    PRIMARY KEY (model, version, device_type),
    FOREIGN KEY (model, version) REFERENCES models(name, version) ON DELETE CASCADE
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
        """The version key (common/versions.py): the session name this version is served under."""
        return version_key(self.name, self.version)


@dataclass(frozen=True)
class ServingSettings:
    """How a model is to be served beyond its SLO: the rate to plan for before one is measured (0: the
    scheduler's default) and the largest batch (config.pbtxt's max_batch_size; 0: no cap)."""

    expected_rate_rps: float = 0.0
    batch_cap: int = 0


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
                 read_only: bool = False) -> None:
        """``read_only``: read a database another process (a running scheduler) owns: nothing is
        created, migrated or collected, and a directory without a database is an error
        (FileNotFoundError; RuntimeError for another schema version)."""
        self.data_dir = pathlib.Path(data_dir)
        self.blob_dir = self.data_dir / "blobs"
        self.tmp_dir = self.data_dir / "tmp"
        self.max_upload_bytes = max_upload_bytes
        self._lock = threading.RLock()
        self._upload_lock = threading.Lock()
        self.profiles_version = 0       # bumps whenever a model or a table is stored (readers cache by it)
        if read_only:
            path = self.data_dir / "nexus.db"
            if not path.is_file():
                raise FileNotFoundError(f"{self.data_dir}: no model database here (no nexus.db)")
            self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                       isolation_level=None)
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                self._db.close()
                raise RuntimeError(f"{path} has schema {version}; this release reads {SCHEMA_VERSION}")
            return
        for d in (self.data_dir, self.blob_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.data_dir / "nexus.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode = WAL")
        self._open_schema()
        self._db.execute("PRAGMA foreign_keys = ON")
        self._collect_garbage()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---- schema ------------------------------------------------------------------------------------

    def _open_schema(self) -> None:
        """Create the schema, or migrate an older one to it (one transaction: all or nothing).
        Foreign keys are off meanwhile (SQLite applies that pragma only outside a transaction)."""
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version == SCHEMA_VERSION:
            self._db.executescript(_SCHEMA)       # tables added since, within the schema version
            return
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.data_dir / 'nexus.db'} has schema {version}, newer than this release's "
                               f"{SCHEMA_VERSION}: use the release that wrote it")
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(models)")}
        old = bool(columns) and "version" not in columns         # schema 1: one file per name
        self._db.execute("PRAGMA foreign_keys = OFF")
        self._db.execute("BEGIN")
        try:
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
                raise RuntimeError(f"migrating {self.data_dir / 'nexus.db'}: rows without their model: {broken[:3]}")
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        if old:
            count = self._db.execute("SELECT COUNT(*) FROM models").fetchone()[0]
            log.info("model database migrated to schema %d: %d models are their version 1", SCHEMA_VERSION, count)

    # ---- blobs -----------------------------------------------------------------------------------

    def blob_path(self, sha256: str) -> pathlib.Path:
        return self.blob_dir / sha256[:2] / sha256

    def open_blob(self, sha256: str) -> BinaryIO:
        """The model file with this SHA-256, open for reading (blocking: call it from a thread);
        KeyError when there is none. The open file stays readable if the model is replaced meanwhile."""
        if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
            raise KeyError(f"no model file with sha256 {sha256!r}")
        try:
            return self.blob_path(sha256).open("rb")
        except FileNotFoundError:
            raise KeyError(f"no model file with sha256 {sha256!r}") from None

    def read_blob(self, sha256: str) -> bytes:
        with self.open_blob(sha256) as f:
            return f.read()

    def _collect_garbage(self) -> None:
        for leftover in self.tmp_dir.iterdir():
            leftover.unlink(missing_ok=True)
        referenced = {row[0] for row in self._db.execute("SELECT sha256 FROM models")}
        for path in self.blob_dir.glob("*/*"):
            if path.name not in referenced:
                path.unlink(missing_ok=True)

    # ---- upload ------------------------------------------------------------------------------------

    def add_model(self, name: str, chunks: Iterable[bytes], *, runtime: str = "onnxruntime",
                  profile_json: str = "", slo_ms: float = 0.0, io_json: str = "", default_slo_ms: float = 100.0,
                  create_session: bool = True, prefix_fn=None, min_replicas: int = 0,
                  serving: ServingSettings = ServingSettings(),
                  warmup: tuple[WarmupSample, ...] = (), version: int = 0,
                  version_policy: VersionPolicy | None = None) -> ModelRecord:
        """Validate and register a version of a model streamed as ``chunks``; raise :class:`UploadError`
        if refused.

        ``version`` 0 adds the next version after the newest (1 for a new model); a stored version is
        replaced (its profiles are kept when the file is the same). ``version_policy`` (None: the stored one, else Triton's default, the latest version)
        and, when given, ``slo_ms``, ``min_replicas`` and ``serving`` apply to the model (every
        version); ``create_session`` loads the model if it is not loaded.

        ``prefix_fn(model_bytes, existing: dict[key, (sha256, group, signature)]) -> (group, signature)``
        assigns the version to a prefix group (optional; ONNX models only, see
        :func:`globalsched.prefix_groups.assign_prefix_group`). Stored versions in no group whose
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
                             default_slo_ms, create_session, min_replicas, serving, tuple(warmup), version_policy)
            # One upload at a time from here: the version number and the prefix group are chosen from
            # the versions stored now, so two uploads never take one number, and two variants uploaded
            # concurrently still find each other (readers are not blocked).
            with self._upload_lock:
                return self._register(upload, data, tmp, prefix_fn)
        finally:
            tmp.unlink(missing_ok=True)

    def _register(self, u: "_Upload", data: bytes, tmp: pathlib.Path, prefix_fn) -> ModelRecord:
        version = u.version or self._next_version(u.name)
        key = version_key(u.name, version)
        prefix_group, signature, joining = "", "", []
        if prefix_fn is not None and u.runtime == "onnxruntime":
            existing = self._signatures(exclude=key)
            prefix_group, signature = prefix_fn(data, existing)
            joining = _joining(prefix_group, existing)
        final = self.blob_path(u.sha256)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        with self._lock:
            newest = self._db.execute("SELECT default_slo_ms FROM models WHERE name=? ORDER BY version DESC LIMIT 1",
                                      (u.name,)).fetchone()
            slo_ms = u.slo_ms or (newest[0] if newest else u.default_slo_ms)
            record = ModelRecord(u.name, u.sha256, u.runtime, u.size, u.inputs, u.outputs, slo_ms,
                                 prefix_group, int(time.time() * 1000), u.warmup, version)
            try:
                self._db.execute("BEGIN")
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
                    self._db.execute("INSERT OR REPLACE INTO profiles VALUES (?,?,?,?)",
                                     (u.name, version, u.profile.device_type, u.profile.to_json()))
                if u.create_session:
                    self._db.execute("INSERT INTO sessions VALUES (?,?) ON CONFLICT (model) DO "
                                     + ("UPDATE SET slo_ms=excluded.slo_ms" if u.slo_ms else "NOTHING"),
                                     (u.name, slo_ms))
                if u.min_replicas:
                    self._db.execute("INSERT OR REPLACE INTO model_replicas VALUES (?,?)", (u.name, u.min_replicas))
                if u.serving != ServingSettings():
                    self._db.execute("INSERT OR REPLACE INTO model_serving VALUES (?,?,?)",
                                     (u.name, u.serving.expected_rate_rps, u.serving.batch_cap))
                if u.warmup:
                    self._db.execute("INSERT INTO model_warmup VALUES (?,?,?)",
                                     (u.name, version, warmup_to_json(u.warmup)))
                if u.version_policy is not None:
                    self._db.execute("INSERT OR REPLACE INTO version_policies VALUES (?,?)",
                                     (u.name, u.version_policy.to_json()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._collect_unreferenced(u.sha256)
                raise
            self.profiles_version += 1
            if old and old[0] != u.sha256:
                self._collect_unreferenced(old[0])
        return record

    def _next_version(self, name: str) -> int:
        with self._lock:
            newest = self._db.execute("SELECT MAX(version) FROM models WHERE name=?", (name,)).fetchone()[0]
        if newest is not None and newest >= MAX_VERSION:
            raise UploadError(f"model {name!r} has version {newest}, the largest there is: give --version")
        return (newest or 0) + 1

    def _collect_unreferenced(self, sha: str) -> None:
        if not self._db.execute("SELECT 1 FROM models WHERE sha256=?", (sha,)).fetchone():
            self.blob_path(sha).unlink(missing_ok=True)

    def _signatures(self, exclude: str) -> dict[str, tuple[str, str, str]]:
        """Every stored version but ``exclude`` by version key: (sha256, prefix group, signature)."""
        with self._lock:
            rows = self._db.execute("SELECT name, version, sha256, prefix_group, prefix_signature FROM models").fetchall()
        return {k: (r[2], r[3], r[4]) for r in rows if (k := version_key(r[0], r[1])) != exclude}

    def prefix_signature(self, key: str) -> str:
        """The stored prefix signature (JSON, see globalsched/prefix_groups.py) of a version; "" if none."""
        with self._lock:
            row = self._db.execute("SELECT prefix_signature FROM models WHERE name=? AND version=?",
                                   split_key(key)).fetchone()
        return row[0] if row else ""

    def prefix_share(self, key: str) -> float | None:
        """The fraction of a version's weights in its prefix group's prefix (None: no group or unknown)."""
        from globalsched.prefix_groups import prefix_share

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
        with self._lock:
            rows = self._db.execute(_SELECT_MODELS + " ORDER BY m.name, m.version").fetchall()
        return [_record(r) for r in rows]

    def model(self, key: str) -> ModelRecord | None:
        """The stored version with this version key, or None."""
        with self._lock:
            row = self._db.execute(_SELECT_MODELS + " WHERE m.name=? AND m.version=?", split_key(key)).fetchone()
        return _record(row) if row else None

    def versions(self, name: str) -> list[ModelRecord]:
        """The stored versions of model ``name``, oldest first (none: an unknown model)."""
        with self._lock:
            rows = self._db.execute(_SELECT_MODELS + " WHERE m.name=? ORDER BY m.version", (name,)).fetchall()
        return [_record(r) for r in rows]

    def version_policy(self, name: str) -> VersionPolicy:
        with self._lock:
            row = self._db.execute("SELECT policy_json FROM version_policies WHERE model=?", (name,)).fetchone()
        return VersionPolicy.from_json(row[0]) if row else DEFAULT_POLICY

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
            self._db.execute("INSERT OR REPLACE INTO profiles VALUES (?,?,?,?)",
                             (name, version, profile.device_type, profile.to_json()))
            self.profiles_version += 1

    def profiles(self, key: str) -> dict[str, Profile]:
        with self._lock:
            rows = self._db.execute("SELECT device_type, profile_json FROM profiles WHERE model=? AND version=?",
                                    split_key(key)).fetchall()
        return {r[0]: Profile.from_json(r[1]) for r in rows}

    def save_measured(self, key: str, device_type: str, basis: str, profile: Profile, raise_streak: int,
                      margin: float) -> None:
        """Keep the measured profile in use for (version key, device type) (globalsched/profile_book.py);
        a version no longer stored is ignored."""
        name, version = split_key(key)
        with self._lock:
            if self._db.execute("SELECT 1 FROM models WHERE name=? AND version=?", (name, version)).fetchone():
                self._db.execute("INSERT OR REPLACE INTO measured_profiles VALUES (?,?,?,?,?,?,?)",
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
        with self._lock:
            rows = self._db.execute("SELECT model, slo_ms FROM sessions ORDER BY model").fetchall()
        return [SessionRecord(r[0], r[1]) for r in rows]

    def set_session(self, model: str, slo_ms: float) -> None:
        with self._lock:
            self._known(model)
            self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?,?)", (model, slo_ms))

    def min_replicas(self, model: str) -> int:
        """Backends each of the model's sessions keeps at least; 0: the scheduler's default."""
        with self._lock:
            row = self._db.execute("SELECT min_replicas FROM model_replicas WHERE model=?", (model,)).fetchone()
        return row[0] if row else 0

    def set_min_replicas(self, model: str, min_replicas: int) -> None:
        if min_replicas < 0 or min_replicas > MAX_MIN_REPLICAS:
            raise ValueError(f"min_replicas must be between 0 and {MAX_MIN_REPLICAS}, got {min_replicas}")
        with self._lock:
            self._known(model)
            self._db.execute("INSERT OR REPLACE INTO model_replicas VALUES (?,?)", (model, min_replicas))

    def serving(self, model: str) -> ServingSettings:
        with self._lock:
            row = self._db.execute("SELECT expected_rate_rps, batch_cap FROM model_serving WHERE model=?",
                                   (model,)).fetchone()
        return ServingSettings(row[0], row[1]) if row else ServingSettings()

    def remove_session(self, model: str) -> bool:
        with self._lock:
            cur = self._db.execute("DELETE FROM sessions WHERE model=?", (model,))
        return cur.rowcount > 0

    def _known(self, model: str) -> None:
        if not self._db.execute("SELECT 1 FROM models WHERE name=?", (model,)).fetchone():
            raise KeyError(f"unknown model {model!r}")


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


def _unknown(name: str, version: int, db) -> str:
    stored = [r[0] for r in db.execute("SELECT version FROM models WHERE name=? ORDER BY version", (name,))]
    if not stored:
        return f"unknown model {name!r}"
    return f"model {name!r} has no version {version} (stored: {', '.join(map(str, stored))})"


def _joining(group: str, existing: dict[str, tuple[str, str, str]]) -> list[str]:
    """Stored versions in no group whose signature lists ``group`` (they join the newcomer's group)."""
    if not group:
        return []
    from globalsched.prefix_groups import joining_members

    return joining_members(group, existing)


def _check_name(name: str) -> None:
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name) or name[0] == ".":
        raise UploadError(f"invalid model name {name!r}: use 1-128 letters, digits, '-', '_' or '.'")


_SELECT_MODELS = ("SELECT m.name, m.sha256, m.runtime, m.size_bytes, m.io_json, m.default_slo_ms, m.prefix_group, "
                  "m.created_ms, w.samples_json, m.version FROM models m LEFT JOIN model_warmup w "
                  "ON w.model = m.name AND w.version = m.version")


def _record(row) -> ModelRecord:
    io = json.loads(row[4])
    return ModelRecord(row[0], row[1], row[2], row[3],
                       tuple(TensorSpec.from_json_obj(t) for t in io["inputs"]),
                       tuple(TensorSpec.from_json_obj(t) for t in io["outputs"]),
                       row[5], row[6], row[7], warmup_from_json(row[8] or ""), row[9])
