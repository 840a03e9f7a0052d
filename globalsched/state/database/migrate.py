"""Copy a whole model database into another: an existing SQLite installation into PostgreSQL.

Contract: the source is read, never written (stop its scheduler first: a model uploaded meanwhile would
be missed); the destination must hold no model, and receives every table's rows in one transaction
after every model file, so a failed copy leaves at most unreferenced files, which the destination's
next scheduler collects. Queries go along.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

from globalsched.state.modeldb import ModelDatabase
from globalsched.state.querydb import QueryStore

# The model database's tables, in an order that satisfies their foreign keys (the columns are read).
# Not model_uploads: its ids answer an upload sent again to a running scheduler, and the source's is stopped.
TABLES = ("models", "profiles", "model_warmup", "sessions", "model_replicas", "model_serving", "model_late_requests",
          "version_policies",
          "measured_profiles")


class MigrationError(RuntimeError):
    """The copy was refused or failed; the message says why."""


@dataclass(frozen=True)
class MigrationReport:
    rows: dict[str, int]
    files: int
    bytes: int
    queries: int


def copy_database(source: ModelDatabase, source_queries: QueryStore, dest: ModelDatabase,
                  dest_queries: QueryStore) -> MigrationReport:
    if dest.sql.execute("SELECT COUNT(*) FROM models").fetchone()[0]:
        raise MigrationError(f"{dest.describe} already holds models: migrate into an empty database")
    shas = sorted({r[0] for r in source.sql.execute("SELECT sha256 FROM models")})
    size = 0
    for sha in shas:
        fd, name = tempfile.mkstemp(dir=dest.tmp_dir)
        try:
            with os.fdopen(fd, "wb") as out, source.open_blob(sha) as f:
                while block := f.read(1 << 20):
                    out.write(block)
                    size += len(block)
            dest.blobs.put(sha, name)
        except KeyError:
            raise MigrationError(f"{source.describe}: model file {sha} is missing from its store") from None
        finally:
            if os.path.exists(name):
                os.unlink(name)
    rows: dict[str, int] = {}
    with dest.sql.transaction():
        for table in TABLES:
            cursor = source.sql.execute(f"SELECT * FROM {table}")
            columns = [c[0] for c in cursor.description]
            insert = f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' for _ in columns)})"
            data = cursor.fetchall()
            for row in data:
                dest.sql.execute(insert, tuple(row))
            rows[table] = len(data)
    queries = source_queries.all()
    for name, text in queries.items():
        dest_queries.put(name, text)
    return MigrationReport(rows, len(shas), size, len(queries))
