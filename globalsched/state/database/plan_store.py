"""The plan in force and the scaling policy's history, kept in the shared PostgreSQL database so that
a standby that takes over adopts them instead of starting afresh (a fresh plan would move sessions
that were placed; a fresh history would restart every cool-down).

Contract:
- :meth:`PlanStore.save` writes the planner's state (globalsched/planning/planner.py, :class:`PlannerState`,
  which holds the plan) before the plan is pushed to any node (write-ahead), so the stored plan is
  the one the nodes hold or the one they are about to hold. The write is fenced: it lands only while
  the lease row names this leader's lease epoch, so an old leader that lost the lease cannot
  overwrite its successor's plan. It returns whether it landed.
- :meth:`PlanStore.load` returns the stored state, or None when there is none, it was written by
  another release (the ``release`` column), or it cannot be read: the new leader then plans afresh,
  as a lone scheduler's restart does.
- :meth:`PlanStore.save_scaling` keeps the scaling policy's state (globalsched/planning/scaling_policy.py), fenced
  the same way, with the moment it was saved on the leader's monotonic clock and on the wall clock;
  :meth:`load_scaling` returns it on the caller's monotonic clock (times shifted by the wall time that
  passed), so cool-downs run on where they were. Schedulers' wall clocks are assumed to agree within
  a second or so (NTP), which a minute's cool-down tolerates.
- The states are pickles. The database is trusted as the model files are (a writer of either can
  change what the cluster runs); the value is only read by schedulers of the same release.
"""

from __future__ import annotations

import logging
import pickle
import time
from importlib.metadata import version

from globalsched.state.database.connection import PostgresConnection
from globalsched.planning.planner import PlannerState
from globalsched.planning.scaling_policy import ScalingState, shifted

log = logging.getLogger("nexus.scheduler")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS plan_in_force (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    lease_epoch BIGINT NOT NULL,
    release TEXT NOT NULL,
    saved_ms BIGINT NOT NULL,
    state BYTEA NOT NULL
)
"""

_SCALING_SCHEMA = """
CREATE TABLE IF NOT EXISTS scaling_in_force (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    lease_epoch BIGINT NOT NULL,
    release TEXT NOT NULL,
    saved_mono_s DOUBLE PRECISION NOT NULL,
    saved_ms BIGINT NOT NULL,
    state BYTEA NOT NULL
)
"""

_SAVE_SCALING = """
INSERT INTO scaling_in_force AS p (id, lease_epoch, release, saved_mono_s, saved_ms, state)
SELECT 1, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM scheduler_lease WHERE id = 1 AND epoch = ?)
ON CONFLICT (id) DO UPDATE SET lease_epoch = excluded.lease_epoch, release = excluded.release,
    saved_mono_s = excluded.saved_mono_s, saved_ms = excluded.saved_ms, state = excluded.state
RETURNING 1
"""

_SAVE = """
INSERT INTO plan_in_force AS p (id, lease_epoch, release, saved_ms, state)
SELECT 1, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM scheduler_lease WHERE id = 1 AND epoch = ?)
ON CONFLICT (id) DO UPDATE SET lease_epoch = excluded.lease_epoch, release = excluded.release,
    saved_ms = excluded.saved_ms, state = excluded.state
RETURNING 1
"""


def release_tag() -> str:
    """What must match for a stored state to be read: the package version and the state's fields."""
    try:
        package = version("nexus-serving")
    except Exception:
        package = "dev"
    return f"{package}:{','.join(PlannerState.__dataclass_fields__)}"


class PlanStore:
    def __init__(self, db: PostgresConnection) -> None:
        self.db = db
        self.db.create_tables(_SCHEMA + ";" + _SCALING_SCHEMA)
        self.release = release_tag()

    def save(self, state: PlannerState, lease_epoch: int) -> bool:
        return self.save_pickled(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), lease_epoch)

    def save_pickled(self, blob: bytes, lease_epoch: int) -> bool:
        """:meth:`save` of a state pickled already (the planner's process pickles the states it makes).
        False: fenced (``lease_epoch`` no longer holds the lease), nothing written."""
        row = self.db.execute(_SAVE, (lease_epoch, self.release, int(time.time() * 1000), blob, lease_epoch)).fetchone()
        return row is not None

    def load(self) -> PlannerState | None:
        row = self.db.execute("SELECT lease_epoch, release, state FROM plan_in_force WHERE id = 1").fetchone()
        state = self._read(row, "plan")
        return state if isinstance(state, PlannerState) else None

    def save_scaling(self, state: ScalingState, lease_epoch: int, now_mono_s: float) -> bool:
        blob = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        row = self.db.execute(_SAVE_SCALING, (lease_epoch, self.release, now_mono_s, int(time.time() * 1000), blob,
                                              lease_epoch)).fetchone()
        return row is not None

    def load_scaling(self, now_mono_s: float) -> ScalingState | None:
        row = self.db.execute("SELECT lease_epoch, release, state, saved_mono_s, saved_ms FROM scaling_in_force "
                              "WHERE id = 1").fetchone()
        state = self._read(row, "scaling history")
        if not isinstance(state, ScalingState):
            return None
        passed_s = max(time.time() - row[4] / 1000, 0.0)
        return shifted(state, now_mono_s - passed_s - row[3])

    def _read(self, row, what: str):
        if row is None:
            return None
        lease_epoch, release, blob = row[:3]
        if release != self.release:
            log.warning("the stored %s (lease epoch %d) was written by another release (%s); starting afresh",
                        what, lease_epoch, release)
            return None
        try:
            return pickle.loads(bytes(blob))
        except Exception as exc:
            log.warning("the stored %s (lease epoch %d) cannot be read (%s); starting afresh", what, lease_epoch, exc)
            return None
