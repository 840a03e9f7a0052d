"""`nexus serve` stops on SIGINT/SIGTERM by raising KeyboardInterrupt from its signal handler. Raised
inside subprocess.Popen.poll, between the acquire of Popen's waitpid lock and the try that releases
it, the exception leaks the lock, and the stop then waits for that child forever (seen: a `nexus
serve` hung with its three children exited). The handler never raises there: a signal that lands in
subprocess code is delivered again a moment later. Measured here with a signal every 0.5 ms while
the main thread polls a child, as the supervisor's loop does (SIGPROF, on CPU time: no clash with
pytest-timeout's SIGALRM)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from nexus.serve_cmd import interrupts_popen


def test_a_signal_landing_inside_popen_never_leaks_its_lock():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    counts = {"inside": 0, "raised": 0}

    def handler(signum, frame):
        if interrupts_popen(frame):
            counts["inside"] += 1
            return
        counts["raised"] += 1
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGPROF, handler)
    try:
        signal.setitimer(signal.ITIMER_PROF, 0.0005, 0.0005)
        end, done = time.monotonic() + 2.0, False
        while not done:
            try:
                while time.monotonic() < end:
                    proc.poll()
                signal.setitimer(signal.ITIMER_PROF, 0)
                done = True
            except KeyboardInterrupt:
                pass
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, signal.SIG_IGN)
        signal.signal(signal.SIGPROF, old)
        leaked = proc._waitpid_lock.locked()
        if not leaked:
            proc.kill()
            proc.wait(timeout=10)
    assert counts["inside"] > 0 and counts["raised"] > 0, counts    # both cases happened
    assert not leaked
