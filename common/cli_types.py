"""Argument types shared by command lines: a value the parser rejects with argparse's own error
(usage and exit status 2), never a traceback from deeper down."""

from __future__ import annotations

import argparse
import math


def non_negative_seconds(text: str) -> float:
    """A finite number of seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds, 0 or more, got {text!r}")
    return value
