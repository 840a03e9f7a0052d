"""A new backend's first model table: from the push to the answer, for a table of several models.

    python -m benchmarks.table_loads [--models 8] [--batch 16] [--fetch-ms 20] [--repeats 5] [--before DIR]

A backend that joins at a load step is given several models at once, and the plan's capacity on it
waits for its answer: every model fetched from the scheduler, loaded, and warmed up at its planned
batch (backend/model_table.py). This times ``UpdateModelTable`` on a fresh ``BackendService`` in this
process, with no scheduler: the fetch is an awaited ``--fetch-ms`` (a model's download), the device is
an emulated T4 whose batches take the table's l(b) = 2 b + 5 ms (a warm-up at batch 16 takes 37 ms),
and the models are distinct small MLPs (their runtimes are created from the ONNX bytes). With
``--before DIR`` (a ``git archive`` of another commit), the same measurement runs on that tree's
backend too, in child processes that alternate with this tree's, and the table gives both.

Nothing here asserts a time; benchmarks/README.md keeps the runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from harness.smoke import add_smoke, parse_args

REPO = pathlib.Path(__file__).resolve().parents[1]
ALPHA_MS, BETA_MS = 2.0, 5.0        # the emulated device's l(b) = ALPHA b + BETA


def measure(models: int, batch: int, fetch_ms: float) -> float:
    """Seconds from the push of a table of ``models`` models at planned batch ``batch`` to the answer of
    a new backend (imports from the tree on ``sys.path``: this one, or ``--before``'s)."""
    from backend.engine import Engine
    from backend.server import BackendService
    from common.batch_decision import SlidingWindowEarlyDrop
    from common.config import BackendConfig
    from common.pb import control
    from common.profile import Profile
    from common.sample_models import mlp_small, model_bytes
    from globalsched.rpc.convert import model_desc
    from globalsched.state.modeldb import ModelDatabase

    profile = Profile.linear(ALPHA_MS, BETA_MS, 64).to_json()
    data, entries = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        db = ModelDatabase(tmp)
        for i in range(models):
            blob = model_bytes(mlp_small(hidden=16 + 8 * i))
            db.add_model(f"m{i}", [blob])
            desc = model_desc(db.model(f"m{i}"), {}, True)
            data[desc.sha256] = blob
            entries.append(control.SessionEntry(model=desc, slo_ms=200.0, batch=batch, profile_json=profile))
        db.close()

    async def run() -> float:
        service = BackendService(BackendConfig(device="emulated:t4"), Engine(SlidingWindowEarlyDrop()))

        async def fetch(sha256: str) -> bytes:
            await asyncio.sleep(fetch_ms / 1000.0)
            return data[sha256]

        service.tables._fetch = fetch
        try:
            start = time.perf_counter()
            reply = await service.UpdateModelTable(control.ModelTable(epoch=1, sessions=entries), None)
            took = time.perf_counter() - start
        finally:
            service.engine.stop()
        if reply.failed or len(reply.loaded) != models:
            raise SystemExit(f"the table did not load: {list(reply.failed)}")
        return took

    return asyncio.run(run())


def child(tree: pathlib.Path, args: argparse.Namespace) -> float:
    """One measurement in a process of its own, importing the backend from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", "--models", str(args.models),
               "--batch", str(args.batch), "--fetch-ms", str(args.fetch_ms)]
    out = subprocess.run(command, env=env, cwd=tree, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["seconds"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="the sessions' planned batch (the warm-up's)")
    p.add_argument("--fetch-ms", type=float, default=20.0, help="each model's download from the scheduler")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--before", help="a tree of another commit (git archive) to measure beside this one")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    add_smoke(p, models=2, batch=2, repeats=1)
    argv = list(sys.argv[1:] if argv is None else argv)
    # a child prints only its measurement; the run's provenance is the parent's
    args = p.parse_args(argv) if "--child" in argv else parse_args(p, argv)
    if args.models < 1 or args.batch < 1 or args.fetch_ms < 0 or args.repeats < 1:
        p.error("--models, --batch and --repeats must be at least 1, and --fetch-ms at least 0")
    if args.child:
        print(json.dumps({"seconds": measure(args.models, args.batch, args.fetch_ms)}))
        return 0
    trees = {"this tree": REPO}
    if args.before:
        before = pathlib.Path(args.before).resolve()
        if not (before / "backend" / "model_table.py").is_file():
            p.error(f"--before {args.before}: no backend/model_table.py there")
        trees["--before"] = before
    times: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(args.repeats):
        for name in (list(trees) if i % 2 == 0 else list(reversed(trees))):
            times[name].append(child(trees[name], args))
    warm_ms = ALPHA_MS * args.batch + BETA_MS
    print(f"{args.models} models, planned batch {args.batch} (warm-up {warm_ms:.0f} ms each), fetch "
          f"{args.fetch_ms:.0f} ms each; load average {os.getloadavg()[0]:.2f}")
    print("| tree | push to answer, median (range) ms |\n| --- | ---: |")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1000:.0f} ({min(ts) * 1000:.0f}-{max(ts) * 1000:.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
