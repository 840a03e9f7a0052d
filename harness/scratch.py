"""A benchmark run's working folder: the models it builds, the databases and logs of the servers it
starts. Removed when the run ends; kept, and named on stderr, when the run ends with an exception or
the driver asks (a failed check), so that the servers' logs can still be read.

    with scratch_dir("timing-checks-") as scratch:
        cluster = ServeCluster(scratch.path / "cluster", ...)
        ...
        scratch.keep = not passed
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import sys
import tempfile
from typing import Iterator


@dataclasses.dataclass
class Scratch:
    path: pathlib.Path
    keep: bool = False      # set by the driver: keep the folder though the run ended without an exception


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[Scratch]:
    """A new folder under the temporary directory, named ``prefix...``; removed at the end of the
    ``with`` unless it ends with an exception or ``keep`` was set."""
    scratch = Scratch(pathlib.Path(tempfile.mkdtemp(prefix=prefix)))
    try:
        yield scratch
    except BaseException:
        scratch.keep = True
        raise
    finally:
        if scratch.keep:
            print(f"the run's folder is kept for its logs: {scratch.path}", file=sys.stderr)
        else:
            shutil.rmtree(scratch.path, ignore_errors=True)
