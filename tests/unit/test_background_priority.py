"""backend/profile_requests.py: a background measurement's thread runs BACKGROUND_NICE below the
thread that made it, and nothing else changes priority."""

from __future__ import annotations

import os
import threading

from backend import profile_requests
from backend.profile_requests import BACKGROUND_NICE, background_executor, lower_thread_priority


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_a_thread(fn):
    out = {}

    def run():
        out["before"] = _own_nice()
        fn()
        out["after"] = _own_nice()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_the_calling_thread_alone_is_lowered_and_never_past_19():
    main = _own_nice()
    seen = _in_a_thread(lower_thread_priority)
    assert seen["after"] == min(seen["before"] + BACKGROUND_NICE, 19)
    assert _own_nice() == main                       # the thread that asked for nothing is untouched
    twice = _in_a_thread(lambda: (lower_thread_priority(15), lower_thread_priority(15)))
    assert twice["after"] == 19


def test_the_background_executor_runs_below_its_creator_and_its_threads_inherit_it():
    main = _own_nice()
    pool = background_executor()
    try:
        own, child = pool.submit(lambda: (_own_nice(), _in_a_thread(lambda: None)["before"])).result(10)
    finally:
        pool.shutdown()
    assert own == min(main + BACKGROUND_NICE, 19)
    assert child == own                               # a runtime's worker threads, made there, inherit it
    assert _own_nice() == main


def test_a_refused_change_leaves_the_thread_as_it_was(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(profile_requests.os, "setpriority", refuse)
    seen = _in_a_thread(lower_thread_priority)
    assert seen["after"] == seen["before"]
