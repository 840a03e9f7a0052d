"""The models a simulation serves: a JSON file of profiles, SLOs and shares, or generated ones.

MODELS.json (the ``nexus simulate`` contract)::

    {"name": {"slo_ms": 200, "share": 0.1,
              "profile": [{"batch": 1, "latency_ms": 9.0, "memory_mb": 300}, ...]}}

``profile`` is a profile as ``nexus models upload --profile`` takes it (common/profile.py: the
latency already conservative, as the planner plans with it); ``share`` is the model's part of the
scheduled total rate (normalised over the file; a trace file gives arrivals per model instead and
shares are then unused, so they may be left out). Optional: ``min_replicas`` and ``expected_rate_rps``,
as ``nexus models upload`` takes them. Unknown keys, missing fields and bad values are
:class:`ModelsError` naming the model and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from common.emulated_gpus import NoDatasheet, UnknownGpuError, datasheet_profile
from nexus.model_repository import RepositoryError, read_repository
from common.profile import Profile, ProfileError
from globalsched.state.modeldb import ModelDatabase

KEYS = {"slo_ms", "share", "profile", "min_replicas", "expected_rate_rps"}


class ModelsError(ValueError):
    """A models file that cannot be simulated; the message names the file, the model and the field."""


@dataclass(frozen=True)
class SimModel:
    name: str
    slo_ms: float
    share: float                 # of the scheduled total rate (0 when arrivals come from a trace)
    profile: Profile             # on the simulated device type
    min_replicas: int = 0        # 0: the scheduler's default
    expected_rate_rps: float = 0.0   # planned for before its traffic is measured, as `nexus models upload --expected-rate-rps`


def parse_models(obj: object, where: str = "models") -> tuple[SimModel, ...]:
    """Models from the decoded JSON object (see the module docstring), in the file's order."""
    if not isinstance(obj, dict) or not obj:
        raise ModelsError(f"{where}: expected an object of models by name, got {type(obj).__name__}"
                          + (" (empty)" if isinstance(obj, dict) else ""))
    out = []
    for name, spec in obj.items():
        at = f"{where}: model {name!r}"
        if not isinstance(spec, dict):
            raise ModelsError(f"{at}: expected an object with slo_ms, share and profile")
        unknown = set(spec) - KEYS
        if unknown:
            raise ModelsError(f"{at}: unknown key(s) {sorted(unknown)} (known: {sorted(KEYS)})")
        for key in ("slo_ms", "profile"):
            if key not in spec:
                raise ModelsError(f"{at}: missing field {key!r}")
        slo_ms, share = spec["slo_ms"], spec.get("share", 0.0)
        for key, value in (("slo_ms", slo_ms), ("share", share)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ModelsError(f"{at}: {key} must be a number, got {value!r}")
        if slo_ms <= 0:
            raise ModelsError(f"{at}: slo_ms must be positive, got {slo_ms}")
        if share < 0:
            raise ModelsError(f"{at}: share must not be negative, got {share}")
        replicas = spec.get("min_replicas", 0)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ModelsError(f"{at}: min_replicas must be an integer >= 0, got {replicas!r}")
        expected = spec.get("expected_rate_rps", 0.0)
        if isinstance(expected, bool) or not isinstance(expected, (int, float)) or not (math.isfinite(expected)
                                                                                         and expected >= 0):
            raise ModelsError(f"{at}: expected_rate_rps must be a number >= 0, got {expected!r}")
        try:
            profile = Profile.from_json_obj(spec["profile"], where=f"{at}.profile")
            profile.validate(where=f"{at}.profile")
        except ProfileError as exc:
            raise ModelsError(str(exc)) from None
        out.append(SimModel(str(name), float(slo_ms), float(share), profile, replicas, float(expected)))
    return tuple(out)


def load_models(path: str | Path) -> tuple[SimModel, ...]:
    """Models from a MODELS.json file (module docstring)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ModelsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelsError(f"{path}: not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    return parse_models(obj, str(path))


def repository_models(root: str | Path, device_type: str, default_slo_ms: float) -> tuple[SimModel, ...]:
    """The models of a Triton model repository (nexus/model_repository.py), newest version of each:
    its SLO (``slo_ms`` parameter, else ``default_slo_ms``), its expected rate (``expected_rate_rps``,
    also its share; 1 where none is given), its batch cap, and the profile an emulated ``device_type``
    gives it (common/emulated_gpus.py: the sample models' classes; another model needs a models file
    with its profile, as ``nexus serve`` needs ``--profile`` for it)."""
    try:
        found = read_repository(root)
    except RepositoryError as exc:
        raise ModelsError(str(exc)) from None
    newest = {}
    for m in found:
        if m.name not in newest or m.version > newest[m.name].version:
            newest[m.name] = m
    out = []
    for name, m in sorted(newest.items()):
        try:
            profile = datasheet_profile(m.path.read_bytes(), device_type).capped(m.max_batch_size)
        except (NoDatasheet, UnknownGpuError) as exc:
            raise ModelsError(f"{root}: model {name!r}: no profile on {device_type!r}: {exc}") from None
        rate = m.expected_rate_rps
        out.append(SimModel(name, m.slo_ms or default_slo_ms, rate or 1.0, profile, expected_rate_rps=rate))
    return tuple(out)


def database_models(data_dir: str | Path, device_type: str) -> tuple[SimModel, ...]:
    """The models a scheduler serves, from its model database (``--data-dir``; read-only, so a running
    scheduler's may be read): every loaded model's newest version, its SLO, minimum replicas, expected
    rate (also its share; 1 where none is set) and batch cap, and its profile on ``device_type``: the
    uploaded table, else the one measured while serving, else the emulated device's datasheet for a
    sample model."""
    try:
        db = ModelDatabase(Path(data_dir), read_only=True)
    except (FileNotFoundError, RuntimeError) as exc:
        raise ModelsError(str(exc)) from None
    try:
        measured = {(key, t): p for key, t, _, p, _, _ in db.measured_profiles()}
        out = []
        for session in sorted(db.sessions(), key=lambda s: s.model):
            record = db.newest(session.model)
            if record is None:
                continue
            profile = db.profiles(record.key).get(device_type) or measured.get((record.key, device_type))
            if profile is None:
                try:
                    profile = datasheet_profile(db.read_blob(record.sha256), device_type)
                except (NoDatasheet, UnknownGpuError, OSError) as exc:
                    raise ModelsError(f"{data_dir}: model {session.model!r} has no profile on {device_type!r} "
                                      f"(no table, no measurement, no datasheet: {exc})") from None
            serving = db.serving(session.model)
            if serving.batch_cap:
                profile = profile.capped(serving.batch_cap)
            rate = serving.expected_rate_rps
            out.append(SimModel(session.model, session.slo_ms, rate or 1.0, profile,
                                min_replicas=db.min_replicas(session.model), expected_rate_rps=rate))
    finally:
        db.close()
    if not out:
        raise ModelsError(f"{data_dir}: the model database serves no model")
    return tuple(out)


def shares(models: tuple[SimModel, ...]) -> dict[str, float]:
    """Each model's share of the total rate, normalised; ModelsError when they add up to nothing."""
    total = sum(m.share for m in models)
    if total <= 0:
        raise ModelsError("the models' shares add up to 0: give each model a share of the scheduled rate "
                          "(or arrivals from a trace file)")
    return {m.name: m.share / total for m in models}


def linear_models(count: int, slo_ms: float, alpha_ms: float, beta_ms: float, max_batch: int,
                  memory_mb: float = 0.0, name: str = "m{:04d}", shares_by_index: Mapping[int, float] | None = None
                  ) -> tuple[SimModel, ...]:
    """``count`` models of the same linear profile l(b) = alpha * b + beta (scale studies and tests);
    equal shares unless ``shares_by_index`` gives them."""
    profile = Profile.linear(alpha_ms, beta_ms, max_batch, memory_base_mb=memory_mb)
    return tuple(SimModel(name.format(i), slo_ms, (shares_by_index or {}).get(i, 1.0), profile)
                 for i in range(count))
