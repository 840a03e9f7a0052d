"""``--smoke``: every benchmark driver's seconds-long run, which CI makes end to end
(tests/e2e/test_benchmark_drivers.py), so a driver that a change inside the product broke fails
there and not on the next real run. A smoke run's numbers mean nothing; nothing it writes lands
where a real run's output goes.

A driver declares what its smoke run changes and parses through :func:`parse_args`::

    p = argparse.ArgumentParser(...)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--out", default="benchmarks/out/x.json")
    add_smoke(p, duration_s=2.0)
    args = parse_args(p, argv)

With ``--smoke``, each named option takes its smoke value unless the command line gave it, and every
option named in :data:`OUTPUT_OPTIONS` (or in ``outputs``) whose value is a path goes to a temporary directory instead
(``--smoke-dir`` names that directory).

Every run parsed here, smoke or not, records its provenance (harness/provenance.py): the commit, the
CPU model and the load average during the run, marked when the machine was not quiet.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
from typing import Sequence

from harness.provenance import Provenance

OUTPUT_OPTIONS = ("out", "json", "plot", "out_dir", "trace_out")


def add_smoke(parser: argparse.ArgumentParser, *, outputs: Sequence[str] = (), **smoke_values) -> None:
    """Add ``--smoke`` and ``--smoke-dir`` to ``parser``; ``smoke_values``: option dest -> its value in a
    smoke run; ``outputs``: more dests (beside :data:`OUTPUT_OPTIONS`) that name an output path. An
    unknown dest is an error here, when the driver is written, not in CI."""
    known = {a.dest for a in parser._actions}
    unknown = sorted((set(smoke_values) | set(outputs)) - known)
    if unknown:
        raise ValueError(f"add_smoke: the parser has no option {', '.join(unknown)}")
    parser.add_argument("--smoke", action="store_true",
                        help="a seconds-long run that checks the driver end to end (CI); its numbers mean nothing")
    parser.add_argument("--smoke-dir", default="", help="with --smoke: where its output goes (default: a temporary "
                                                        "directory)")
    parser.set_defaults(_smoke_values=dict(smoke_values), _smoke_outputs=tuple(outputs))


def _given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests whose option strings appear on the command line."""
    given = set()
    for action in parser._actions:
        for option in action.option_strings:
            if any(arg == option or arg.startswith(option + "=") for arg in argv):
                given.add(action.dest)
    return given


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, *,
               record: bool = True) -> argparse.Namespace:
    """``parser.parse_args(argv)``, then the smoke values and output paths of a ``--smoke`` run; the run's
    provenance is recorded from here to its exit (``record=False``: not, for tests of this parsing)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if getattr(args, "smoke", False):
        _apply_smoke(parser, argv, args)
    outputs = [pathlib.Path(v) for d in (*OUTPUT_OPTIONS, *args._smoke_outputs)
               if isinstance(v := getattr(args, d, None), (str, pathlib.Path)) and str(v)]
    if record:
        Provenance(argv, outputs).start()
    return args


def _apply_smoke(parser: argparse.ArgumentParser, argv: list[str], args: argparse.Namespace) -> None:
    given = _given(parser, argv)
    for dest, value in args._smoke_values.items():
        if dest not in given:
            setattr(args, dest, value)
    out_dir = pathlib.Path(args.smoke_dir or tempfile.mkdtemp(prefix="nexus-smoke-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    for dest in (*OUTPUT_OPTIONS, *args._smoke_outputs):
        value = getattr(args, dest, None)
        if dest in given or not isinstance(value, (str, pathlib.Path)) or not str(value):
            continue
        setattr(args, dest, type(value)(out_dir / pathlib.Path(value).name))
