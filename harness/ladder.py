"""Several servers' goodput measured as pairs: a ladder of rates, every server at each rate back to back.

On a machine shared with other work, the other load drifts, and spikes for minutes at a time. A rate
search per server, one server after the other, compares servers measured under different load; a
spike in one search decides the comparison. The ladder instead measures every server still in the
race at each rate, one right after the other (in an order that rotates from rate to rate), before
going up to the next rate, so that each rate's levels see the same machine.

:func:`paired_ladder` climbs ``start``, ``start * factor``, ... (at most ``max_rate``). A server
leaves the race after ``drop_after`` failed levels in a row (a single failing level is the machine's
as often as the server's). Its goodput is the highest rate it passed. ``level(server, rate)`` runs
one level and returns a dict with at least ``"pass"``; it is called on this thread, one at a time.
"""

from __future__ import annotations

from typing import Callable, Sequence


def ladder_rates(start: float, factor: float, max_rate: float) -> list[float]:
    """``start``, ``start * factor``, ... up to ``max_rate``."""
    if not (start > 0 and factor > 1 and max_rate >= start):
        raise ValueError(f"need start > 0, factor > 1 and max_rate >= start, got {start}, {factor}, {max_rate}")
    rates, rate = [], start
    while rate <= max_rate * (1 + 1e-9):
        rates.append(rate)
        rate *= factor
    return rates


def paired_ladder(servers: Sequence[str], level: Callable[[str, float], dict], start: float, factor: float,
                  max_rate: float, drop_after: int = 2) -> dict[str, dict]:
    """Per server: ``goodput_rps`` (the highest rate it passed, 0.0 if none), ``steps`` (its levels in
    order, each with ``rate``) and ``dropped_at`` (the rate at which it left the race; None if it
    never did)."""
    if drop_after < 1:
        raise ValueError(f"drop_after must be at least 1, got {drop_after}")
    out = {s: {"goodput_rps": 0.0, "steps": [], "dropped_at": None} for s in servers}
    fails = {s: 0 for s in servers}
    alive = list(servers)
    for i, rate in enumerate(ladder_rates(start, factor, max_rate)):
        if not alive:
            break
        k = i % len(alive)
        for server in alive[k:] + alive[:k]:
            step = dict(level(server, rate))
            step["rate"] = rate
            out[server]["steps"].append(step)
            if step["pass"]:
                fails[server] = 0
                out[server]["goodput_rps"] = max(out[server]["goodput_rps"], round(rate, 1))
            else:
                fails[server] += 1
        for server in [s for s in alive if fails[s] >= drop_after]:
            alive.remove(server)
            out[server]["dropped_at"] = round(rate, 1)
    return out
