"""The durable model database: SQLite metadata plus content-addressed model files.

Layout under the data directory::

    nexus.db                 SQLite: models, profiles (per device type), sessions, the measured
                             profiles in use (globalsched/profile_book.py)
    blobs/ab/abcdef...       model files, named by their SHA-256
    tmp/                     uploads in progress (removed on failure)

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

RUNTIMES = ("onnxruntime", "torch", "emulated")
MAX_MIN_REPLICAS = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY,
    sha256 TEXT NOT NULL,
    runtime TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    io_json TEXT NOT NULL,
    default_slo_ms REAL NOT NULL,
    prefix_group TEXT NOT NULL DEFAULT '',
    prefix_signature TEXT NOT NULL DEFAULT '',
    created_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS profiles (
    model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
    device_type TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    PRIMARY KEY (model, device_type)
);
CREATE TABLE IF NOT EXISTS sessions (
    model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    slo_ms REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS model_replicas (
    model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    min_replicas INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS model_serving (
    model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    expected_rate_rps REAL NOT NULL,
    batch_cap INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS model_warmup (
    model TEXT PRIMARY KEY REFERENCES models(name) ON DELETE CASCADE,
    samples_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS measured_profiles (
    model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
    device_type TEXT NOT NULL,
    basis TEXT NOT NULL,
    profile_json TEXT NOT NULL,
    raise_streak INTEGER NOT NULL,
    margin REAL NOT NULL,
    PRIMARY KEY (model, device_type)
);
"""


class UploadError(ValueError):
    """An upload refused; nothing was registered. The message says why."""


@dataclass(frozen=True)
class ModelRecord:
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


@dataclass(frozen=True)
class ServingSettings:
    """How a model is to be served beyond its SLO: the rate to plan for before one is measured (0: the
    scheduler's default) and the largest batch (config.pbtxt's max_batch_size; 0: no cap)."""

    expected_rate_rps: float = 0.0
    batch_cap: int = 0


@dataclass(frozen=True)
class SessionRecord:
    model: str
    slo_ms: float


class ModelDatabase:
    """Thread-safe access to the model database in ``data_dir``."""

    def __init__(self, data_dir: pathlib.Path, max_upload_bytes: int = 512 * 1024 * 1024) -> None:
        self.data_dir = pathlib.Path(data_dir)
        self.blob_dir = self.data_dir / "blobs"
        self.tmp_dir = self.data_dir / "tmp"
        self.max_upload_bytes = max_upload_bytes
        for d in (self.data_dir, self.blob_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._upload_lock = threading.Lock()
        self._db = sqlite3.connect(self.data_dir / "nexus.db", check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA foreign_keys = ON")
        self._db.execute("PRAGMA journal_mode = WAL")
        self._db.executescript(_SCHEMA)
        self.profiles_version = 0       # bumps whenever a model or a table is stored (readers cache by it)
        self._collect_garbage()

    def close(self) -> None:
        with self._lock:
            self._db.close()

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
                  warmup: tuple[WarmupSample, ...] = ()) -> ModelRecord:
        """Validate and register a model streamed as ``chunks``; raise :class:`UploadError` if refused.

        ``prefix_fn(model_bytes, existing: dict[name, (sha256, group, signature)]) -> (group, signature)``
        assigns the model to a prefix group (optional; ONNX models only, see
        :func:`globalsched.prefix_groups.assign_prefix_group`). Stored models in no group whose signature
        lists the new group id join it in the same transaction, so every model sharing the prefix ends
        up with the same group id.
        """
        _check_name(name)
        if runtime not in RUNTIMES:
            raise UploadError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
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
            sha = digest.hexdigest()
            # One upload at a time from here: the prefix group is chosen from the models stored now,
            # so two variants uploaded concurrently still find each other (readers are not blocked).
            with self._upload_lock:
                return self._register(name, sha, runtime, size, inputs, outputs, data, tmp, profile,
                                      slo_ms or default_slo_ms, create_session, prefix_fn, min_replicas, serving,
                                      tuple(warmup))
        finally:
            tmp.unlink(missing_ok=True)

    def _register(self, name, sha, runtime, size, inputs, outputs, data, tmp, profile, default_slo_ms,
                  create_session, prefix_fn, min_replicas=0, serving=ServingSettings(), warmup=()) -> ModelRecord:
        prefix_group, signature, joining = "", "", []
        if prefix_fn is not None and runtime == "onnxruntime":
            existing = self._signatures(exclude=name)
            prefix_group, signature = prefix_fn(data, existing)
            joining = _joining(prefix_group, existing)
        final = self.blob_path(sha)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, final)
        record = ModelRecord(name, sha, runtime, size, inputs, outputs, default_slo_ms,
                             prefix_group, int(time.time() * 1000), warmup)
        with self._lock:
            try:
                self._db.execute("BEGIN")
                old = self._db.execute("SELECT sha256 FROM models WHERE name=?", (name,)).fetchone()
                self._db.execute("DELETE FROM models WHERE name=?", (name,))
                self._db.execute(
                    "INSERT INTO models VALUES (?,?,?,?,?,?,?,?,?)",
                    (name, sha, runtime, size, io_to_json(inputs, outputs), record.default_slo_ms,
                     prefix_group, signature, record.created_ms))
                if joining:
                    self.set_prefix_group(joining, prefix_group)
                if profile is not None:
                    self._db.execute("INSERT INTO profiles VALUES (?,?,?)",
                                     (name, profile.device_type, profile.to_json()))
                if create_session:
                    self._db.execute("INSERT INTO sessions VALUES (?,?)", (name, record.default_slo_ms))
                if min_replicas:
                    self._db.execute("INSERT OR REPLACE INTO model_replicas VALUES (?,?)", (name, min_replicas))
                if serving != ServingSettings():
                    self._db.execute("INSERT OR REPLACE INTO model_serving VALUES (?,?,?)",
                                     (name, serving.expected_rate_rps, serving.batch_cap))
                if warmup:
                    self._db.execute("INSERT INTO model_warmup VALUES (?,?)", (name, warmup_to_json(warmup)))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._collect_unreferenced(sha)
                raise
            self.profiles_version += 1
            if old and old[0] != sha:
                self._collect_unreferenced(old[0])
        return record

    def _collect_unreferenced(self, sha: str) -> None:
        if not self._db.execute("SELECT 1 FROM models WHERE sha256=?", (sha,)).fetchone():
            self.blob_path(sha).unlink(missing_ok=True)

    def _signatures(self, exclude: str) -> dict[str, tuple[str, str, str]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT name, sha256, prefix_group, prefix_signature FROM models WHERE name != ?", (exclude,)).fetchall()
        return {r[0]: (r[1], r[2], r[3]) for r in rows}

    def prefix_signature(self, name: str) -> str:
        """The stored prefix signature (JSON, see globalsched/prefix_groups.py) of a model; "" if none."""
        with self._lock:
            row = self._db.execute("SELECT prefix_signature FROM models WHERE name=?", (name,)).fetchone()
        return row[0] if row else ""

    def prefix_share(self, name: str) -> float | None:
        """The fraction of the model's weights in its prefix group's prefix (None: no group or unknown)."""
        from globalsched.prefix_groups import prefix_share

        record = self.model(name)
        if record is None or not record.prefix_group:
            return None
        return prefix_share(self.prefix_signature(name), record.prefix_group)

    def set_prefix_group(self, names: Iterable[str], group: str) -> None:
        with self._lock:
            for name in names:
                self._db.execute("UPDATE models SET prefix_group=? WHERE name=?", (group, name))

    # ---- queries -----------------------------------------------------------------------------------

    def models(self) -> list[ModelRecord]:
        with self._lock:
            rows = self._db.execute(_SELECT_MODELS + " ORDER BY name").fetchall()
        return [_record(r) for r in rows]

    def model(self, name: str) -> ModelRecord | None:
        with self._lock:
            row = self._db.execute(_SELECT_MODELS + " WHERE name=?", (name,)).fetchone()
        return _record(row) if row else None

    def add_profile(self, model: str, profile: Profile) -> None:
        if not profile.device_type:
            raise ProfileError("profile.device_type: required")
        with self._lock:
            if not self._db.execute("SELECT 1 FROM models WHERE name=?", (model,)).fetchone():
                raise KeyError(f"unknown model {model!r}")
            self._db.execute("INSERT OR REPLACE INTO profiles VALUES (?,?,?)",
                             (model, profile.device_type, profile.to_json()))
            self.profiles_version += 1

    def profiles(self, model: str) -> dict[str, Profile]:
        with self._lock:
            rows = self._db.execute("SELECT device_type, profile_json FROM profiles WHERE model=?", (model,)).fetchall()
        return {r[0]: Profile.from_json(r[1]) for r in rows}

    def save_measured(self, model: str, device_type: str, basis: str, profile: Profile, raise_streak: int,
                      margin: float) -> None:
        """Keep the measured profile in use for (model, device type) (globalsched/profile_book.py); a
        model no longer stored is ignored."""
        with self._lock:
            if self._db.execute("SELECT 1 FROM models WHERE name=?", (model,)).fetchone():
                self._db.execute("INSERT OR REPLACE INTO measured_profiles VALUES (?,?,?,?,?,?)",
                                 (model, device_type, basis, profile.to_json(), raise_streak, margin))

    def delete_measured(self, model: str, device_type: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM measured_profiles WHERE model=? AND device_type=?", (model, device_type))

    def measured_profiles(self) -> list[tuple[str, str, str, Profile, int, float]]:
        """(model, device type, basis, profile, raise streak, margin) of every kept measured profile."""
        with self._lock:
            rows = self._db.execute("SELECT model, device_type, basis, profile_json, raise_streak, margin "
                                    "FROM measured_profiles ORDER BY model, device_type").fetchall()
        return [(r[0], r[1], r[2], Profile.from_json(r[3]), r[4], r[5]) for r in rows]

    def sessions(self) -> list[SessionRecord]:
        with self._lock:
            rows = self._db.execute("SELECT model, slo_ms FROM sessions ORDER BY model").fetchall()
        return [SessionRecord(r[0], r[1]) for r in rows]

    def set_session(self, model: str, slo_ms: float) -> None:
        with self._lock:
            if not self._db.execute("SELECT 1 FROM models WHERE name=?", (model,)).fetchone():
                raise KeyError(f"unknown model {model!r}")
            self._db.execute("INSERT OR REPLACE INTO sessions VALUES (?,?)", (model, slo_ms))

    def min_replicas(self, model: str) -> int:
        """Backends the model's session keeps at least; 0: the scheduler's default."""
        with self._lock:
            row = self._db.execute("SELECT min_replicas FROM model_replicas WHERE model=?", (model,)).fetchone()
        return row[0] if row else 0

    def set_min_replicas(self, model: str, min_replicas: int) -> None:
        if min_replicas < 0 or min_replicas > MAX_MIN_REPLICAS:
            raise ValueError(f"min_replicas must be between 0 and {MAX_MIN_REPLICAS}, got {min_replicas}")
        with self._lock:
            if not self._db.execute("SELECT 1 FROM models WHERE name=?", (model,)).fetchone():
                raise KeyError(f"unknown model {model!r}")
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


def _joining(group: str, existing: dict[str, tuple[str, str, str]]) -> list[str]:
    """Stored models in no group whose signature lists ``group`` (they join the newcomer's group)."""
    if not group:
        return []
    from globalsched.prefix_groups import joining_members

    return joining_members(group, existing)


def _check_name(name: str) -> None:
    if not name or len(name) > 128 or not all(c.isalnum() or c in "-_." for c in name) or name[0] == ".":
        raise UploadError(f"invalid model name {name!r}: use 1-128 letters, digits, '-', '_' or '.'")


_SELECT_MODELS = ("SELECT name, sha256, runtime, size_bytes, io_json, default_slo_ms, prefix_group, created_ms, "
                  "samples_json FROM models LEFT JOIN model_warmup ON model_warmup.model = models.name")


def _record(row) -> ModelRecord:
    io = json.loads(row[4])
    return ModelRecord(row[0], row[1], row[2], row[3],
                       tuple(TensorSpec.from_json_obj(t) for t in io["inputs"]),
                       tuple(TensorSpec.from_json_obj(t) for t in io["outputs"]),
                       row[5], row[6], row[7], warmup_from_json(row[8] or ""))
