"""``nexus profile``: batch-latency profiles, and multi-tenant measurement.

    nexus profile MODEL --device cpu|cuda:N [--runtime KIND] [--batch-sizes LIST | --max-batch auto|N] -o PROFILE.json
    nexus profile multitenant MODEL MODEL... --device DEV --slo-ms S [--price-per-hour P] -o REPORT.json

The work is done by :mod:`profiler`; this module parses arguments, drives the progress bar and
writes the files.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from common.model_io import ModelFileError, parse_io_json
from common.profile import Profile, ProfileError
from profiler.errors import ProfilerError
from profiler.inputs import parse_input_shapes
from profiler.model_file import read_model_file
from profiler.plot import plot_frontier, plot_profile
from profiler.tables import format_multitenant_table, format_profile_table, load_warning

MULTITENANT = "multitenant"
PROG = "nexus profile"

USAGE = """
  nexus profile MODEL [--device DEV] [--runtime KIND] [--batch-sizes LIST | --max-batch auto|N] [-o PROFILE.json]
  nexus profile multitenant MODEL MODEL... --slo-ms S [--device DEV] [--price-per-hour P] [-o REPORT.json]"""

DESCRIPTION = """\
Measure how a model's batch latency grows with the batch size on a device (warm-up, repeated timed
runs, mean / std / p99 and memory per batch size) and write the profile the scheduler plans with.
With 'multitenant' first, measure models sharing one device instead: each model's dedicated peak
throughput under the SLO, the co-located throughput frontier, cost per million inferences and the
co-location slowdown. Formats: profiler/README.md."""

EPILOG = """\
examples:
  nexus profile resnet18_64.onnx --device cpu -o resnet18_64.cpu.json
  nexus profile model.onnx --device cuda:0 --batch-sizes 1,2,4,8,16,32 -o model.json
  nexus profile multitenant a.onnx b.onnx --device cpu --slo-ms 50 --price-per-hour 0.5 -o mt.json

A model file literally named 'multitenant' must be given as ./multitenant."""

# Options of one mode only; they default to None so that run() can tell when they were given.
# (--batch-sizes, --max-batch, --iters, --min-iters, --warmup and --time-budget-s also steer the profiling
# that multitenant does first.)
SINGLE_ONLY = ("batch_limit", "min_gain", "patience", "max_latency_ms", "memory_limit_mb", "fill", "strict",
               "all_rows")
MULTI_ONLY = ("slo_ms", "price_per_hour", "duration_s", "fractions", "refine", "percentile", "max_bad_rate",
              "profiles")


class _UsageError(Exception):
    pass


def register(subparsers) -> None:
    p = subparsers.add_parser("profile", help="measure batch-latency profiles, or multi-tenant serving",
                              usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="+", metavar="MODEL",
                   help="model file (.onnx; .pt/.pt2 for torch); after 'multitenant': two or more")
    g = p.add_argument_group("both modes")
    g.add_argument("--device", default="cpu",
                   help="cpu or cuda:N (default: cpu); multitenant also takes emulated:<gpu> with --profiles")
    g.add_argument("--runtime", choices=("onnxruntime", "torch", "emulated"),
                   help="runtime to measure with (default: from the file extension)")
    g.add_argument("-o", "--output", metavar="PATH",
                   help="write the JSON here (default: the profile to stdout; multitenant: table only)")
    g.add_argument("--threads", type=int, help="intra-op threads, pinned (default: one per available CPU)")
    g.add_argument("--cpus", metavar="LIST", help="bind the process to these CPU ids, e.g. 0,1")
    g.add_argument("--seed", type=int, default=0, help="seed for inputs and load (default: 0)")
    g.add_argument("--input-shape", action="append", metavar="NAME=D1xD2",
                   help="concrete shape (without batch) for an input with variable dimensions")
    g.add_argument("--io", metavar="LIST",
                   help="io description JSON per model (comma-separated, in MODEL order): TorchScript files "
                        "need one ({\"inputs\": [{name, datatype, shape}], \"outputs\": [...]})")
    g.add_argument("--device-type", help="device type to record (default: 'cpu' or the GPU's name)")
    g.add_argument("--plot", metavar="PNG", help="plot path (default: next to -o, with .png)")
    g.add_argument("--no-plot", action="store_true", help="do not write a plot")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    s = p.add_argument_group("profile options",
                             "(--batch-sizes, --max-batch, --iters, --min-iters, --warmup and --time-budget-s also "
                             "apply to the profiling multitenant does first; there 'auto' stops at SLO/2)")
    s.add_argument("--batch-sizes", metavar="LIST", help="comma-separated batch sizes to measure (1 is always added)")
    s.add_argument("--max-batch", metavar="auto|N",
                   help="'auto' (default): stop when throughput gains fall under --min-gain or memory runs "
                        "out; N: measure the grid 1,2,3,4,6,8,...,N")
    s.add_argument("--batch-limit", type=int, metavar="N", help="largest batch 'auto' may try (default: 512)")
    s.add_argument("--iters", type=int, help="timed runs per batch size (default: 100)")
    s.add_argument("--min-iters", type=int, help="timed runs at least, when the time budget runs out (default: 10)")
    s.add_argument("--warmup", type=int, help="untimed runs per batch size first (default: 3)")
    s.add_argument("--time-budget-s", type=float, help="seconds of timed runs per batch size at most (default: 2)")
    s.add_argument("--min-gain", type=float, metavar="PCT",
                   help="'auto' stops when throughput grows less than this percent (default: 1)")
    s.add_argument("--patience", type=int, help="consecutive grid points that must fail to beat the best smaller batch before 'auto' stops (default: 2)")
    s.add_argument("--max-latency-ms", type=float, help="stop once the planning latency exceeds this")
    s.add_argument("--memory-limit-mb", type=float, help="stop before a batch needing more memory than this")
    s.add_argument("--fill", choices=("interpolate", "step"),
                   help="rows between measured batch sizes (default: interpolate)")
    s.add_argument("--strict", action="store_true", default=None,
                   help="exit 1 when the model failed at some batch size (the profile is still written)")
    s.add_argument("--all-rows", action="store_true", default=None,
                   help="print every batch size, not only measured ones")

    m = p.add_argument_group("multitenant options")
    m.add_argument("--slo-ms", type=float, help="latency SLO of every model (required)")
    m.add_argument("--price-per-hour", type=float,
                   help="device price per hour, for cost per 1M inferences (default: 1.0)")
    m.add_argument("--duration-s", type=float, help="seconds per load step (default: 2)")
    m.add_argument("--fractions", metavar="LIST",
                   help="fixed loads, as fractions of the dedicated peak (default: 0.25,0.5,0.75)")
    m.add_argument("--refine", type=int, help="bisection steps per ramp (default: 3)")
    m.add_argument("--percentile", type=float, help="latency percentile that must meet the SLO (default: 99)")
    m.add_argument("--max-bad-rate", type=float, help="largest dropped+late fraction allowed (default: 0.01)")
    m.add_argument("--profiles", metavar="LIST",
                   help="comma-separated profile JSONs, one per model, instead of profiling")
    p.set_defaults(func=run)


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        if args.output and args.output != "-":
            directory = os.path.dirname(os.path.abspath(args.output))
            if not os.path.isdir(directory):
                raise _UsageError(f"-o {args.output}: directory {directory} does not exist")
        if args.models[0] == MULTITENANT:
            return _run_multitenant(args, args.models[1:])
        return _run_single(args)
    except (ProfilerError, _UsageError) as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        return _error("interrupted")


# ---- helpers ----------------------------------------------------------------------------------------

def _reject(args: argparse.Namespace, names: tuple[str, ...], mode: str) -> None:
    given = [n for n in names if getattr(args, n, None) is not None]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise _UsageError(f"{flags}: not an option of {mode}")


def _opt(args: argparse.Namespace, name: str, default):
    value = getattr(args, name, None)
    return default if value is None else value


def _int_list(text: str, what: str, positive: bool = True) -> list[int]:
    """Comma-separated integers; ``positive`` (batch sizes) refuses any below 1 (CPU ids are checked by
    ``pin_cpus``)."""
    try:
        values = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise _UsageError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values:
        raise _UsageError(f"{what}: empty list")
    bad = [v for v in values if v < 1] if positive else []
    if bad:
        raise _UsageError(f"{what}: batch sizes must be positive, got {', '.join(map(str, bad))}")
    return values


def _float_list(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise _UsageError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def _positive(value, what: str):
    if value is not None and not value > 0:
        raise _UsageError(f"{what}: must be positive, got {value}")
    return value


def _write_atomic(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise _UsageError(f"{path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".profile.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if not text.endswith("\n"):
                f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _plot_path(args: argparse.Namespace) -> str | None:
    if args.no_plot:
        return None
    if args.plot:
        return args.plot
    if args.output and args.output != "-":
        return os.path.splitext(args.output)[0] + ".png"
    return None


def _progress_bar(args: argparse.Namespace, total: int | None, unit: str, desc: str):
    from tqdm import tqdm  # lazy: tqdm costs ~20 ms at start-up (nexus --help imports this module)

    disable = bool(args.quiet) or not sys.stderr.isatty()
    return tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, disable=disable, leave=False, dynamic_ncols=True)


def _setup(args: argparse.Namespace):
    # lazy: it imports importlib.metadata and common.runtimes, ~14 ms at every nexus command's start-up
    from profiler.environment import parse_device, pin_cpus

    device = parse_device(args.device)
    if args.threads is not None and args.threads < 1:
        raise _UsageError(f"--threads: must be >= 1, got {args.threads}")
    if args.cpus:
        pin_cpus(_int_list(args.cpus, "--cpus", positive=False))
    return device, parse_input_shapes(args.input_shape)


def _io_specs(args: argparse.Namespace, count: int) -> list:
    if not args.io:
        return [None] * count
    paths = [x for x in args.io.split(",") if x]
    if len(paths) != count:
        raise _UsageError(f"--io: give one io description per model ({count}), got {len(paths)}")
    specs = []
    for path in paths:
        try:
            with open(path) as f:
                specs.append(parse_io_json(f.read()))
        except OSError as exc:
            raise _UsageError(f"{path}: cannot read io description ({exc.strerror or exc})") from None
        except ModelFileError as exc:
            raise _UsageError(f"{path}: {exc}") from None
    return specs


def _batch_sizes(args: argparse.Namespace):
    if args.batch_sizes is not None and args.max_batch is not None:
        raise _UsageError("give either --batch-sizes or --max-batch, not both")
    if args.batch_sizes is not None:
        return _int_list(args.batch_sizes, "--batch-sizes")
    if args.max_batch in (None, "auto"):
        return "auto"
    try:
        value = int(args.max_batch)
    except ValueError:
        raise _UsageError(f"--max-batch: expected 'auto' or a positive integer, got {args.max_batch!r}") from None
    if value < 1:
        raise _UsageError(f"--max-batch: batch sizes must be positive, got {value}")
    return value


def _measure_options(args: argparse.Namespace, iters: int, budget: float) -> dict:
    iters = _opt(args, "iters", iters)
    warmup = _opt(args, "warmup", 3)
    min_iters = _opt(args, "min_iters", 10)
    if iters < 1 or min_iters < 1 or warmup < 0:
        raise _UsageError("--iters and --min-iters must be >= 1, --warmup >= 0")
    budget = _positive(_opt(args, "time_budget_s", budget), "--time-budget-s")
    return {"iters": iters, "warmup": warmup, "min_iters": min_iters, "time_budget_s": budget}


# ---- nexus profile MODEL ----------------------------------------------------------------------------

def _run_single(args: argparse.Namespace) -> int:
    # lazy: the measuring modules cost ~25-35 ms at start-up (nexus --help imports this module)
    from profiler.auto_batch import DEFAULT_LIMIT, DEFAULT_PATIENCE, BatchPlan
    from profiler.profiling import profile_model  # lazy: as above

    _reject(args, MULTI_ONLY, "'nexus profile MODEL' (they belong to 'nexus profile multitenant')")
    if len(args.models) != 1:
        raise _UsageError(f"expected one MODEL, got {len(args.models)} (to co-locate models: nexus profile "
                          f"multitenant MODEL MODEL...)")
    batch_sizes = _batch_sizes(args)
    limit = _opt(args, "batch_limit", DEFAULT_LIMIT)
    if limit < 1:
        raise _UsageError(f"--batch-limit: batch sizes must be positive, got {limit}")
    measure = _measure_options(args, 100, 2.0)
    min_gain = _opt(args, "min_gain", 1.0)
    if min_gain < 0:
        raise _UsageError(f"--min-gain: must be >= 0, got {min_gain}")
    _positive(args.max_latency_ms, "--max-latency-ms")
    _positive(args.memory_limit_mb, "--memory-limit-mb")
    device, input_shapes = _setup(args)

    if device.startswith("emulated:"):
        raise _UsageError(f"an emulated device ({device}) executes a given profile and cannot be profiled; "
                          f"measure on a real device, or use 'multitenant' with --profiles")
    model = read_model_file(args.models[0], args.runtime)
    (io,) = _io_specs(args, 1)
    plan = BatchPlan.make(batch_sizes, limit=limit)
    bar = _progress_bar(args, len(plan.sizes), "batch", os.path.basename(model.path))

    def progress(batch, measurement, total):
        if measurement is not None:
            bar.set_postfix_str(f"b={batch} mean={measurement.mean_ms:.3g}ms")
        else:
            bar.set_postfix_str(f"b={batch} failed")
        bar.update(1)

    try:
        profile = profile_model(
            model.data, device, model.runtime, batch_sizes, **measure, threads=args.threads, seed=args.seed,
            limit=limit, min_gain=min_gain / 100.0, patience=_opt(args, "patience", DEFAULT_PATIENCE),
            max_latency_ms=args.max_latency_ms, memory_limit_mb=args.memory_limit_mb,
            fill=_opt(args, "fill", "interpolate"), input_shapes=input_shapes, device_type=args.device_type,
            model_name=os.path.basename(model.path), io=io, progress=progress)
    finally:
        bar.close()
    meta = profile.meta
    text = profile.to_json()
    if args.output and args.output != "-":
        _write_atomic(args.output, text)
        print(format_profile_table(profile, bool(args.all_rows)))
        print(f"wrote {args.output}")
    else:
        print(text)
    plot = _plot_path(args)
    if plot:
        plot_profile(profile, plot, title=f"{meta.get('model', '')} on {profile.device_type}")
        if args.output and args.output != "-":
            print(f"wrote {plot}")
    busy = load_warning(profile)
    if busy:
        print(f"{PROG}: warning: {busy}", file=sys.stderr)
    stop = meta.get("stop")
    if stop and stop["kind"] in ("failed", "out_of_memory", "memory_limit"):
        print(f"{PROG}: warning: the profile stops at batch {profile.max_batch}: {stop['reason']}", file=sys.stderr)
        if args.strict:
            return 1
    return 0


# ---- nexus profile multitenant MODEL... ---------------------------------------------------------------

def _run_multitenant(args: argparse.Namespace, paths: list[str]) -> int:
    # lazy: the measuring modules cost ~25-35 ms at start-up (nexus --help imports this module)
    from profiler.multitenant import DEFAULT_FRACTIONS, TenantSpec, measure_multitenant

    _reject(args, SINGLE_ONLY, "'nexus profile multitenant'")
    if len(paths) < 2:
        raise _UsageError(f"multitenant needs at least two MODEL files, got {len(paths)}")
    if args.slo_ms is None:
        raise _UsageError("multitenant needs --slo-ms")
    _positive(args.slo_ms, "--slo-ms")
    price = _positive(_opt(args, "price_per_hour", 1.0), "--price-per-hour")
    duration = _positive(_opt(args, "duration_s", 2.0), "--duration-s")
    fractions = _float_list(args.fractions, "--fractions") if args.fractions else list(DEFAULT_FRACTIONS)
    if not fractions or any(not 0 < f < 1 for f in fractions):
        raise _UsageError(f"--fractions: each must lie strictly between 0 and 1, got {fractions}")
    refine = _opt(args, "refine", 3)
    if refine < 0:
        raise _UsageError(f"--refine: must be >= 0, got {refine}")
    percentile = _opt(args, "percentile", 99.0)
    if not 0 < percentile <= 100:
        raise _UsageError(f"--percentile: must be in (0, 100], got {percentile}")
    max_bad = _opt(args, "max_bad_rate", 0.01)
    if not 0 <= max_bad < 1:
        raise _UsageError(f"--max-bad-rate: must be in [0, 1), got {max_bad}")
    device, input_shapes = _setup(args)

    profile_paths = [x for x in args.profiles.split(",") if x] if args.profiles else []
    emulated = device.startswith("emulated:")
    if emulated and not profile_paths:
        raise _UsageError(f"an emulated device ({device}) executes given profiles: pass --profiles")
    runtime = args.runtime or ("emulated" if emulated else None)
    if profile_paths and len(profile_paths) != len(paths):
        raise _UsageError(f"--profiles: give one profile per model ({len(paths)}), got {len(profile_paths)}")
    ios = _io_specs(args, len(paths))
    tenants, seen = [], {}
    for i, path in enumerate(paths):
        model = read_model_file(path, runtime)
        name = model.name
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
        profile = None
        if profile_paths:
            try:
                with open(profile_paths[i]) as f:
                    profile = Profile.from_json(f.read(), where=profile_paths[i])
            except OSError as exc:
                raise _UsageError(f"{profile_paths[i]}: cannot read profile ({exc.strerror or exc})") from None
            except ProfileError as exc:
                raise _UsageError(str(exc)) from None
        tenants.append(TenantSpec(name, model.data, model.runtime, profile, path, ios[i]))

    profile_options = {"batch_sizes": _batch_sizes(args), **_measure_options(args, 30, 0.5)}
    if input_shapes:
        profile_options["input_shapes"] = input_shapes
    bar = _progress_bar(args, None, "step", "multitenant")

    def progress(message: str) -> None:
        bar.set_postfix_str(message[:70])
        bar.update(1)

    try:
        report = measure_multitenant(
            tenants, device, args.slo_ms, price_per_hour=price, fractions=fractions, duration_s=duration,
            refine=refine, threads=args.threads, seed=args.seed, percentile=percentile, max_bad_rate=max_bad,
            device_type=args.device_type,
            profile_options=profile_options, progress=progress)
    finally:
        bar.close()
    print(format_multitenant_table(report), file=sys.stderr if args.output == "-" else sys.stdout)
    if args.output and args.output != "-":
        _write_atomic(args.output, json.dumps(report, indent=2, sort_keys=True))
        print(f"wrote {args.output}")
    elif args.output == "-":
        print(json.dumps(report, indent=2, sort_keys=True))
    plot = _plot_path(args)
    if plot:
        plot_frontier(report, plot)
        print(f"wrote {plot}")
    return 0
