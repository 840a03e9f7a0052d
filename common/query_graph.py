"""The shape of a multi-model query: its stages and the edges between them.

A query has two faces. :class:`common.query_def.QueryDef` is what the frontend serves (tensors,
wiring, fan-out rules); :class:`globalsched.planning.plan.QuerySpec` is what the scheduler plans (profiles, rate,
fan-out gammas). Both hold one :class:`QueryGraph`, and every structural question (order, cycles,
roots, root-to-leaf paths, the session name of a stage) is answered here, once, so that serving and
planning can never disagree about which stages follow which.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class QueryError(ValueError):
    """A query that cannot be served or planned; the message names the problem."""


@dataclass(frozen=True)
class QueryGraph:
    """Stages of query ``name`` in declaration order and ``(parent, child)`` edges between them.

    Invariants, checked on construction (QueryError names the first broken one): at least one
    stage, unique stage names, edges between known stages, no duplicate edge, no cycle (the message
    spells the cycle out, e.g. ``a -> b -> a``).
    """

    name: str
    stages: tuple[str, ...]
    edges: tuple[tuple[str, str], ...] = ()
    _children: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _parents: dict[str, tuple[str, ...]] = field(init=False, repr=False, compare=False)
    _order: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"query {self.name!r}"
        if not self.stages:
            raise QueryError(f"{where}: needs at least one stage")
        dup = sorted({s for s in self.stages if self.stages.count(s) > 1})
        if dup:
            raise QueryError(f"{where}: duplicate stage name(s) {dup}")
        known = set(self.stages)
        children: dict[str, list[str]] = {s: [] for s in self.stages}
        parents: dict[str, list[str]] = {s: [] for s in self.stages}
        for parent, child in self.edges:
            for end in (parent, child):
                if end not in known:
                    raise QueryError(f"{where}: edge {parent}->{child} names unknown stage {end!r}")
            if child in children[parent]:
                raise QueryError(f"{where}: duplicate edge {parent}->{child}")
            children[parent].append(child)
            parents[child].append(parent)
        object.__setattr__(self, "_children", {k: tuple(v) for k, v in children.items()})
        object.__setattr__(self, "_parents", {k: tuple(v) for k, v in parents.items()})
        object.__setattr__(self, "_order", self._topological_order())

    def _topological_order(self) -> tuple[str, ...]:
        indeg = {s: len(self._parents[s]) for s in self.stages}
        order = [s for s in self.stages if indeg[s] == 0]
        i = 0
        while i < len(order):
            for child in self._children[order[i]]:
                indeg[child] -= 1
                if indeg[child] == 0:
                    order.append(child)
            i += 1
        if len(order) != len(self.stages):
            raise QueryError(f"query {self.name!r}: stages form a cycle: {self._cycle(set(order))}")
        return tuple(order)

    def _cycle(self, acyclic: set[str]) -> str:
        """One cycle among the stages outside ``acyclic`` (each of which has a parent in a cycle or
        below one), written from its first stage back to it."""
        start = next(s for s in self.stages if s not in acyclic)
        path, node = [start], start
        while True:
            node = next(p for p in self._parents[node] if p not in acyclic)
            if node in path:
                cut = path[path.index(node):] + [node]
                return " -> ".join(reversed(cut))
            path.append(node)

    def parents(self, stage: str) -> tuple[str, ...]:
        return self._parents[stage]

    def children(self, stage: str) -> tuple[str, ...]:
        return self._children[stage]

    def roots(self) -> list[str]:
        return [s for s in self.stages if not self._parents[s]]

    def topological_order(self) -> list[str]:
        """Every stage after all of its parents; ties keep declaration order."""
        return list(self._order)

    def is_tree(self) -> bool:
        """True when every stage has at most one parent (a forest of trees)."""
        return all(len(p) <= 1 for p in self._parents.values())

    def paths(self) -> list[tuple[str, ...]]:
        """Every root-to-leaf path (exponential in the worst case; queries are small)."""
        out: list[tuple[str, ...]] = []

        def walk(stage: str, prefix: tuple[str, ...]) -> None:
            here = prefix + (stage,)
            if not self._children[stage]:
                out.append(here)
            for child in self._children[stage]:
                walk(child, here)

        for root in self.roots():
            walk(root, ())
        return out

    def session_name(self, stage: str) -> str:
        """The session that serves ``stage``: ``<query>/<stage>``."""
        return session_name(self.name, stage)


def session_name(query: str, stage: str) -> str:
    """The session that serves stage ``stage`` of query ``query``."""
    return f"{query}/{stage}"
