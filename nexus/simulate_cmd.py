"""``nexus simulate``: the whole cluster on a virtual clock, running the scheduler's own decision code.

    nexus simulate --models MODELS.json --device-type t4 --backends auto --max-backends N
                   (--trace TRACE.csv | --arrivals poisson|gamma --cv C --schedule "SECONDS:RPS,...")
                   --seed S --json OUT.json [--plot OUT.png]

``nexus serve``'s scheduler flags (``--scale-down-cooldown-s``, ``--epoch-s``, ``--burst-sigma``, ...)
apply unchanged; ``--backends``, ``--min-backends`` and ``--max-backends`` mean what they mean to
``nexus serve``. ``--size-for 0.999`` answers "how many devices does this workload need": it finds
the fewest fixed devices that keep that fraction within SLO, then runs the scaling policy on the same
arrivals and prints what the policy's reaction (its cool-down included) costs against it.
"""

from __future__ import annotations

import argparse
import sys
import time

from common.config import ConfigError, SchedulerConfig, add_arguments, from_args
from common.emulated_gpus import GPU_TYPES
from nexus.simulate.config import TIME_PARAMETERS, DeviceTime, Fault, SimConfig
from nexus.simulate.plot import plot
from nexus.simulate.workload import (WorkloadError, diurnal_schedule, load_trace, parse_schedule, scheduled_arrivals,
                                     synthetic_azure, zipf_shares)

SCHEDULER_SKIP = ("listen", "data_dir", "max_upload_mb", "colocation_report", "metrics_listen", "min_devices",
                  "max_devices", "measured_profiles", "profile_update_s", "security")
DEFAULT_TAIL_S = 60.0          # a schedule's duration when none is given: this long past its last point


def _backends(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of backends or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1 backend or 'auto', got {value}")
    return value


def register(sub) -> None:
    defaults = SimConfig()
    p = sub.add_parser("simulate", help="simulate a cluster on a virtual clock with the scheduler's own code",
                       description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("models and arrivals")
    src.add_argument("--models", default="", metavar="MODELS.json",
                     help='{"name": {"slo_ms": 200, "share": 0.1, "profile": [{"batch": 1, "latency_ms": 9.0, '
                          '"memory_mb": 300}, ...]}}')
    src.add_argument("--model-repository", default="", metavar="DIR",
                     help="the models of a Triton model repository instead (SLO and expected rate from config.pbtxt, "
                          "profiles from the emulated --device-type's datasheet)")
    src.add_argument("--model-database", default="", metavar="DATA_DIR",
                     help="the models a scheduler serves, from its --data-dir (read-only: a running scheduler's "
                          "may be read): SLOs, replicas, expected rates and the profiles it plans with")
    src.add_argument("--trace", default="", metavar="TRACE.csv",
                     help="arrivals from a file: CSV with a time_s,model header, or JSON lines")
    src.add_argument("--arrivals", choices=("poisson", "gamma", "azure"), default="poisson",
                     help="generated arrivals: a renewal process per model (poisson, or gamma with --cv), or "
                          "Azure-Functions-like per-minute bursts around --schedule's first rate (azure)")
    src.add_argument("--cv", type=float, default=1.0, help="gamma: coefficient of variation of the gaps (default 1)")
    src.add_argument("--schedule", default="", metavar="SECONDS:RPS,...",
                     help='total rate over time: "0:60,120:300,240:60" (steps); "T~R" ramps to R by T')
    src.add_argument("--diurnal", default="", metavar="LOW:HIGH:PERIOD_S",
                     help="a sinusoidal day instead of --schedule")
    src.add_argument("--duration-s", type=float, default=None,
                     help=f"seconds of arrivals (default: the schedule's last point plus {DEFAULT_TAIL_S:g} s)")
    src.add_argument("--zipf", type=float, default=None, metavar="S",
                     help="popularity by Zipf's law of exponent S over the models in file order, instead of shares")
    src.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("the cluster")
    c.add_argument("--device-type", default=defaults.device_type,
                   help="device type of every backend (an emulated GPU name gives its memory)")
    c.add_argument("--memory-mb", type=float, default=None, help="memory of each device (default: the datasheet's)")
    c.add_argument("--backends", type=_backends, default=None,
                   help="a fixed number of backends, or auto (default): as many as the scaling policy wants")
    c.add_argument("--min-backends", type=int, default=defaults.min_backends)
    c.add_argument("--max-backends", type=int, default=defaults.max_backends)
    c.add_argument("--frontends", type=int, default=defaults.frontends)
    c.add_argument("--fault", action="append", default=[], metavar="KIND:SECONDS:AMOUNT",
                   help="kill:T:K kills the K backends carrying the most load at T s; stall:T:S stalls the "
                        "scheduler for S s at T s (repeatable)")
    t = p.add_argument_group("times of the real processes (defaults measured on nexus serve; see "
                             "nexus/simulate/config.py)")
    for name in (*TIME_PARAMETERS, "report_interval_s"):
        t.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name),
                       help=f"(default {getattr(defaults, name):g})")
    t.add_argument("--batch-policy", default=defaults.batch_policy, choices=("early_drop", "earliest_first"))
    t.add_argument("--device-time", default=defaults.device_time.value, choices=[d.value for d in DeviceTime],
                   help="a batch takes the profile's l(b) with --jitter-cv (profile, as an emulated GPU), or the "
                        "profile rows' measured mean and spread (measured: mean_ms, std_ms)")
    o = p.add_argument_group("output")
    o.add_argument("--json", default="", metavar="OUT.json", help="the results (same inputs, same bytes)")
    o.add_argument("--plot", default="", metavar="OUT.png", help="devices, demand and the bound; attainment per second")
    o.add_argument("--size-for", type=float, default=None, metavar="FRACTION",
                   help="find the fewest fixed devices that keep FRACTION (e.g. 0.999) within SLO, and what the "
                        "scaling policy costs against them")
    add_arguments(p.add_argument_group("scheduler (as `nexus scheduler`)"), SchedulerConfig, skip=SCHEDULER_SKIP)
    p.set_defaults(func=run)


def _arrivals(args, models):
    from nexus.simulate.models import shares  # lazy: it imports the model database, ~7 ms at nexus --help

    names = [m.name for m in models]
    if args.trace:
        if args.schedule or args.diurnal:
            raise ConfigError("--trace gives the arrivals: leave out --schedule and --diurnal")
        return load_trace(args.trace, names), []
    if bool(args.schedule) == bool(args.diurnal):
        raise ConfigError("give the arrivals: --trace FILE, or --schedule SECONDS:RPS,... or --diurnal LOW:HIGH:PERIOD_S")
    if args.diurnal:
        try:
            low, high, period = (float(x) for x in args.diurnal.split(":"))
        except ValueError:
            raise ConfigError(f"--diurnal {args.diurnal!r}: expected LOW:HIGH:PERIOD_S, e.g. 20:200:600") from None
        duration = args.duration_s or period
        schedule = diurnal_schedule(duration, low, high, period)
    else:
        schedule = parse_schedule(args.schedule)
        duration = args.duration_s if args.duration_s is not None else schedule.end_s + DEFAULT_TAIL_S
    if not duration > 0:
        raise ConfigError(f"--duration-s: must be positive, got {duration}")
    steps = [(t, prev[1], r) for prev, (t, r, ramp) in zip(schedule.points, schedule.points[1:])
             if not ramp and t < duration] if not args.diurnal else []
    popularity = zipf_shares(names, args.zipf) if args.zipf is not None else shares(models)
    if args.arrivals == "azure":
        return synthetic_azure(names, duration, schedule.points[0][1], seed=args.seed), []
    cv = 1.0 if args.arrivals == "poisson" else args.cv
    if args.arrivals == "poisson" and args.cv != 1.0:
        raise ConfigError("--cv applies to --arrivals gamma (poisson is cv 1)")
    return scheduled_arrivals(schedule, popularity, duration, cv=cv, seed=args.seed), steps


def configs(args):
    memory = args.memory_mb
    if memory is None:
        gpu = GPU_TYPES.get(args.device_type)
        memory = gpu.memory_mb if gpu is not None else 0.0
    scheduler = from_args(SchedulerConfig, args)      # auto's bounds: SimConfig.as_served
    config = SimConfig(device_type=args.device_type, memory_mb=memory, backends=args.backends,
                       min_backends=args.min_backends, max_backends=args.max_backends, frontends=args.frontends,
                       **{name: getattr(args, name) for name in TIME_PARAMETERS},
                       report_interval_s=args.report_interval_s, batch_policy=args.batch_policy, seed=args.seed,
                       device_time=DeviceTime(args.device_time),
                       faults=tuple(Fault.parse(f) for f in args.fault), scheduler=scheduler)
    config.validate()
    return config


def inputs_of(args) -> dict:
    """The command's inputs, for the JSON (a result says what produced it)."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "json", "plot", "command")
            and isinstance(v, (str, int, float, bool, list, type(None)))}


def simulate(models, arrivals, config, steps=(), inputs=None) -> dict:
    # lazy: the simulator imports the scheduler, backend and frontend code, ~90 ms at nexus --help
    from nexus.simulate.report import summarize
    from nexus.simulate.run import Simulation  # lazy: as above

    sim = Simulation(models, arrivals, config)
    sim.run()
    return summarize(sim, steps, inputs)


def run(args) -> int:
    # lazy: the model database and the simulator cost ~7 and ~90 ms at nexus --help
    from nexus.simulate.models import ModelsError, database_models, load_models, repository_models
    from nexus.simulate.report import dumps, text  # lazy: as above

    try:
        if sum(map(bool, (args.models, args.model_repository, args.model_database))) != 1:
            raise ConfigError("give the models one way: --models MODELS.json, --model-repository DIR or "
                              "--model-database DATA_DIR")
        config = configs(args)
        if args.models:
            models = load_models(args.models)
        elif args.model_repository:
            models = repository_models(args.model_repository, args.device_type, config.scheduler.default_slo_ms)
        else:
            models = database_models(args.model_database, args.device_type)
        arrivals, steps = _arrivals(args, models)
    except (ModelsError, WorkloadError, ConfigError, ValueError) as exc:
        print(f"nexus simulate: error: {exc}", file=sys.stderr)
        return 2
    print(f"nexus simulate: {arrivals.count():,} requests to {len(arrivals.names)} models over "
          f"{arrivals.duration_s:g} s", file=sys.stderr)
    if args.size_for is not None:
        from nexus.simulate.sizing import size_for  # lazy: it imports the simulator, ~90 ms at nexus --help

        if not 0 < args.size_for < 1:
            print(f"nexus simulate: error: --size-for must be a fraction in (0, 1), got {args.size_for}",
                  file=sys.stderr)
            return 2
        answer = size_for(models, arrivals, config, args.size_for, steps)
        print(answer.text(), end="")
        if args.json:
            with open(args.json, "w") as f:
                f.write(dumps(answer.to_json_obj()))
        return 0
    started = time.process_time()
    try:
        result = simulate(models, arrivals, config, steps, inputs_of(args))
    except ValueError as exc:
        print(f"nexus simulate: error: {exc}", file=sys.stderr)
        return 2
    cpu_s = time.process_time() - started
    print(text(result), end="")
    print(f"simulated {arrivals.duration_s:g} s in {cpu_s:.1f} CPU-seconds", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            f.write(dumps(result))
    if args.plot:
        plot(result, args.plot)
    return 0
