"""Durable storage of registered queries (their definition files), beside the model database."""

from __future__ import annotations

import pathlib

from globalsched.state.database.connection import Dialect, PostgresConnection, SqliteConnection, upsert

_UPSERT = upsert("queries", ("name", "json"), ("name",))


class QueryStore:
    """Query definitions by name: in ``<data_dir>/queries.db`` beside a SQLite model database, in the
    model database itself when that is PostgreSQL (every scheduler of the cluster sees them)."""

    def __init__(self, db: SqliteConnection | PostgresConnection, owned: bool) -> None:
        self._db = db
        self._owned = owned
        self._db.create_tables("CREATE TABLE IF NOT EXISTS queries (name TEXT PRIMARY KEY, json TEXT NOT NULL)")

    @classmethod
    def beside(cls, models: SqliteConnection | PostgresConnection, data_dir: pathlib.Path) -> "QueryStore":
        if models.dialect is Dialect.POSTGRESQL:
            return cls(models, owned=False)
        pathlib.Path(data_dir).mkdir(parents=True, exist_ok=True)
        return cls(SqliteConnection(pathlib.Path(data_dir) / "queries.db"), owned=True)

    def put(self, name: str, text: str) -> None:
        self._db.execute(_UPSERT, (name, text))

    def all(self) -> dict[str, str]:
        return dict(self._db.execute("SELECT name, json FROM queries ORDER BY name").fetchall())

    def close(self) -> None:
        if self._owned:
            self._db.close()
