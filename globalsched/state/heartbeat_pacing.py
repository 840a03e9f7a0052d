"""How often nodes heartbeat, by the cluster's size: a pure function of the node count.

Heartbeats are the backstop (a node's Attach stream ending is how the scheduler learns of a death at
once; heartbeats catch a node that hangs with its connection open). Every heartbeat is a call the
scheduler's one event loop answers, and a thousand nodes beating every second left it no time for
anything else: its loop fell seconds behind, heartbeats timed out and it evicted healthy nodes
(benchmarks/scheduler_fleet.py). So the period asked of nodes grows with their number, keeping the
scheduler at ``max_per_s`` heartbeats a second at most, and a silent node is removed after as many
periods as ``--node-timeout-s`` is of ``--heartbeat-interval-ms``: at 1,000 nodes and the defaults, a
heartbeat every 5 s and removal after 25 s of silence (Kubernetes' node controller waits 40 s).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pacing:
    period_s: float          # heartbeat period asked of every node
    timeout_s: float         # silence (in time the scheduler ran) after which a node is removed


def pacing(nodes: int, min_period_s: float, node_timeout_s: float, max_per_s: float) -> Pacing:
    """The pacing for ``nodes`` nodes: ``min_period_s`` (``--heartbeat-interval-ms``) and
    ``node_timeout_s`` while ``nodes / min_period_s`` stays within ``max_per_s`` (0: no limit),
    both stretched alike beyond it."""
    period = min_period_s if max_per_s <= 0 else max(min_period_s, nodes / max_per_s)
    return Pacing(period, silence_timeout_s(period, min_period_s, node_timeout_s))


def silence_timeout_s(period_s: float, min_period_s: float, node_timeout_s: float) -> float:
    """How long a node beating every ``period_s`` may be silent: as many periods as ``node_timeout_s``
    is of ``min_period_s`` (never less than ``node_timeout_s``)."""
    return node_timeout_s * max(period_s, min_period_s) / min_period_s
