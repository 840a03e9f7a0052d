"""Where a serving process spends its CPU: py-spy samples of a running process, reduced to the
functions that take the most samples (``py-spy`` is not a project dependency: give its binary).
"""

from __future__ import annotations

import collections
import pathlib
import subprocess

# Frames of a thread waiting, not working: dropped before the shares are computed.
_IDLE = ("epoll_wait", "select (", "poll (", "wait (threading", "_worker (concurrent", "sleep", "acquire",
         "_wait_for_tstate_lock", "wait (", "get (queue")


def record(py_spy_bin: str, pid: int, seconds: float, out: pathlib.Path, rate_hz: int = 100) -> subprocess.Popen:
    """Start ``py-spy record`` of every thread of ``pid`` for ``seconds`` into ``out`` (raw collapsed
    stacks, idle frames included); :func:`finish` waits for it and reduces the file."""
    return subprocess.Popen([py_spy_bin, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", str(rate_hz), "--format", "raw", "--threads", "--nonblocking",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def finish(proc: subprocess.Popen, out: pathlib.Path, seconds: float) -> dict:
    """Wait for a :func:`record` (killed 30 s past its time) and return :func:`top_functions` of it."""
    try:
        proc.wait(timeout=seconds + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return top_functions(out, int(seconds)) if out.exists() else {"error": f"py-spy exit {proc.returncode}"}


def top_functions(raw: pathlib.Path, seconds: float, rate_hz: int = 100, n: int = 12) -> dict:
    """py-spy raw (collapsed) stacks -> the functions with the most samples (self and inclusive), as % of
    the process's busy samples, and each thread's busy share of one core over ``seconds``."""
    self_c: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    total = idle = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        k = int(count)
        frames = stack.split(";")
        leaf = frames[-1]
        if any(s in leaf for s in _IDLE):
            idle += k
            continue
        total += k
        threads[frames[0].split(": ", 1)[-1]] += k     # "thread (TID): NAME" with --threads
        self_c[_short(leaf)] += k
        for f in set(_short(f) for f in frames[1:]):
            incl[f] += k

    def pct(c: collections.Counter) -> dict[str, float]:
        return {f: round(100 * v / max(total, 1), 1) for f, v in c.most_common(n)}

    cores = {t: round(v / (rate_hz * seconds), 3) for t, v in threads.most_common(6)}
    return {"busy_samples": total, "idle_samples": idle, "self_pct": pct(self_c), "inclusive_pct": pct(incl),
            "thread_cores": cores}


def _short(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)'."""
    name, _, where = frame.partition(" (")
    file = where.split(":")[0].rstrip(")")
    return f"{name} ({'/'.join(file.split('/')[-2:])})"
