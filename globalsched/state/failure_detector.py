"""Which nodes have failed by their silence: a pure step, ``verdict, state = detect(last_seen, state, now_s)``.

The scheduler's reaper (globalsched/state/membership.py) calls it every heartbeat interval, and ``nexus
simulate`` calls it on its virtual clock. A node's Attach stream ending is the fast path for a node
that died; this is the backstop for one that hangs or is cut off. Two rules keep a scheduler that
was itself stalled from evicting a healthy cluster (a 5x load step once blocked the scheduler's
loop for over 6 s, after which it removed all six backends and the frontend and planned 0 devices
for 300 requests/s):

* **Silence counts only while the scheduler ran.** A check that comes more than ``pause_slack_s``
  after the one before it finds the scheduler was paused (its loop blocked, its process stopped,
  its host descheduled) for the excess; heartbeats that could not reach it meanwhile are no
  evidence against anyone, so that pause is taken off every node's silence.
* **A stream that ends as the scheduler resumes is no evidence either.** The scheduler pings its
  nodes' streams every 2 s and gives up on a ping after 2 s (common/grpc_util.py): stopped for
  longer, it may find its own ping overdue when it resumes and close a healthy node's stream before
  reading the node's answer (2026-12-07: one frontend of a cluster whose scheduler was stopped for
  10 s, in one CI run of three). :func:`paused_recently` says when a stream's end may be the
  scheduler's own doing; the heartbeats then decide.
* **When most nodes fall silent at once, suspect yourself first.** When at least
  ``mass_silence_fraction`` of the nodes (two or more) are silent beyond the timeout, the likelier
  fault is the scheduler's own (its network, its loop) and nobody is removed; the suspicion ends
  when the nodes are heard again, and holds at most ``self_suspicion_s``, after which the silent
  nodes are removed (a whole rack can fail too).

Time is passed in; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass(frozen=True)
class DetectorConfig:
    timeout_s: float = 5.0                 # silence beyond this, in time the scheduler ran, is a failure
    interval_s: float = 1.0                # how often the detector is called
    pause_slack_s: float = 0.5             # a check this much later than due found the scheduler paused
    mass_silence_fraction: float = 0.5     # this share of the nodes silent at once: suspect yourself
    self_suspicion_s: float = 30.0         # and at most this long


@dataclass(frozen=True)
class DetectorState:
    last_check_s: float | None = None
    pauses: tuple[tuple[float, float], ...] = ()    # (start, end) of the scheduler's own pauses, recent first
    suspect_since_s: float | None = None            # when most nodes fell silent at once
    last_pause_end_s: float | None = None           # when the latest pause found ended (kept once pruned)


@dataclass(frozen=True)
class Verdict:
    removed: tuple[tuple[str, str], ...] = ()       # (node id, why)
    note: str = ""                                   # what the detector holds back, and why ("" when nothing)


def silence_s(last_seen_s: float, now_s: float, pauses: tuple[tuple[float, float], ...]) -> float:
    """Seconds since ``last_seen_s`` during which the scheduler itself ran."""
    paused = sum(max(0.0, min(end, now_s) - max(start, last_seen_s)) for start, end in pauses)
    return max(0.0, now_s - last_seen_s - paused)


def _check_overdue(state: DetectorState, now_s: float, config: DetectorConfig) -> bool:
    """Whether the check at ``now_s`` comes later than the one before it allows: the scheduler was paused."""
    return state.last_check_s is not None and now_s - state.last_check_s > config.interval_s + config.pause_slack_s


def paused_recently(state: DetectorState, now_s: float, config: DetectorConfig = DetectorConfig()) -> bool:
    """Whether the scheduler itself was paused within ``config.timeout_s`` before ``now_s``, or is paused
    now as far as it can tell (its next check is overdue: a pause that check has yet to record)."""
    if _check_overdue(state, now_s, config):
        return True
    return state.last_pause_end_s is not None and state.last_pause_end_s >= now_s - config.timeout_s


def detect(last_seen: Mapping[str, float], state: DetectorState, now_s: float,
           config: DetectorConfig = DetectorConfig()) -> tuple[Verdict, DetectorState]:
    """The nodes to remove now (``last_seen``: node id -> when it was last heard) and the next state."""
    pauses = state.pauses
    last_pause_end_s = state.last_pause_end_s
    if _check_overdue(state, now_s, config):
        pauses = ((state.last_check_s + config.interval_s, now_s),) + pauses
        last_pause_end_s = now_s
    oldest = min(last_seen.values(), default=now_s)
    pauses = tuple(p for p in pauses if p[1] > oldest)     # no node's silence reaches further back
    silent = {node: s for node, at in last_seen.items()
              if (s := silence_s(at, now_s, pauses)) > config.timeout_s}
    if not silent:
        return Verdict(), DetectorState(now_s, pauses, None, last_pause_end_s)
    if len(silent) >= 2 and len(silent) >= config.mass_silence_fraction * len(last_seen):
        since = state.suspect_since_s if state.suspect_since_s is not None else now_s
        if now_s - since < config.self_suspicion_s:
            note = (f"{len(silent)} of {len(last_seen)} nodes silent at once: the scheduler suspects itself and "
                    f"removes none for up to {config.self_suspicion_s - (now_s - since):.0f} s more")
            return Verdict(note=note), DetectorState(now_s, pauses, since, last_pause_end_s)
    removed = tuple((node, f"missed heartbeats for {s:.1f} s") for node, s in sorted(silent.items()))
    return Verdict(removed), DetectorState(now_s, pauses, None, last_pause_end_s)
