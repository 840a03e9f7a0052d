"""Running a component in the foreground: asyncio, signals, and the line that announces the address."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys

READY_PREFIX = "NEXUS-READY"
# Set by nexus/launcher.py to its own pid: the child asks the kernel for SIGTERM when that parent dies.
PARENT_PID_ENV = "NEXUS_PARENT_PID"
PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """When started by a launcher (``$NEXUS_PARENT_PID``), get SIGTERM if it dies (PR_SET_PDEATHSIG);
    exit at once when it died already. Done here, in the child, rather than between fork and exec in
    the launcher, where a process with gRPC threads must not run Python code."""
    pid = os.environ.pop(PARENT_PID_ENV, "")
    if not pid.isdigit():
        return
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(pid):
        sys.exit(1)


# The event loop of every component: uvloop when it is installed (a dependency; measured faster on
# the request path, benchmarks/serving.md), else asyncio's own. NEXUS_EVENT_LOOP=asyncio picks
# asyncio's loop even where uvloop is installed (for A/B measurements and as an escape hatch).
EVENT_LOOP_ENV = "NEXUS_EVENT_LOOP"


def loop_factory():
    """The event loop factory for ``asyncio.Runner`` (None: asyncio's default loop)."""
    choice = os.environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower()
    if choice == "asyncio":
        return None
    if choice != "uvloop":
        raise SystemExit(f"nexus: error: {EVENT_LOOP_ENV}={choice!r}: expected uvloop or asyncio")
    try:
        import uvloop  # lazy: optional (not on Windows), and only a component's event loop needs it
    except ImportError:
        return None
    return uvloop.new_event_loop


def setup_logging(level: str = "") -> None:
    logging.basicConfig(level=(level or os.environ.get("NEXUS_LOG", "INFO")).upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)


def freeze_startup_heap() -> None:
    """Collect, then move every object alive now out of the cyclic collector's reach (``gc.freeze``).

    A component's heap is mostly what it imported (gRPC, protobuf, numpy, ONNX Runtime's bindings):
    some 60,000 tracked objects that live as long as the process. Every full collection traversed
    them all, and held the event loop for 10-30 ms at a time (measured on a backend and a frontend
    under load: benchmarks/vs_triton.md), longer than a tiny model's whole SLO budget: the requests
    in flight missed their deadlines. Frozen, they are never traversed again; objects made later
    are collected as before, and frozen ones freed by reference counting as before."""
    gc.collect()
    gc.freeze()


def run_until_signalled(name: str, serve, config) -> int:
    """Run ``serve(config, ready)`` until SIGINT/SIGTERM; print ``NEXUS-READY <name> <address> [key=value ...]``
    once listening."""

    def ready(address: str, **extra: str) -> None:
        """``extra`` goes after the address as ``key=value`` words (for example ``metrics=URL``). The
        component is set up by now: its start-up heap is frozen first (:func:`freeze_startup_heap`)."""
        freeze_startup_heap()
        print(" ".join([READY_PREFIX, name, address, *(f"{k}={v}" for k, v in extra.items())]), flush=True)

    async def main() -> None:
        task = asyncio.create_task(serve(config, ready))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        runner.run(main())
    return 0
