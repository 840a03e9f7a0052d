"""Model versions, as Triton numbers and selects them: version keys and version policies.

A model has versions 1, 2, ... (positive integers). Inside the system each served version is a
session of its own, named by its *version key*: ``name:version``; ':' never appears in a model
name (globalsched/state/modeldb.py refuses it), so the key is unambiguous. Version 1's key is the bare
name: that is what every session was called before versions existed, so databases, plans, backend
statistics and dashboards of single-version models read as they did. Query stage sessions
(``<query>/<stage>``) are not version keys; :func:`split_key` reads them as version 1 of themselves.

A :class:`VersionPolicy` is ``config.pbtxt``'s ``version_policy``: ``latest { num_versions: N }``
(Triton's default, N = 1), ``all``, or ``specific { versions: [...] }``; :meth:`VersionPolicy.select`
says which of the stored versions are served. Converted from and to Triton's ``ModelVersionPolicy``
message at the edges (:func:`from_pb`, :func:`to_pb`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Iterable

from common.pb import model_config

SEPARATOR = ":"


class VersionError(ValueError):
    """A version or version policy that cannot be used; the message says why."""


def version_key(name: str, version: int) -> str:
    """The session name of ``version`` of model ``name`` (version 1: the bare name)."""
    return name if version == 1 else f"{name}{SEPARATOR}{version}"


def split_key(key: str) -> tuple[str, int]:
    """(model name, version) of a version key; a key without a version is version 1."""
    name, sep, version = key.rpartition(SEPARATOR)
    if not sep or not version.isdigit() or not name:
        return key, 1
    return name, int(version)


def parse_version(text: str) -> int:
    """A requested version ("3") as an integer; VersionError when it is not a positive integer."""
    if not text.isdigit() or int(text) < 1:
        raise VersionError(f"version {text!r} is not a positive integer")
    return int(text)


class PolicyKind(enum.StrEnum):
    LATEST = "latest"
    ALL = "all"
    SPECIFIC = "specific"


@dataclass(frozen=True)
class VersionPolicy:
    """Which stored versions of a model are served (Triton's ``version_policy``)."""

    kind: PolicyKind = PolicyKind.LATEST
    num_versions: int = 1                    # LATEST: the newest this many
    versions: tuple[int, ...] = ()           # SPECIFIC: these, where stored

    def __post_init__(self) -> None:
        if self.kind is PolicyKind.LATEST and self.num_versions < 1:
            raise VersionError(f"version_policy latest: num_versions must be at least 1, got {self.num_versions}")
        if self.kind is PolicyKind.SPECIFIC:
            if not self.versions:
                raise VersionError("version_policy specific: list at least one version")
            bad = [v for v in self.versions if v < 1]
            if bad:
                raise VersionError(f"version_policy specific: versions must be positive, got {bad[0]}")

    def select(self, stored: Iterable[int]) -> tuple[int, ...]:
        """The stored versions this policy serves, ascending (possibly none: ``specific`` of others)."""
        stored = sorted(set(stored))
        if self.kind is PolicyKind.ALL:
            return tuple(stored)
        if self.kind is PolicyKind.SPECIFIC:
            return tuple(v for v in stored if v in self.versions)
        return tuple(stored[-self.num_versions:]) if stored else ()

    def describe(self) -> str:
        """As config.pbtxt writes it: ``latest { num_versions: 1 }``, ``all { }``, ``specific { versions: [1, 3] }``."""
        if self.kind is PolicyKind.ALL:
            return "all { }"
        if self.kind is PolicyKind.SPECIFIC:
            return f"specific {{ versions: [{', '.join(map(str, self.versions))}] }}"
        return f"latest {{ num_versions: {self.num_versions} }}"

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind.value, "num_versions": self.num_versions, "versions": list(self.versions)})

    @classmethod
    def from_json(cls, text: str) -> VersionPolicy:
        doc = json.loads(text)
        return cls(PolicyKind(doc["kind"]), int(doc["num_versions"]), tuple(int(v) for v in doc["versions"]))


DEFAULT_POLICY = VersionPolicy()


def from_pb(message: model_config.ModelVersionPolicy) -> VersionPolicy:
    """Triton's ``ModelVersionPolicy`` as a policy (none chosen: Triton's default, the latest one)."""
    which = message.WhichOneof("policy_choice")
    if which == "all":
        return VersionPolicy(PolicyKind.ALL)
    if which == "specific":
        return VersionPolicy(PolicyKind.SPECIFIC, versions=tuple(sorted(set(int(v) for v in message.specific.versions))))
    if which == "latest":
        return VersionPolicy(PolicyKind.LATEST, num_versions=message.latest.num_versions)
    return DEFAULT_POLICY


def to_pb(policy: VersionPolicy) -> model_config.ModelVersionPolicy:
    message = model_config.ModelVersionPolicy()
    if policy.kind is PolicyKind.ALL:
        message.all.SetInParent()
    elif policy.kind is PolicyKind.SPECIFIC:
        message.specific.versions.extend(policy.versions)
    else:
        message.latest.num_versions = policy.num_versions
    return message
