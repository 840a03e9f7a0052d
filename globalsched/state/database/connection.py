"""One SQL connection for the scheduler's durable state, on SQLite (the embedded default) or PostgreSQL.

Statements are written once, in the SQL both dialects accept: ``?`` placeholders, ``INSERT ... ON
CONFLICT (...) DO UPDATE SET c = excluded.c`` for upserts, BIGINT and DOUBLE PRECISION column types
(SQLite reads them with its integer and real affinities). :class:`PostgresConnection` turns ``?`` into
psycopg's ``%s``. Dialect-specific work (SQLite's pragmas, PostgreSQL's schema table) is asked of
``dialect`` by the one module that needs it.

A connection is used from several threads (the event loop and ``asyncio.to_thread`` workers) and is
guarded by one re-entrant lock: every ``execute`` takes it, and :meth:`transaction` holds it from BEGIN
to COMMIT, so a transaction's statements are never interleaved with another thread's.

PostgreSQL credentials never come from the command line: a URL that carries a password is refused, and
libpq reads the password from ``PGPASSWORD``, ``PGPASSFILE`` / ``~/.pgpass`` or the URL's ``passfile``
parameter. TLS is libpq's too (``sslmode=verify-full&sslrootcert=...`` in the URL, or ``PGSSLMODE``).
A connection lost between transactions is re-opened once, transparently; one lost inside a
transaction raises, and the transaction is gone with it.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import pathlib
import sqlite3
import threading
from typing import Any, Iterator, Sequence

from common.database_url import check_postgres_url, redact

log = logging.getLogger("nexus.scheduler")


SCHEMA_LOCK_KEY = 0x6E65787573        # the advisory lock schedulers take while creating PostgreSQL tables


class Dialect(enum.Enum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


class SqliteConnection:
    """A SQLite file in autocommit mode (explicit BEGIN/COMMIT), with foreign keys enforced."""

    dialect = Dialect.SQLITE

    def __init__(self, path: pathlib.Path, read_only: bool = False) -> None:
        self.lock = threading.RLock()
        self.describe = str(path)
        if read_only:
            self._db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, check_same_thread=False,
                                       isolation_level=None)
        else:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode = WAL")

    def execute(self, sql: str, params: Sequence[Any] = ()):
        with self.lock:
            return self._db.execute(sql, params)

    def executescript(self, script: str) -> None:
        with self.lock:
            self._db.executescript(script)

    def create_tables(self, script: str) -> None:
        """Run ``CREATE TABLE IF NOT EXISTS`` statements (``;``-separated)."""
        self.executescript(script)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock:
            self._db.execute("BEGIN")
            try:
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self._db.close()


class PostgresConnection:
    """A psycopg 3 connection in autocommit mode (explicit BEGIN/COMMIT), re-opened once when lost
    between transactions."""

    dialect = Dialect.POSTGRESQL

    def __init__(self, url: str, application_name: str = "nexus-scheduler", connect_timeout_s: int = 10) -> None:
        import psycopg  # lazy: ~70 ms at start-up, needed only with a PostgreSQL --database

        self._psycopg = psycopg
        self.url = check_postgres_url(url)
        self.describe = redact(url)
        self.lock = threading.RLock()
        self._application_name = application_name
        self._connect_timeout_s = connect_timeout_s
        self._in_transaction = False
        self._sql: dict[str, str] = {}
        self._db = self._connect()

    def _connect(self):
        try:
            return self._psycopg.connect(self.url, autocommit=True, application_name=self._application_name,
                                         connect_timeout=self._connect_timeout_s)
        except self._psycopg.OperationalError as exc:
            raise ConnectionError(f"cannot reach the database {self.describe}: {str(exc).strip()}") from None

    def _translate(self, sql: str) -> str:
        text = self._sql.get(sql)
        if text is None:
            text = self._sql[sql] = sql.replace("%", "%%").replace("?", "%s")
        return text

    def execute(self, sql: str, params: Sequence[Any] = ()):
        with self.lock:
            try:
                return self._db.execute(self._translate(sql), params)
            except self._psycopg.OperationalError:
                if self._in_transaction or not (self._db.closed or self._db.broken):
                    raise
            log.warning("database %s: connection lost; reconnecting", self.describe)
            self._db = self._connect()
            return self._db.execute(self._translate(sql), params)

    def executescript(self, script: str) -> None:
        for statement in script.split(";"):
            if statement.strip():
                self.execute(statement)

    def create_tables(self, script: str) -> None:
        """Run ``CREATE TABLE IF NOT EXISTS`` statements (``;``-separated) in one transaction under
        :data:`SCHEMA_LOCK_KEY`: PostgreSQL's IF NOT EXISTS is not safe against another session
        creating the same table at once (schedulers started together)."""
        with self.transaction():
            self.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
            self.executescript(script)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self.lock:
            self.execute("BEGIN")
            self._in_transaction = True
            try:
                yield
            except BaseException:
                self._in_transaction = False
                if not self._db.closed:
                    with contextlib.suppress(self._psycopg.Error):
                        self._db.execute("ROLLBACK")
                raise
            self._in_transaction = False
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self.lock:
            self._db.close()


Connection = SqliteConnection | PostgresConnection


def upsert(table: str, columns: Sequence[str], key: Sequence[str]) -> str:
    """``INSERT INTO table VALUES (?, ...)`` that replaces the row with the same ``key`` columns."""
    values = ", ".join("?" for _ in columns)
    update = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    action = f"DO UPDATE SET {update}" if update else "DO NOTHING"
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({values}) ON CONFLICT ({', '.join(key)}) {action}"
