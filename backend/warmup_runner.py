"""Which sessions of a new model table a backend warms up, and the batches it runs (common/warmup_spec.py).

A session is warmed when its runtime is new to this backend (a first load, a move here, a new model
file, a new prefix split): with the model's own samples (``model_warmup``) once, else with the
default samples at the batch sizes not warmed on that runtime yet, so a re-plan that raises a
session's planned batch warms the new size and nothing else. A member of a prefix group runs its
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

    def plan(self, session: Session, samples: tuple[WarmupSample, ...]) -> WarmupPlan | None:
        """The batches that warm ``session`` (``samples``: its model's own; empty: the default); None
        when its runtime needs none."""
        warm = self._warm.get(session.runtime, set())
        if samples:
            if CONFIGURED in warm:
                return None
            todo, sizes = samples, frozenset({CONFIGURED})
        else:
            todo = tuple(s for s in default_samples(session.inputs, session.planned_batch, session.runtime.kind)
                         if s.batch_size not in warm)
            if not todo:
                return None
            sizes = frozenset(s.batch_size for s in todo)
        run = _runner(session)
        rng = np.random.default_rng(0)
        batches = []
        for sample in todo:
            made: list[dict] = []

            def once(sample=sample, made=made) -> object:   # the sample's arrays, built on first use
                if not made:
                    made.append(feeds(sample, rng))
                return run(made[0])
            label = f"{session.name}: warm-up sample {sample.name!r} (batch {sample.batch_size})"
            batches += [WarmupBatch(label, once)] * sample.runs
        return WarmupPlan(session.name, session.runtime, tuple(batches), bool(samples), sizes)

    def done(self, plan: WarmupPlan) -> None:
        self._warm.setdefault(plan.runtime, set()).update(plan.sizes)

    def forget(self, runtime: object) -> None:
        """A runtime closed: a new one of the same model starts cold."""
        self._warm.pop(runtime, None)
