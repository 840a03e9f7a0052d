"""Where a benchmark's figures come from: every driver (through harness/smoke.py's ``parse_args``)
records the commit it ran, the machine's CPU model and the 1-minute load average during the run,
and marks a run whose load average rose above :data:`QUIET_LOAD` as taken on a busy machine.

At exit the record is printed to stderr and written beside every output file the run produced
(``<output>.provenance.json``), so a figure copied into a page carries its command, commit, CPU
and load with it.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shlex
import subprocess
import sys
import threading
import time

QUIET_LOAD = 1.5            # above this 1-minute load average, a run's figures are marked busy
SAMPLE_S = 5.0


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"unknown CPU, {os.cpu_count()} cores"


def commit() -> str:
    """HEAD's short hash, with ``+changes`` when the working tree differs from it."""
    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+changes" if dirty else "")


class Provenance:
    """The record of one run; :meth:`start` samples the load average until the process exits."""

    def __init__(self, argv: list[str], outputs: list[pathlib.Path]) -> None:
        self.command = "python -m " + " ".join([_module_name(), *map(shlex.quote, argv)])
        self.outputs = outputs
        self._before = {path: _stamp(path) for path in outputs}     # what was there before the run
        self.commit = commit()
        self.cpu = cpu_model()
        self.started = time.time()
        self.loads: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()

    def start(self) -> "Provenance":
        threading.Thread(target=self._sample, name="provenance", daemon=True).start()
        atexit.register(self.finish)
        return self

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.loads.append(os.getloadavg()[0])

    def record(self) -> dict:
        busy = max(self.loads) > QUIET_LOAD
        return {"command": self.command, "commit": self.commit, "cpu": self.cpu,
                "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.started)),
                "duration_s": round(time.time() - self.started, 1),
                "load_average_1m": {"min": min(self.loads), "max": max(self.loads), "samples": len(self.loads)},
                "quiet": not busy,
                "mark": f"taken at a load average above {QUIET_LOAD}: busy machine" if busy else ""}

    def finish(self) -> None:
        self._stop.set()
        self.loads.append(os.getloadavg()[0])
        record = self.record()
        load = record["load_average_1m"]
        print(f"provenance: {record['command']} | commit {record['commit']} | {record['cpu']} | load average "
              f"{load['min']:.2f}-{load['max']:.2f}" + (f" | MARKED: {record['mark']}" if record["mark"] else ""),
              file=sys.stderr)
        for path in self.outputs:    # only what this run wrote: a refused run leaves earlier records alone
            if path.is_file() and _stamp(path) != self._before[path]:
                path.with_name(path.name + ".provenance.json").write_text(json.dumps(record, indent=1) + "\n")


def _stamp(path: pathlib.Path) -> tuple[int, int] | None:
    """A file's modification time and size (None: no file)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _module_name() -> str:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return spec.name if spec is not None else pathlib.Path(sys.argv[0]).stem
