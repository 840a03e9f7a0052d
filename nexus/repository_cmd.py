"""``nexus models import DIR`` and ``nexus serve --model-repository DIR``: Triton model repositories.

The whole repository is read and checked first (:mod:`nexus.model_repository`), so a bad model
uploads nothing; then every version its policy selects is uploaded to the scheduler as that version,
with the policy (a version whose file, warm-up and policy the scheduler already holds is left as it is).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile

from common import grpc_util
from common.late_requests import LateRequests
from nexus.model_repository import RepositoryError, RepositoryModel, describe, read_repository
from common.security import Credentials
from common.version_policy import DEFAULT_POLICY, from_pb as policy_from_pb, version_key
from common.warmup_spec import from_pb as warmup_from_pb
from nexus.client_flags import ClientFlagError, add_client_security, client_credentials
from nexus.scheduler_client import DEFAULT_SCHEDULER, AdminCallError, list_models, upload_model


def read_checked(root: str, prog: str) -> list[RepositoryModel] | None:
    """Read the repository, printing its warnings; None (after printing the error) when it cannot be served."""
    try:
        models = read_repository(root)
    except RepositoryError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return None
    for m in models:
        for w in m.warnings:
            print(f"{prog}: warning: {w}", file=sys.stderr, flush=True)
    return models


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def upload_repository(scheduler: str, models: list[RepositoryModel], *, load: bool = True,
                      creds: Credentials = grpc_util.NO_CREDENTIALS) -> list[str]:
    """Upload every model version (skipping one the scheduler holds with the same bytes, warm-up,
    version policy, expected rate, batch cap and late requests); return the version keys uploaded.
    ``max_batch_size`` is the model's batch cap."""
    stored = {version_key(m.name, m.version or 1):
              (m.sha256, warmup_from_pb(m.warmup),
               policy_from_pb(m.version_policy) if m.HasField("version_policy") else DEFAULT_POLICY,
               m.expected_rate_rps, m.batch_cap, LateRequests.from_pb(m.late_requests))
              for m in list_models(scheduler, creds)}
    uploaded = []
    for m in models:
        key = version_key(m.name, m.version)
        held = stored.get(key)
        late = m.late_requests or (held[-1] if held else LateRequests.DROP)     # not stated: the model's stays
        if held == (_sha256(m.path), m.warmup, m.version_policy, m.expected_rate_rps, m.max_batch_size, late):
            continue
        with tempfile.NamedTemporaryFile("w", suffix=".json") as io_file:
            io_path = None
            if m.runtime == "torch":     # TorchScript carries no description: the config's is the one
                io_file.write(m.io_json)
                io_file.flush()
                io_path = io_file.name
            upload_model(scheduler, m.path, m.name, slo_ms=m.slo_ms, runtime=m.runtime, io_path=io_path, load=load,
                         warmup=m.warmup, version=m.version, version_policy=m.version_policy,
                         expected_rate_rps=m.expected_rate_rps, batch_cap=m.max_batch_size, creds=creds,
                         late_requests=m.late_requests)
        uploaded.append(key)
    return uploaded


def _run_import(args) -> int:
    prog = "nexus models import"
    models = read_checked(args.dir, prog)
    if models is None:
        return 2
    if args.dry_run:
        print(json.dumps([describe(m) for m in models], indent=2))
        return 0
    try:
        uploaded = upload_repository(args.scheduler, models, load=not args.no_load, creds=client_credentials(args))
    except (AdminCallError, ClientFlagError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    for m in models:
        state = "uploaded" if version_key(m.name, m.version) in uploaded else "unchanged"
        slo = f"SLO {m.slo_ms:g} ms" if m.slo_ms else "default SLO"
        print(f"{m.name}: version {m.version}, {m.runtime}, {slo}: {state}")
    return 0


def add_import_parser(msub) -> None:
    p = msub.add_parser("import", help="upload every model of a Triton model repository",
                        description="Read a Triton model repository (<name>/config.pbtxt, <name>/<version>/model.onnx "
                                    "or model.pt), check each config against its model file, and upload the models.")
    p.add_argument("dir", help="the repository folder")
    p.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    p.add_argument("--no-load", action="store_true", help="store only; do not start serving them")
    p.add_argument("--dry-run", action="store_true", help="check the repository and print what would be uploaded")
    add_client_security(p)
    p.set_defaults(func=_run_import)
