"""The one exception type the profiler raises for problems a user can fix."""

from __future__ import annotations


class ProfilerError(Exception):
    """A precise, one-line description of why profiling cannot go on (bad file, bad option...)."""
