"""Durable storage of registered queries (their definition files), beside the model database."""

from __future__ import annotations

import pathlib
import sqlite3
import threading


class QueryStore:
    """Query definitions by name in ``<data_dir>/queries.db``."""

    def __init__(self, data_dir: pathlib.Path) -> None:
        pathlib.Path(data_dir).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(pathlib.Path(data_dir) / "queries.db", check_same_thread=False,
                                   isolation_level=None)
        self._db.execute("CREATE TABLE IF NOT EXISTS queries (name TEXT PRIMARY KEY, json TEXT NOT NULL)")

    def put(self, name: str, text: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO queries VALUES (?, ?)", (name, text))

    def all(self) -> dict[str, str]:
        with self._lock:
            return dict(self._db.execute("SELECT name, json FROM queries ORDER BY name").fetchall())

    def close(self) -> None:
        with self._lock:
            self._db.close()
