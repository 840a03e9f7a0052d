"""The one way components are started as processes: ``nexus serve``, the tests and the benchmarks.

A component's command line is built from its config dataclass (``common/config.py``) with
:func:`~common.config.to_argv`, so a launcher can never pass a flag the component does not have,
nor re-declare a default that drifts from the component's own. :class:`Child` runs one
``nexus <component> ...`` (or ``nexus serve ...``) process and reads the ``NEXUS-READY`` line it
prints once it listens; :class:`Supervisor` restarts children that die, with exponential backoff,
and stops for good those it is told to retire (``nexus serve --backends auto`` removing a backend).

The components never import this module (nothing imports the ``nexus`` package but the command
itself, the tests and the benchmarks).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from common.config import BackendConfig, FrontendConfig, SchedulerConfig, split_host_port, to_argv
from nexus.process import PARENT_PID_ENV, READY_PREFIX

COMPONENTS: dict[type, str] = {SchedulerConfig: "scheduler", FrontendConfig: "frontend", BackendConfig: "backend"}


def nexus_command() -> list[str]:
    """How to run ``nexus``: the installed console script next to this interpreter, else ``python -m nexus``."""
    script = pathlib.Path(sys.executable).parent / "nexus"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("nexus")
    return [found] if found else [sys.executable, "-m", "nexus"]


def component_argv(config) -> list[str]:
    """``[component, *flags]`` that starts the component ``config`` configures, e.g. ``["backend", "--device", ...]``."""
    try:
        name = COMPONENTS[type(config)]
    except KeyError:
        raise TypeError(f"not a component configuration: {type(config).__name__}") from None
    return [name, *to_argv(config)]


class Child:
    """One ``nexus ARGV...`` process that dies with this one (``$NEXUS_PARENT_PID``, see nexus/process.py).

    ``command`` replaces the ``nexus`` command (the benchmarks' boot wrapper); ``wrap`` goes before
    it (for example ``["ip", "netns", "exec", NAME]``). :meth:`wait_ready` returns the address from
    the child's ``NEXUS-READY`` line; :meth:`restart` starts the same command line again.
    """

    def __init__(self, name: str, argv: Sequence[str], env: dict | None = None, *,
                 command: Sequence[str] | None = None, wrap: Sequence[str] = (), stderr=None, cwd=None,
                 start_new_session: bool = False) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.command = list(command or nexus_command())
        self.wrap = list(wrap)
        self.stderr = stderr
        self.cwd = cwd
        self.start_new_session = start_new_session
        self.address = ""
        self.ready_fields: list[str] = []   # the ready line, split: NEXUS-READY <name> <address> ...
        self.info: dict[str, str] = {}      # its key=value words (metrics=URL, http=HOST:PORT)
        self.starts = 0
        self.proc: subprocess.Popen = None  # type: ignore[assignment]
        self._lines: queue.Queue = queue.Queue()
        self.start()

    @property
    def args(self) -> list[str]:
        return [*self.wrap, *self.command, *self.argv]

    def start(self) -> None:
        self.address = ""
        self.ready_fields = []
        self.info = {}
        self._lines = queue.Queue()
        env = dict(self.env, **{PARENT_PID_ENV: str(os.getpid())})
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=self.cwd,
                                     start_new_session=self.start_new_session, text=True, bufsize=1)
        self.starts += 1
        threading.Thread(target=self._pump, args=(self.proc, self._lines), daemon=True).start()

    @staticmethod
    def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    def _take_line(self, timeout_s: float) -> str | None:
        line = self._lines.get(timeout=timeout_s)
        if line is not None and line.startswith(READY_PREFIX) and not self.ready_fields:
            self.ready_fields = line.split()
            self.address = self.ready_fields[2] if len(self.ready_fields) > 2 else ""
            self.info = dict(w.split("=", 1) for w in self.ready_fields[3:] if "=" in w)
        return line

    def poll_ready(self) -> bool:
        """Without blocking: has the child printed its ready line?"""
        try:
            while not self.ready_fields:
                self._take_line(0)
        except queue.Empty:
            pass
        return bool(self.ready_fields)

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready_fields and time.monotonic() < deadline:
            try:
                self._take_line(0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with status {self.proc.returncode} before it was ready")
        if not self.ready_fields:
            raise RuntimeError(f"{self.name} was not ready within {timeout_s:.0f} s")
        return self.address

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def restart(self) -> None:
        if self.proc.poll() is None:
            self.stop()
        self.start()


def launch(config, name: str = "", **kwargs) -> Child:
    """Start the component ``config`` configures (``**kwargs`` as for :class:`Child`)."""
    argv = component_argv(config)
    return Child(name or argv[0], argv, **kwargs)


def pin_listen(child: Child, config, **bound: str):
    """``config`` listening where ``child`` bound: a restarted scheduler or frontend keeps the addresses
    its peers and clients know, also where it was started on port 0. ``bound`` names other listening
    fields and where they bound (a frontend's ``http_listen=HOST:PORT``); only port-0 fields change."""
    changes = {}
    for name, address in {"listen": child.address, **bound}.items():
        current = getattr(config, name, "")
        if not address or not current:
            continue
        try:
            if split_host_port(current)[1] == 0:
                changes[name] = address
        except ValueError:
            continue
    if not changes:
        return config
    pinned = dataclasses.replace(config, **changes)
    child.argv = component_argv(pinned)
    return pinned


@dataclasses.dataclass
class _Watch:
    child: Child
    failures: int = 0
    restart_at: float | None = None
    started_at: float = 0.0
    announced: bool = False
    kill_at: float | None = None      # retiring: SIGTERM sent, SIGKILL at this time; never restarted


class Supervisor:
    """Restarts children that exit while the cluster runs, with exponential backoff, and logs it.

    :meth:`check` is called periodically: a child that exited is restarted after ``initial_s``,
    doubling with every failure in a row up to ``max_s``; one that stayed up ``stable_s`` has its
    count reset. Once :attr:`stopping` is set (by :meth:`stop_all`, or by a signal handler the
    moment the cluster is told to stop) nothing is restarted any more: a child that exits then
    exits because the cluster stops. A child stopped on purpose (:meth:`retire`) is never restarted
    either: it drains, exits and leaves the supervisor's list.
    """

    def __init__(self, log: Callable[[str], None], *, initial_s: float = 0.5, max_s: float = 30.0,
                 stable_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.initial_s = initial_s
        self.max_s = max_s
        self.stable_s = stable_s
        self.clock = clock
        self.watches: list[_Watch] = []
        self.stopping = False

    def add(self, child: Child, *, stop_after: Child | None = None) -> Child:
        """Watch ``child``. :meth:`stop_all` stops it first of those added so far, or, with ``stop_after``,
        right after that one (a backend added while the cluster runs still stops after the frontend)."""
        watch = _Watch(child, started_at=self.clock(), announced=bool(child.ready_fields))
        at = next((i for i, w in enumerate(self.watches) if w.child is stop_after), len(self.watches))
        self.watches.insert(at, watch)
        return child

    def retire(self, child: Child, timeout_s: float) -> None:
        """Stop ``child`` for good: SIGTERM now (it drains), SIGKILL if it still runs ``timeout_s`` later.
        :meth:`check` logs its exit and forgets it; it is never restarted."""
        for w in self.watches:
            if w.child is child and w.kill_at is None:
                w.kill_at = self.clock() + timeout_s
                w.restart_at = None
                child.signal(signal.SIGTERM)

    @property
    def retiring(self) -> list[Child]:
        return [w.child for w in self.watches if w.kill_at is not None]

    @property
    def children(self) -> list[Child]:
        return [w.child for w in self.watches]

    def backoff_s(self, failures: int) -> float:
        return min(self.initial_s * 2 ** max(failures - 1, 0), self.max_s)

    def check(self) -> None:
        if self.stopping:
            return
        now = self.clock()
        for w in list(self.watches):
            c = w.child
            if w.kill_at is not None:
                self._check_retiring(w, now)
                continue
            if c.running():
                if not w.announced and c.poll_ready():
                    w.announced = True
                    if c.starts > 1:
                        self.log(f"{c.name} is back (pid {c.proc.pid}) at {c.address}")
                if w.failures and now - w.started_at >= self.stable_s:
                    w.failures = 0
                continue
            if w.restart_at is None:
                w.failures += 1
                delay = self.backoff_s(w.failures)
                w.restart_at = now + delay
                self.log(f"{c.name} (pid {c.proc.pid}) exited with status {c.proc.returncode}; "
                         f"restarting in {delay:.1f} s (failure {w.failures} in a row)")
            elif now >= w.restart_at:
                w.restart_at = None
                w.started_at = now
                w.announced = False
                c.start()
                self.log(f"{c.name} restarted (pid {c.proc.pid})")

    def _check_retiring(self, w: _Watch, now: float) -> None:
        c = w.child
        if not c.running():
            self.watches.remove(w)
            self.log(f"{c.name} (pid {c.proc.pid}) stopped, exit status {c.proc.returncode}")
        elif now >= w.kill_at:
            self.log(f"{c.name} (pid {c.proc.pid}) did not exit within its time to drain after SIGTERM; killing it")
            c.proc.kill()
            w.kill_at = float("inf")

    def stop_all(self) -> dict[str, int]:
        """Stop every child, the last added first (each one's SIGTERM drain ends before the next
        starts); their exit statuses by name."""
        self.stopping = True
        return {w.child.name: w.child.stop() for w in reversed(self.watches)}

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to every child still running."""
        for w in self.watches:
            w.child.signal(sig)
