"""The planner's own process: ``python -m globalsched.planning.planner_worker``, started by
:class:`globalsched.planning.planner_host.PlannerProcess`.

Planning a thousand devices takes seconds of CPU; in a thread it shared the scheduler's interpreter
with the event loop that answers heartbeats, and doubled the loop's every step (issue 24: the loop
lag's p99 at 1,000 devices). This process runs :func:`globalsched.planning.planner.plan_cluster` and
keeps what changes slowly, so that each call costs the loop little to send and less to read back.

The contract, over stdin and stdout, one frame each way per message (:func:`write_frame`: an 8-byte
big-endian length, then a pickle):

- in: ``(SETTINGS, PlannerSettings)``, first and once;
- in: ``(STATE, bytes)``: start from this pickled :class:`PlannerState` (an adopted plan, a restart);
- in: ``(MODELS, field, models)``: models of a model field (by name) that the next ``PLAN``'s
  :class:`ModelsDelta` names; many changed models come this way, a part at a time, so that the
  sender pickles none of them in one piece (the first plan's 2,400 models are 12 MB: 160 ms);
- in: ``(PLAN, fields)``: the :class:`ClusterView`'s fields that changed since the last ``PLAN``
  (a field absent keeps its last value: backends and queries are sent only when they change); the
  models and the stage models come as a :class:`ModelsDelta` (their names in order, and only the
  models that changed); the view is those fields, the planner's state is this process's;
- out, for each ``PLAN``: ``(SAME,)`` when the planner returned the plan of its state as it was (no
  new plan), ``(NEW, plan)``, or ``(FAILED, text)`` with the traceback, the state as it was;
- in: ``(GIVE_STATE,)``, answered with ``(STATE, bytes)``: the state the last call left, pickled (what
  the plan store keeps for a standby). Only when asked: at 1,000 devices it pickles to 13 MB in
  240 ms, which every plan would otherwise wait for.

It ends when its input ends (the scheduler exited, even by SIGKILL). The pickles are trusted: the
only writer is the scheduler that started this process.
"""

from __future__ import annotations

import logging
import os
import pickle
import struct
import sys
import traceback
from dataclasses import dataclass
from typing import Any, BinaryIO, Mapping

from globalsched.planning.cluster_values import ClusterView, ModelView
from globalsched.planning.planner import PlannerSettings, PlannerState, plan_cluster

SETTINGS, STATE, MODELS, PLAN, GIVE_STATE = "settings", "state", "models", "plan", "give state"
SAME, NEW, FAILED = "same", "new", "failed"
LENGTH = struct.Struct(">Q")


def frame(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(body)) + body


def write_frame(out: BinaryIO, message: Any) -> None:
    out.write(frame(message))
    out.flush()


def read_frame(inp: BinaryIO) -> Any | None:
    """The next message, or None at the end of the input (also in the middle of a frame)."""
    head = inp.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    (size,) = LENGTH.unpack(head)
    body = inp.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


@dataclass(frozen=True)
class ModelsDelta:
    """A view's models (a tuple of :class:`ModelView`, or a mapping by name for the stage models) as
    the models the receiver holds: ``names`` in order, ``changed`` those it does not hold as they are.
    At 2,400 models the whole field pickles to 10 MB in 180 ms of the sender's loop; a profile that
    changed sends one model."""

    names: tuple[str, ...]
    changed: Mapping[str, ModelView]
    mapping: bool = False          # the field is a mapping by name, not a tuple

    def apply(self, held: dict[str, ModelView]) -> tuple[ModelView, ...] | dict[str, ModelView]:
        """The field's value, with ``held`` (the receiver's models of the field) brought up to date."""
        held.update(self.changed)
        for name in held.keys() - set(self.names):
            del held[name]
        if self.mapping:
            return {name: held[name] for name in self.names}
        return tuple(held[name] for name in self.names)


class Worker:
    """The process's state between messages; :meth:`handle` answers one message (or None)."""

    def __init__(self) -> None:
        self.settings = PlannerSettings()
        self.state = PlannerState()
        self.fields: dict[str, Any] = {}
        self.models: dict[str, dict[str, ModelView]] = {}      # by field, as the deltas built them

    def handle(self, message: tuple) -> tuple | None:
        kind = message[0]
        if kind == SETTINGS:
            self.settings = message[1]
            return None
        if kind == STATE:
            self.state = pickle.loads(message[1])
            return None
        if kind == GIVE_STATE:
            return (STATE, pickle.dumps(self.state, protocol=pickle.HIGHEST_PROTOCOL))
        if kind == MODELS:
            self.models.setdefault(message[1], {}).update(message[2])
            return None
        if kind != PLAN:
            raise ValueError(f"unknown message {kind!r}")
        for name, value in message[1].items():
            if isinstance(value, ModelsDelta):
                value = value.apply(self.models.setdefault(name, {}))
            self.fields[name] = value
        try:
            plan, state = plan_cluster(ClusterView(**self.fields), self.state, self.settings)
        except Exception:
            return (FAILED, traceback.format_exc())
        same = plan is self.state.plan
        self.state = state
        if same:
            return (SAME,)
        return (NEW, plan)


def main() -> int:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr          # anything printed goes to the log, not into the frames
    # the scheduler's log (its stderr, inherited), in the components' format and at their level
    logging.basicConfig(level=os.environ.get("NEXUS_LOG", "INFO").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    worker = Worker()
    while (message := read_frame(inp)) is not None:
        answer = worker.handle(message)
        if answer is not None:
            try:
                write_frame(out, answer)
            except BrokenPipeError:
                return 0
    return 0


if __name__ == "__main__":
    # Run as imported, so that the frames' classes (ModelsDelta) are this module's, not __main__'s.
    from globalsched.planning import planner_worker
    raise SystemExit(planner_worker.main())
