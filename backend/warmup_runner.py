"""Which sessions of a new model table a backend warms up, and the batches it runs (common/warmup_spec.py).

A session is warmed when its runtime is new to this backend (a first load, a move here, a new model
file, a new prefix split): with the model's own samples (``model_warmup``) once, else with the
default samples at the batch sizes not warmed on that runtime yet, so a re-plan that raises a
session's planned batch warms the new size and nothing else.

Only what the plan needs at once holds the model table's answer, and with it the plan's make step
(globalsched/actuators/distribution.py): the model's own samples (as Triton, before the model is
ready), and the default's planned batch of a runtime that serves nothing here yet. The rest is
*deferred*: run after the table took effect, on an idle device (backend/engine.py): the default's
batch 1 (what a lone request after a quiet spell runs, when the device has time to warm it first),
and a new planned batch of a runtime already serving, whose requests have been running batches of
every size up to its max batch. Under a load step, each warm-up batch on a busy device waits for a
serving batch, so every batch that holds the answer delays the capacity the step waits for
(benchmarks/elastic.md). A member of a prefix group runs its
samples through the shared prefix and then its suffix, as its requests will (at its own planned
batch: every member warms the prefix too, so the group's warm-up does not run the prefix at the
merged size, which would only repeat that work at a larger batch).

A failing batch of the model's own samples fails the session's load, as in Triton; a failing default
batch (the default guesses shapes a variable dimension may not take) is only logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from backend.engine import WarmupBatch

from backend.sessions import Session
from common.warmup_spec import WarmupSample, default_samples, feeds

CONFIGURED = 0      # marks a runtime whose model's own samples ran (batch sizes are >= 1)


@dataclass(frozen=True)
class WarmupPlan:
    session: str
    runtime: object                  # the runtime it warms (a member's suffix)
    batches: tuple[WarmupBatch, ...]
    configured: bool                 # the model's own samples: a failure fails the session's load
    sizes: frozenset[int]            # what it marks warm on success (CONFIGURED for the model's samples)
    deferred: bool = False           # runs after the table took effect, on an idle device


def _runner(session: Session) -> Callable[[Mapping[str, np.ndarray]], object]:
    """How the session's requests run: its runtime, or in a prefix group the prefix, then its suffix."""
    group = session.group
    if group is None:
        return session.runtime.run
    prefix, suffix = group.runtime, session.runtime

    def run(inputs: Mapping[str, np.ndarray]) -> object:
        # Positional, as the engine's merged batches: the members' inputs match the prefix's.
        features = prefix.run({p.name: inputs[s.name] for p, s in zip(prefix.inputs, session.inputs)})
        return suffix.run({suffix.inputs[0].name: features[group.cut_tensor]})
    return run


class Warmer:
    """What each loaded runtime has been warmed with: the model's samples, or default batch sizes."""

    def __init__(self) -> None:
        self._warm: dict[object, set[int]] = {}
        self._deferred: dict[object, set[int]] = {}     # sizes of deferred warm-ups started, not finished

    def plan(self, session: Session, samples: tuple[WarmupSample, ...], serving: bool = False
             ) -> tuple[WarmupPlan, ...]:
        """The warm-ups of ``session`` (``samples``: its model's own; empty: the default), none when its
        runtime needs none: at most one that holds the table's answer, then at most one deferred
        (module docstring). ``serving``: its runtime serves requests here already."""
        warm = self._warm.get(session.runtime, set())
        if samples:
            if CONFIGURED in warm:
                return ()
            return (self._plan(session, samples, frozenset({CONFIGURED}), configured=True),)
        warm = warm | self._deferred.get(session.runtime, set())
        todo = [s for s in default_samples(session.inputs, session.planned_batch, session.runtime.kind)
                if s.batch_size not in warm]
        now = [s for s in todo if not serving and s.batch_size == session.planned_batch]
        later = [s for s in todo if s not in now]
        return tuple(self._plan(session, tuple(part), frozenset(s.batch_size for s in part), deferred=deferred)
                     for part, deferred in ((now, False), (later, True)) if part)

    @staticmethod
    def _plan(session: Session, todo: tuple[WarmupSample, ...], sizes: frozenset[int], *, configured: bool = False,
              deferred: bool = False) -> WarmupPlan:
        run = _runner(session)
        rng = np.random.default_rng(0)
        batches: list[WarmupBatch] = []
        for sample in todo:
            made: list[dict] = []

            def once(sample=sample, made=made) -> object:   # the sample's arrays, built on first use
                if not made:
                    made.append(feeds(sample, rng))
                return run(made[0])
            label = f"{session.name}: warm-up sample {sample.name!r} (batch {sample.batch_size})"
            batches += [WarmupBatch(label, once)] * sample.runs
        return WarmupPlan(session.name, session.runtime, tuple(batches), configured, sizes, deferred)

    def started(self, plan: WarmupPlan) -> None:
        """A deferred ``plan`` was handed to the engine: no later plan repeats its sizes meanwhile."""
        self._deferred.setdefault(plan.runtime, set()).update(plan.sizes)

    def done(self, plan: WarmupPlan, ok: bool = True) -> None:
        """``plan`` finished: its sizes are warm if ``ok`` (else a later plan tries them again)."""
        deferred = self._deferred.get(plan.runtime)
        if deferred is not None:
            deferred.difference_update(plan.sizes)
            if not deferred:
                del self._deferred[plan.runtime]
        if ok and not getattr(plan.runtime, "closed", False):    # a deferred one may end after forget()
            self._warm.setdefault(plan.runtime, set()).update(plan.sizes)

    def forget(self, runtime: object) -> None:
        """A runtime closed: a new one of the same model starts cold."""
        self._warm.pop(runtime, None)
        self._deferred.pop(runtime, None)
