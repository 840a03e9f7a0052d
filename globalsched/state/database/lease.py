"""The leader's lease: one row in PostgreSQL that at most one scheduler holds, with a fencing epoch.

Contract:
- :meth:`LeaderLease.try_acquire` takes the lease when it is free: never taken, expired (its holder
  stopped renewing: killed, paused, cut off from the database), released, or held through a database
  session that no longer exists (a killed holder's connection is gone at once, so that case does not
  wait for the expiry). Each acquisition increments the epoch; the new holder's plan epochs are
  numbered above every epoch of earlier holders (:func:`plan_epoch_base`), so nodes never apply an
  older leader's table after a newer one's.
- Time is the database server's (``now()``), so schedulers' clocks need not agree. The holder also
  keeps a conservative local deadline, :attr:`LeaderLease.valid_until` (monotonic): the time the renew
  request was sent plus the TTL. Past it, the holder must act as if it had lost the lease, whether or
  not a renew has failed yet: that is the fence an old leader waking from a pause meets.
- :meth:`renew` returns False once another scheduler holds the lease; the caller must stop leading.
- :meth:`release` expires the lease at once (a clean shutdown), so a standby takes over without
  waiting for the TTL.

Blocking: every call is one statement on the lease's own connection; call it from a thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from globalsched.state.database.connection import PostgresConnection

PLAN_EPOCHS_PER_LEASE = 10**13      # plan epochs are wall-clock ms (~1.8e12 in 2026) above this base

LEASE_SCHEMA = """
CREATE TABLE IF NOT EXISTS scheduler_lease (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    holder TEXT NOT NULL,
    address TEXT NOT NULL,
    epoch BIGINT NOT NULL,
    pid INTEGER NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
)
"""

_ACQUIRE = """
INSERT INTO scheduler_lease AS l (id, holder, address, epoch, pid, expires_at)
VALUES (1, ?, ?, 1, pg_backend_pid(), now() + make_interval(secs => ?))
ON CONFLICT (id) DO UPDATE SET holder = excluded.holder, address = excluded.address, epoch = l.epoch + 1,
    pid = excluded.pid, expires_at = excluded.expires_at
WHERE l.expires_at < now() OR NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = l.pid)
RETURNING epoch
"""

_RENEW = """
UPDATE scheduler_lease SET expires_at = now() + make_interval(secs => ?), pid = pg_backend_pid()
WHERE id = 1 AND holder = ? AND epoch = ?
RETURNING epoch
"""


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds the lease, as the row says (``expired``: nobody holds it right now)."""

    holder: str
    address: str
    epoch: int
    expired: bool


def plan_epoch_base(lease_epoch: int) -> int:
    """The lowest plan epoch of the leader holding lease epoch ``lease_epoch`` (0: no lease, SQLite)."""
    return lease_epoch * PLAN_EPOCHS_PER_LEASE


class LeaderLease:
    def __init__(self, url: str, identity: str, address: str, ttl_s: float,
                 clock=time.monotonic) -> None:
        self.db = PostgresConnection(url, application_name=f"nexus-scheduler-lease {address}", connect_timeout_s=5)
        self.db.create_tables(LEASE_SCHEMA)
        self.identity = identity
        self.address = address
        self.ttl_s = ttl_s
        self.clock = clock
        self.epoch = 0                  # the lease epoch held (0: none)
        self.valid_until = 0.0          # monotonic: act as leader only before this

    def try_acquire(self) -> int | None:
        """The new lease epoch when this scheduler now holds the lease, else None."""
        sent = self.clock()
        row = self.db.execute(_ACQUIRE, (self.identity, self.address, self.ttl_s)).fetchone()
        if row is None:
            return None
        self.epoch, self.valid_until = row[0], sent + self.ttl_s
        return self.epoch

    def renew(self) -> bool:
        sent = self.clock()
        row = self.db.execute(_RENEW, (self.ttl_s, self.identity, self.epoch)).fetchone()
        if row is None:
            self.valid_until = 0.0
            return False
        self.valid_until = sent + self.ttl_s
        return True

    def holds(self) -> bool:
        return self.epoch > 0 and self.clock() < self.valid_until

    def current(self) -> LeaseHolder | None:
        row = self.db.execute("SELECT holder, address, epoch, expires_at < now() FROM scheduler_lease "
                              "WHERE id = 1").fetchone()
        return LeaseHolder(*row) if row else None

    def release(self) -> None:
        if self.epoch:
            self.db.execute("UPDATE scheduler_lease SET expires_at = now() - interval '1 second' "
                            "WHERE id = 1 AND holder = ? AND epoch = ?", (self.identity, self.epoch))
        self.epoch, self.valid_until = 0, 0.0

    def close(self) -> None:
        self.db.close()
