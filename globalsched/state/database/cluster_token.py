"""The cluster token's fingerprint in the shared database: every scheduler of one cluster must hold
the same token (its nodes and admin clients present one token to whichever scheduler leads).

Contract: the first scheduler to start with a token records its SHA-256 (never the token). A scheduler
whose token differs, or that has none while the cluster has one (or the reverse), refuses to start
with :class:`TokenMismatch`, naming both fingerprints' first characters. ``nexus db forget-token``
removes the record, for a rotation: stop every scheduler, forget, start them with the new token.
"""

from __future__ import annotations

import hashlib
import time

from globalsched.state.database.connection import SCHEMA_LOCK_KEY, PostgresConnection

_SCHEMA = """
CREATE TABLE IF NOT EXISTS cluster_token (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    sha256 TEXT NOT NULL,
    set_ms BIGINT NOT NULL
)
"""

NO_TOKEN = "none"


class TokenMismatch(RuntimeError):
    """This scheduler's token is not the cluster's; the message says what to do."""


def fingerprint(token: str | None) -> str:
    return hashlib.sha256(token.encode()).hexdigest() if token else NO_TOKEN


def check_token(db: PostgresConnection, token: str | None) -> str:
    """Record or compare this scheduler's token; its fingerprint, or :class:`TokenMismatch`."""
    mine = fingerprint(token)
    db.create_tables(_SCHEMA)
    with db.transaction():
        db.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK_KEY,))
        row = db.execute("SELECT sha256 FROM cluster_token WHERE id = 1").fetchone()
        if row is None:
            db.execute("INSERT INTO cluster_token VALUES (1, ?, ?)", (mine, int(time.time() * 1000)))
            return mine
    if row[0] != mine:
        def short(f: str) -> str:
            return "no token" if f == NO_TOKEN else f"a token with fingerprint {f[:12]}"

        raise TokenMismatch(f"this scheduler has {short(mine)} but the cluster's schedulers use {short(row[0])}: give "
                            "every scheduler the same --token-file (to rotate the token, stop every scheduler, run "
                            "`nexus db forget-token --database URL`, and start them with the new one)")
    return mine


def forget_token(db: PostgresConnection) -> bool:
    db.create_tables(_SCHEMA)
    return db.execute("DELETE FROM cluster_token WHERE id = 1 RETURNING 1").fetchone() is not None
