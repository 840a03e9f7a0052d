"""``nexus models upload FILE --name NAME [--version N] [--profile P.json] [--slo-ms S]
[--expected-rate-rps R]`` and ``nexus models list``.

An upload without ``--version`` adds the next version after the newest (1 for a new model); with it,
that version (a stored one is replaced). Which versions are served is the model's version policy
(Triton's ``version_policy``; by default the latest one), so uploading a new version of a served
model updates it: the new version is loaded and warmed up before traffic moves to it, then the old
one is unloaded (globalsched/planning/version_rollout.py). ``nexus models list`` shows every stored version.

An upload that loads the model waits until it is ready to serve (globalsched/state/readiness.py: routed to
backends that hold it), and prints how long that took; it fails (exit 1) with the reason when no
registered device type can serve it, or when ``--wait-timeout-s`` passes first. ``--no-wait``
returns once the file is stored, as ``--no-load`` does.
"""

from __future__ import annotations

import argparse
import json
import sys

from common.cli_types import non_negative_seconds
from common.late_requests import LateRequests
from common.pb import control
from common.version_policy import DEFAULT_POLICY, VersionError, from_pb as policy_from_pb
from common.warmup_spec import describe as describe_warmup, from_pb as warmup_from_pb
from nexus.client_flags import ClientFlagError, add_client_security, client_credentials
from nexus.repository_cmd import add_import_parser
from nexus.scheduler_client import DEFAULT_SCHEDULER, AdminCallError, list_models, upload_model, wait_model_ready


def _policy(m: control.ModelDesc) -> str:
    try:
        return (policy_from_pb(m.version_policy) if m.HasField("version_policy") else DEFAULT_POLICY).describe()
    except VersionError as exc:
        return f"invalid: {exc}"


_STATE_WORDS = {control.PROFILED: "profiled", control.NOT_PROFILED: "not profiled yet",
                control.PROFILING: "profiling", control.NEEDS_PROFILE: "needs a profile",
                control.CANNOT_LOAD: "cannot load", control.PREDICTED: "predicted"}


def _device_types(m: control.ModelDesc) -> list[dict]:
    return [{"device_type": d.device_type, "state": _STATE_WORDS.get(d.state, "unknown"), "reason": d.reason,
             "backends": d.backends} for d in m.device_types]


def _servable_column(m: control.ModelDesc) -> str:
    """Per device type with backends registered, whether the model can be served there."""
    return ", ".join(f"{d.device_type}: {_STATE_WORDS.get(d.state, 'unknown')}" for d in m.device_types
                     if d.backends) or "-"


_SERVING_WORDS = {control.STORED: "stored", control.LOADING: "loading", control.READY: "ready",
                  control.FAILED: "failed", control.COLD: "cold"}


def _state_column(m: control.ModelDesc) -> str:
    """Its serving state; a failed one with why (the reason of a loading one is in --json)."""
    word = _SERVING_WORDS.get(m.serving_state, "unknown")
    return f"failed: {m.state_reason}" if m.serving_state == control.FAILED else word


def _describe(m: control.ModelDesc) -> dict:
    return {"name": m.name, "version": m.version or 1, "version_policy": _policy(m), "sha256": m.sha256,
            "runtime": m.runtime, "size_bytes": m.size_bytes,
            "state": _SERVING_WORDS.get(m.serving_state, "unknown"), "state_reason": m.state_reason,
            "ready_after_s": round(m.ready_after_s, 3) if m.serving_state == control.READY and m.ready_after_s else None,
            "ready_stages": {st.stage: round(st.after_s, 3) for st in m.ready_stages},
            "slo_ms": m.default_slo_ms, "loaded": m.loaded, "profiles": list(m.profiled_device_types),
            "device_types": _device_types(m), "batch_cap": m.batch_cap, "expected_rate_rps": m.expected_rate_rps,
            "min_replicas": m.min_replicas, "late_requests": LateRequests.from_pb(m.late_requests).value,
            "prefix_group": m.prefix_group,
            "warmup": describe_warmup(warmup_from_pb(m.warmup)),
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in m.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": [-1, *t.shape]} for t in m.outputs]}


def _run_upload(args) -> int:
    try:
        model = upload_model(args.scheduler, args.file, args.name, profile_path=args.profile, slo_ms=args.slo_ms,
                             runtime=args.runtime, io_path=args.io, load=not args.no_load,
                             min_replicas=args.min_replicas, version=args.version,
                             expected_rate_rps=args.expected_rate_rps, creds=client_credentials(args),
                             pin_profile=args.pin_profile,
                             late_requests=LateRequests(args.late_requests) if args.late_requests else None)
    except (AdminCallError, ClientFlagError) as exc:
        print(f"nexus models upload: error: {exc}", file=sys.stderr)
        return 2
    print(f"uploaded {model.name} version {model.version or 1} ({model.size_bytes} bytes, sha256 {model.sha256[:12]}, "
          f"runtime {model.runtime})", flush=True)
    if args.no_load or args.no_wait:
        return 0
    try:
        model = wait_model_ready(args.scheduler, model.name, model.version, args.wait_timeout_s, client_credentials(args))
    except (AdminCallError, ClientFlagError) as exc:
        print(f"nexus models upload: error: while waiting for it to be ready: {exc}", file=sys.stderr)
        return 2
    if model.serving_state == control.READY:
        stages = ", ".join(f"{st.stage} {st.after_s:.2f}" for st in model.ready_stages)
        print(f"{model.name} version {model.version or 1} is ready: {model.ready_after_s:.2f} s after its upload"
              + (f" (s after it, each stage first reached: {stages})" if stages else ""))
        return 0
    if model.serving_state == control.COLD:
        print(f"{model.name} version {model.version or 1} is loaded and cold: {model.state_reason.removeprefix('cold: ')}")
        return 0
    if model.serving_state == control.LOADING and not any(d.backends for d in model.device_types):
        print(f"nexus models upload: warning: {model.name} version {model.version or 1} is not served yet: "
              f"{model.state_reason}; it is placed when one registers", file=sys.stderr)
        return 0
    if model.serving_state == control.FAILED:
        print(f"nexus models upload: error: {model.name} version {model.version or 1} cannot be served: "
              f"{model.state_reason}", file=sys.stderr)
    else:
        print(f"nexus models upload: error: {model.name} version {model.version or 1} is not ready after "
              f"{args.wait_timeout_s:g} s: {model.state_reason} (it stays loaded; see nexus models list)",
              file=sys.stderr)
    return 1


def _run_list(args) -> int:
    try:
        models = list_models(args.scheduler, client_credentials(args))
    except (AdminCallError, ClientFlagError) as exc:
        print(f"nexus models list: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([_describe(m) for m in models], indent=2))
        return 0
    rows = [("NAME", "VERSION", "RUNTIME", "SIZE", "SLO_MS", "STATE", "PROFILES", "ON REGISTERED DEVICE TYPES",
             "PREFIX")]
    for m in models:
        rows.append((m.name, str(m.version or 1), m.runtime, f"{m.size_bytes / 1e6:.1f}MB", f"{m.default_slo_ms:g}",
                     _state_column(m), ",".join(m.profiled_device_types) or "-", _servable_column(m),
                     m.prefix_group[:12] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _positive_version(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def register(sub) -> None:
    p = sub.add_parser("models", help="upload and list models in the model database")
    msub = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    up = msub.add_parser("upload", help="upload a model file (ONNX, or TorchScript with --io)")
    up.add_argument("file")
    up.add_argument("--name", required=True)
    up.add_argument("--version", type=_positive_version, default=0, metavar="N",
                    help="the version this file is, a positive integer (default: the next after the newest, "
                         "1 for a new model); a stored version is replaced")
    up.add_argument("--profile", help="profile JSON (common/profile.py format, with device_type): where planning "
                                      "starts; serving measurements replace it once enough samples count")
    up.add_argument("--pin-profile", action="store_true",
                    help="plan with --profile always, whatever serving measures (measurements are still shown)")
    up.add_argument("--slo-ms", type=float, default=0.0, help="SLO of the model's session (default: scheduler's)")
    up.add_argument("--runtime", default="", choices=["", "onnxruntime", "torch"], help="default: from the file suffix")
    up.add_argument("--io", help="JSON with inputs/outputs (required for torch models)")
    up.add_argument("--no-load", action="store_true", help="store only; do not start serving it")
    up.add_argument("--no-wait", action="store_true",
                    help="return once it is stored, without waiting until it is ready to serve (by default the "
                         "command waits, prints how long that took, and fails with the reason when it cannot be "
                         "served)")
    up.add_argument("--wait-timeout-s", type=non_negative_seconds, default=120.0, metavar="S",
                    help="how long to wait for it to be ready (default 120)")
    up.add_argument("--min-replicas", type=int, default=0,
                    help="backends its session keeps at least, so losing one needs no re-plan "
                         "(default 0: the scheduler's --min-replicas)")
    up.add_argument("--expected-rate-rps", type=float, default=0.0, metavar="R",
                    help="plan for R requests/s from the start, until a rate is measured: a model that takes "
                         "traffic at once gets its capacity at once (default 0: the scheduler's --default-rate-rps)")
    up.add_argument("--late-requests", choices=[x.value for x in LateRequests], default=None,
                    help="a request that can no longer meet its SLO: drop it early, answering DEADLINE_EXCEEDED "
                         "(a new model's default), or serve it late, as Triton does, failing only at the client's "
                         "own deadline (default: the model's setting stays)")
    up.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    add_client_security(up)
    up.set_defaults(func=_run_upload)
    ls = msub.add_parser("list", help="list the models the scheduler knows")
    ls.add_argument("--scheduler", default=DEFAULT_SCHEDULER)
    add_client_security(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=_run_list)
    add_import_parser(msub)
