"""Where the pure planner runs for the scheduler's planning task (globalsched/planning/control_loop.py):
off the event loop that answers heartbeats, reports and table acknowledgements.

Both hosts keep the planner's state between calls, and give back the plan object itself when the
planner made no new one (the planning task compares plans by identity):

- :class:`PlannerProcess` (the scheduler's default, ``--planner process``): its own process
  (globalsched/planning/planner_worker.py). The loop's interpreter spends nothing on planning: it
  sends the view's fields that changed and reads a plan back only when one is made; the state comes
  back only when the plan store asks for it. A process that ends is started again from the last
  plan (with its state, if that was asked for; else the plan alone, which the planner repairs in
  place), and the call is tried once more.
- :class:`InThreadPlanner` (``--planner thread``): a worker thread, which shares the interpreter with
  the loop; at 1,000 devices each of the loop's steps then took up to twice as long while a plan ran.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import operator
import pickle
import sys
from typing import Mapping, Protocol

from common.loop_slices import Steps, run_in_slices
from globalsched.planning.cluster_values import ClusterPlan, ClusterView, ModelView
from globalsched.planning.planner import PlannerSettings, PlannerState, plan_cluster
from globalsched.planning.planner_worker import (FAILED, GIVE_STATE, LENGTH, MODELS, NEW, PLAN, SAME, SETTINGS,
                                                 STATE, ModelsDelta, frame)

log = logging.getLogger("nexus.scheduler")

# The view's fields that change with membership and models, not with every report: sent only when
# they differ from what the process last received; the models, model by model (ModelsDelta).
SLOW_FIELDS = frozenset({"backends", "queries"})
MODEL_FIELDS = frozenset({"models", "stage_models"})
_model_data = operator.attrgetter(*(f.name for f in dataclasses.fields(ModelView) if f.name != "profiles"))
CLOSE_WAIT_S = 2.0


class PlannerFailed(RuntimeError):
    """The planner raised (its traceback, from the process, is the message), or its process ended twice
    in one call."""


class PlannerHost(Protocol):
    async def start(self) -> None:
        """Be ready for the first plan (which otherwise starts what it needs)."""

    async def plan(self, view: ClusterView) -> ClusterPlan | None:
        """The planner's plan for ``view`` from the state the last call left (the previous plan itself
        when it made none)."""

    def adopt(self, state: PlannerState) -> None:
        """Plan on from ``state`` (a plan in force another process made)."""

    async def pickled_state(self) -> bytes:
        """The state the last call left, pickled (what the plan store keeps for a standby)."""

    async def close(self) -> None:
        """Stop; a later :meth:`plan` may start again."""


class InThreadPlanner:
    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        self.state = PlannerState()

    async def plan(self, view: ClusterView) -> ClusterPlan | None:
        plan, self.state = await asyncio.to_thread(plan_cluster, view, self.state, self.settings)
        return plan

    def adopt(self, state: PlannerState) -> None:
        self.state = state

    async def start(self) -> None:
        return None

    async def pickled_state(self) -> bytes:
        return await asyncio.to_thread(pickle.dumps, self.state, pickle.HIGHEST_PROTOCOL)

    async def close(self) -> None:
        return None


class PlannerProcess:
    def __init__(self, settings: PlannerSettings, command: tuple[str, ...] = ()) -> None:
        """``command``: what starts the worker (default: this interpreter running
        globalsched/planning/planner_worker.py)."""
        self.settings = settings
        self.command = command or (sys.executable, "-m", "globalsched.planning.planner_worker")
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._plan: ClusterPlan | None = None       # the plan of the process's state, as this side holds it
        self._state: bytes | None = None            # a state, pickled: adopted, or the last one asked for
        self._state_of: ClusterPlan | None = None   # ... the plan it holds (it is stale once that is not _plan)
        self._state_due = False                     # adopted since the process last received a state
        self._sent: dict[str, object] = {}          # the slow fields as the process holds them
        self._models: dict[str, dict[str, ModelView]] = {}      # the model fields, as the process holds them
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def start(self) -> None:
        """Start the process now, if it is not running (otherwise the first plan starts it)."""
        async with self._lock:
            if self.pid is None:
                await self._start()

    async def plan(self, view: ClusterView) -> ClusterPlan | None:
        async with self._lock:
            for _ in range(2):
                if self._proc is not None and self._proc.returncode is not None:
                    self._ended(f"exit status {(await self._end())}")
                if self._proc is None:
                    await self._start()
                try:
                    return await self._call(view)
                except asyncio.CancelledError:
                    self._abandon()         # its answer would be read as the next call's
                    raise
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    self._ended(f"{type(exc).__name__}, exit status {await self._end()}")
            raise PlannerFailed("the planner process ended twice in one call")

    def _ended(self, how: str) -> None:
        log.warning("the planner process ended (%s); starting another from the last plan", how)

    def adopt(self, state: PlannerState) -> None:
        self._plan = self._state_of = state.plan
        self._state = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        self._state_due = True

    async def pickled_state(self) -> bytes:
        """Asked of the process (it pickles the state only when asked: 240 ms at 1,000 devices); if it
        has ended, the state a new one would start from."""
        async with self._lock:
            proc = self._proc
            if proc is not None and proc.returncode is None:
                try:
                    proc.stdin.write(frame((GIVE_STATE,)))
                    await proc.stdin.drain()
                    answer = await self._read(proc)
                    if answer[0] == STATE:
                        self._state, self._state_of = answer[1], self._plan
                        return self._state
                    raise PlannerFailed(f"the planner process answered {answer[0]!r}")
                except asyncio.CancelledError:
                    self._abandon()
                    raise
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    self._ended(f"{type(exc).__name__}, exit status {await self._end()}")
            return self._restart_state() or pickle.dumps(PlannerState(), protocol=pickle.HIGHEST_PROTOCOL)

    def _restart_state(self) -> bytes | None:
        """What a new process starts from: the state held, if it is the last plan's; else the last plan
        alone, which the planner repairs in place (``ReplanReason.RESUMED``: nothing placed moves)."""
        if self._state is not None and self._state_of is self._plan:
            return self._state
        if self._plan is not None:
            return pickle.dumps(PlannerState(plan=self._plan), protocol=pickle.HIGHEST_PROTOCOL)
        return None

    async def close(self) -> None:
        async with self._lock:
            await self._end()

    async def _start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(*self.command, stdin=asyncio.subprocess.PIPE,
                                                          stdout=asyncio.subprocess.PIPE)
        self.starts += 1
        self._sent, self._models = {}, {}
        self._proc.stdin.write(frame((SETTINGS, self.settings)))
        state = self._restart_state()
        if state is not None:
            self._proc.stdin.write(frame((STATE, state)))
        self._state_due = False

    async def _call(self, view: ClusterView) -> ClusterPlan | None:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        if self._state_due:
            proc.stdin.write(frame((STATE, self._state)))
            self._state_due = False
        fields: dict[str, object] = {}
        models: dict[str, dict[str, ModelView]] = {}
        # At 1,000 backends and 2,400 models the comparisons took 80-110 ms of the loop in one piece.
        for f in dataclasses.fields(ClusterView):
            value = getattr(view, f.name)
            if f.name in MODEL_FIELDS:
                value, models[f.name] = await run_in_slices(_models_delta_steps(value, self._models.get(f.name, {})))
            elif f.name in SLOW_FIELDS and f.name in self._sent:
                if await run_in_slices(_same_steps(self._sent[f.name], value)):
                    continue
            fields[f.name] = value
        for name, value in fields.items():
            if isinstance(value, ModelsDelta) and len(value.changed) > MODELS_PER_FRAME:
                fields[name] = await self._send_models(proc, name, value)
        proc.stdin.write(frame((PLAN, fields)))
        await proc.stdin.drain()
        answer = await self._read(proc)
        self._sent.update((name, value) for name, value in fields.items() if name in SLOW_FIELDS)
        self._models.update(models)
        if answer[0] == SAME:
            return self._plan
        if answer[0] == NEW:
            self._plan = answer[1]
            return self._plan
        if answer[0] == FAILED:
            raise PlannerFailed(f"the planner raised, in its process:\n{answer[1]}")
        raise PlannerFailed(f"the planner process answered {answer[0]!r}")

    @staticmethod
    async def _send_models(proc: asyncio.subprocess.Process, field: str, delta: ModelsDelta) -> ModelsDelta:
        """Send ``delta``'s changed models ahead of the plan, MODELS_PER_FRAME at a time, handing the
        loop back between frames; the delta that is left to send."""
        changed = list(delta.changed.items())
        for start in range(0, len(changed), MODELS_PER_FRAME):
            proc.stdin.write(frame((MODELS, field, dict(changed[start:start + MODELS_PER_FRAME]))))
            await proc.stdin.drain()
            await asyncio.sleep(0)
        return dataclasses.replace(delta, changed={})

    @staticmethod
    async def _read(proc: asyncio.subprocess.Process):
        head = await proc.stdout.readexactly(LENGTH.size)
        body = await proc.stdout.readexactly(LENGTH.unpack(head)[0])
        # A plan of a thousand backends is some 100,000 objects: the collection their allocations set
        # off held the loop up to 130 ms; read without it, 8 ms (benchmarks/elastic.md).
        collecting = gc.isenabled()
        gc.disable()
        try:
            return pickle.loads(body)
        finally:
            if collecting:
                gc.enable()

    def _abandon(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()

    async def _end(self) -> int | None:
        """Stop the process (its input closed, then killed if it does not exit); its exit status."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.returncode is None:
            try:
                proc.stdin.close()
            except Exception:
                pass
            try:
                await asyncio.wait_for(proc.wait(), CLOSE_WAIT_S)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
        return proc.returncode


SAME_PER_STEP = 100     # models or items compared between two steps (common/loop_slices.py)
MODELS_PER_FRAME = 200  # changed models per frame ahead of a plan: 1 MB, 13 ms to pickle (12 MB in one: 160 ms)


def _models_delta_steps(value, held: dict[str, ModelView]) -> Steps[tuple[object, dict[str, ModelView]]]:
    """``value`` (a tuple of models, or a mapping by name) as a :class:`ModelsDelta` from ``held``, and
    what the receiver holds after it; a tuple that names a model twice goes whole. A model is unchanged
    when its profiles are the very objects held (the scheduler keeps a profile's object while its
    table stands) and the rest of it is equal: comparing profiles row by row cost 80 ms a call at
    2,400 models. In steps of SAME_PER_STEP models (common/loop_slices.py)."""
    mapping = isinstance(value, Mapping)
    pairs = list(value.items()) if mapping else [(m.name, m) for m in value]
    now = dict(pairs)
    if len(now) != len(pairs):
        return value, {}
    changed = {}
    for i, (key, m) in enumerate(pairs):
        if not _same_model(held.get(key), m):
            changed[key] = m
        if i % SAME_PER_STEP == SAME_PER_STEP - 1:
            yield
    return ModelsDelta(tuple(now), changed, mapping), now


def _same_steps(held, value) -> Steps[bool]:
    """Whether ``value`` equals ``held`` (tuples compared item by item, in steps; anything else at once)."""
    if held is value:
        return True
    if not (isinstance(held, tuple) and isinstance(value, tuple)):
        return held == value
    if len(held) != len(value):
        return False
    for start in range(0, len(value), SAME_PER_STEP):
        if held[start:start + SAME_PER_STEP] != value[start:start + SAME_PER_STEP]:
            return False
        yield
    return True


def _same_model(held: ModelView | None, model: ModelView) -> bool:
    if held is model:
        return True
    if held is None or held.profiles.keys() != model.profiles.keys():
        return False
    if not all(map(operator.is_, map(held.profiles.__getitem__, model.profiles), model.profiles.values())):
        return False
    return _model_data(held) == _model_data(model)
