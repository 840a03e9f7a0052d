"""Model files, content-addressed by SHA-256: in a directory (the embedded default) or in PostgreSQL.

Why PostgreSQL holds the files of a PostgreSQL-backed cluster, rather than a directory every scheduler
mounts: a standby must be able to take over on another machine, and a shared directory would need a
network file system (a ReadWriteMany volume on Kubernetes) beside the database, a second thing to back
up, secure and keep consistent with the rows that name its files. In the database the file and the row
that references it are written by the same server, backed up by the same dump, and guarded by the same
credentials and TLS. Files are stored as 4 MiB ``bytea`` chunks rather than large objects: chunks are
plain rows (``pg_dump``, replication and row-level permissions treat them like any other table, and a
deleted row needs no ``lo_unlink``), and an upload or a read streams chunk by chunk, never holding the
whole file in one value. Each scheduler keeps a local cache of the files it has read (``cache_dir``):
a file never changes under its name, so a cached copy is always valid.

Contract, both stores: :meth:`put` stores a file under its SHA-256 (storing one that is there already is
a no-op); :meth:`open` returns it open for reading or raises KeyError; :meth:`delete` removes it;
:meth:`collect` removes every file no ``referenced`` name lists (in PostgreSQL only those older than
``grace_s``, so that a file another scheduler is registering right now is kept). All block: call them
from a thread.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
import time
from typing import BinaryIO, Iterable

from globalsched.state.database.connection import PostgresConnection

CHUNK_BYTES = 4 * 1024 * 1024

BLOB_SCHEMA = """
CREATE TABLE IF NOT EXISTS blobs (
    sha256 TEXT PRIMARY KEY,
    size_bytes BIGINT NOT NULL,
    created_ms BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS blob_chunks (
    sha256 TEXT NOT NULL REFERENCES blobs(sha256) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    data BYTEA NOT NULL,
    PRIMARY KEY (sha256, seq)
)
"""


def check_sha256(sha256: str) -> None:
    if len(sha256) != 64 or not all(c in "0123456789abcdef" for c in sha256):
        raise KeyError(f"no model file with sha256 {sha256!r}")


class FileBlobStore:
    """Files under ``root/ab/abcdef...``."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root)

    def path(self, sha256: str) -> pathlib.Path:
        return self.root / sha256[:2] / sha256

    def put(self, sha256: str, source: pathlib.Path) -> None:
        """Move ``source`` (a file on the same file system) into the store."""
        final = self.path(sha256)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.replace(source, final)

    def open(self, sha256: str) -> BinaryIO:
        check_sha256(sha256)
        try:
            return self.path(sha256).open("rb")
        except FileNotFoundError:
            raise KeyError(f"no model file with sha256 {sha256!r}") from None

    def delete(self, sha256: str) -> None:
        self.path(sha256).unlink(missing_ok=True)

    def names(self) -> set[str]:
        return {p.name for p in self.root.glob("*/*")}

    def collect(self, referenced: set[str], grace_s: float = 0.0) -> int:
        gone = 0
        for path in self.root.glob("*/*"):
            if path.name not in referenced:
                path.unlink(missing_ok=True)
                gone += 1
        return gone


class PostgresBlobStore:
    """Files as chunked rows of the ``blobs`` and ``blob_chunks`` tables, with a local read cache.

    It holds its own connection, so that moving a large file never holds the metadata connection's
    lock that the scheduler's event loop waits on."""

    def __init__(self, url: str, cache_dir: pathlib.Path, read_only: bool = False) -> None:
        self.db = PostgresConnection(url, application_name="nexus-scheduler-blobs")
        if not read_only:
            self.db.create_tables(BLOB_SCHEMA)
        self.cache = FileBlobStore(cache_dir)
        self.tmp_dir = pathlib.Path(cache_dir) / "tmp"

    def put(self, sha256: str, source: pathlib.Path) -> None:
        with self.db.transaction():
            if self.db.execute("SELECT 1 FROM blobs WHERE sha256 = ?", (sha256,)).fetchone():
                pathlib.Path(source).unlink(missing_ok=True)
                return
            self.db.execute("INSERT INTO blobs VALUES (?, ?, ?)",
                            (sha256, pathlib.Path(source).stat().st_size, int(time.time() * 1000)))
            with open(source, "rb") as f:
                seq = 0
                while chunk := f.read(CHUNK_BYTES):
                    self.db.execute("INSERT INTO blob_chunks VALUES (?, ?, ?)", (sha256, seq, chunk))
                    seq += 1
        self.cache.put(sha256, source)

    def open(self, sha256: str) -> BinaryIO:
        check_sha256(sha256)
        try:
            return self.cache.open(sha256)
        except KeyError:
            pass
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=self.tmp_dir)
        tmp = pathlib.Path(name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for data in self._chunks(sha256):
                    digest.update(data)
                    out.write(data)
            if digest.hexdigest() != sha256:
                raise RuntimeError(f"model file {sha256} in {self.db.describe} is damaged: "
                                   f"its content hashes to {digest.hexdigest()}")
            self.cache.put(sha256, tmp)
        finally:
            tmp.unlink(missing_ok=True)
        return self.cache.open(sha256)

    def _chunks(self, sha256: str) -> Iterable[bytes]:
        if not self.db.execute("SELECT 1 FROM blobs WHERE sha256 = ?", (sha256,)).fetchone():
            raise KeyError(f"no model file with sha256 {sha256!r}")
        seq = 0
        while True:
            row = self.db.execute("SELECT data FROM blob_chunks WHERE sha256 = ? AND seq = ?", (sha256, seq)).fetchone()
            if row is None:
                return
            yield bytes(row[0])
            seq += 1

    def delete(self, sha256: str) -> None:
        self.db.execute("DELETE FROM blobs WHERE sha256 = ?", (sha256,))
        self.cache.delete(sha256)

    def names(self) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT sha256 FROM blobs")}

    def collect(self, referenced: set[str], grace_s: float = 3600.0) -> int:
        cutoff = int((time.time() - grace_s) * 1000)
        rows = self.db.execute("SELECT sha256 FROM blobs WHERE created_ms < ?", (cutoff,)).fetchall()
        gone = [r[0] for r in rows if r[0] not in referenced]
        for sha in gone:
            self.delete(sha)
        self.cache.collect(referenced | self.names())
        return len(gone)

    def close(self) -> None:
        self.db.close()


BlobStore = FileBlobStore | PostgresBlobStore
