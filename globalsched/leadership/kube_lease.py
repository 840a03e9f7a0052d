"""Leader election on a Kubernetes Lease (``--leader-election kubernetes``), with the database as the
fence.

The ``coordination.k8s.io/v1`` Lease ``nexus-scheduler`` in the pod's namespace decides who leads, as
Kubernetes controllers do: a candidate takes it when it has no holder or its holder has not renewed
it for ``leaseDurationSeconds`` as this candidate observed (its own clock, not the holder's
``renewTime``, so clocks need not agree); every write carries the ``resourceVersion`` it read, so
of two candidates at most one succeeds (HTTP 409 for the other). The leader renews it every
``ttl / 4``.

A Lease cannot fence what a paused leader writes to the database when it wakes. So the elected
scheduler also claims the next term in the database's ``scheduler_lease`` row (one statement, with
its address): the term number is its lease epoch (plan epochs, the write fence of
globalsched/state/database/plan_store.py), and a renew succeeds only while the row still names this term.
The class has :class:`globalsched.state.database.lease.LeaderLease`'s contract, so globalsched/leadership/leader.py
uses either.

The API is reached as in-cluster clients do: ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``,
the service account's token, CA and namespace from ``/var/run/secrets/kubernetes.io/serviceaccount``
(``$NEXUS_KUBE_SERVICEACCOUNT_DIR`` moves it). The pod's service account needs get, create and update
on ``leases`` in its namespace (deploy/kubernetes/README.md has the Role).

Blocking: call from a thread.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import ssl
import time
import urllib.error
import urllib.request

from globalsched.state.database.connection import PostgresConnection
from globalsched.state.database.lease import LEASE_SCHEMA, LeaseHolder

LEASE_NAME = "nexus-scheduler"
ADDRESS_ANNOTATION = "nexus.serving/leader-address"
SERVICEACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

_CLAIM = """
INSERT INTO scheduler_lease AS l (id, holder, address, epoch, pid, expires_at)
VALUES (1, ?, ?, 1, pg_backend_pid(), 'infinity')
ON CONFLICT (id) DO UPDATE SET holder = excluded.holder, address = excluded.address, epoch = l.epoch + 1,
    pid = excluded.pid, expires_at = excluded.expires_at
RETURNING epoch
"""


class KubeApiError(RuntimeError):
    """The API server refused or could not be reached; the message says which and why."""


class KubeConflict(KubeApiError):
    """HTTP 409: the object changed since it was read (another candidate wrote first)."""


class KubeApi:
    """The few REST calls a Lease needs, as an in-cluster client."""

    def __init__(self, server: str, token: str, namespace: str, ca_file: str | None) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.namespace = namespace
        self.context = ssl.create_default_context(cafile=ca_file) if server.startswith("https") else None

    @classmethod
    def in_cluster(cls) -> "KubeApi":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "")
        if not host or not port:
            raise KubeApiError("--leader-election kubernetes: not in a Kubernetes pod (KUBERNETES_SERVICE_HOST and "
                               "KUBERNETES_SERVICE_PORT are unset)")
        sa = pathlib.Path(os.environ.get("NEXUS_KUBE_SERVICEACCOUNT_DIR", SERVICEACCOUNT_DIR))
        try:
            token = (sa / "token").read_text().strip()
            namespace = (sa / "namespace").read_text().strip()
        except OSError as exc:
            raise KubeApiError(f"--leader-election kubernetes: cannot read the service account in {sa} "
                               f"({exc.strerror}); mount its token (automountServiceAccountToken: true)") from None
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", token, namespace, str(sa / "ca.crt"))

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | None:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method,
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5, context=self.context) as reply:
                return json.loads(reply.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code == 404 and method == "GET":
                return None
            detail = exc.read()[:300].decode(errors="replace")
            if exc.code == 409:
                raise KubeConflict(f"{method} {path}: conflict") from None
            raise KubeApiError(f"{method} {path}: HTTP {exc.code} {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise KubeApiError(f"{method} {path}: cannot reach the API server {self.server}: "
                               f"{getattr(exc, 'reason', exc)}") from None

    def lease_path(self, name: str = LEASE_NAME, collection: bool = False) -> str:
        base = f"/apis/coordination.k8s.io/v1/namespaces/{self.namespace}/leases"
        return base if collection else f"{base}/{name}"

    def get_lease(self) -> dict | None:
        return self._call("GET", self.lease_path())

    def create_lease(self, lease: dict) -> dict:
        return self._call("POST", self.lease_path(collection=True), lease)

    def replace_lease(self, lease: dict) -> dict:
        return self._call("PUT", self.lease_path(), lease)


def _micro_time(when: datetime.datetime | None = None) -> str:
    return (when or datetime.datetime.now(datetime.timezone.utc)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class KubernetesLease:
    def __init__(self, url: str, identity: str, address: str, ttl_s: float, api: KubeApi,
                 clock=time.monotonic) -> None:
        self.api = api
        self.db = PostgresConnection(url, application_name=f"nexus-scheduler-term {address}", connect_timeout_s=5)
        self.db.create_tables(LEASE_SCHEMA)
        self.identity = identity
        self.address = address
        self.ttl_s = ttl_s
        self.duration_s = max(1, math.ceil(ttl_s))
        self.clock = clock
        self.epoch = 0
        self.valid_until = 0.0
        self._observed: tuple | None = None       # (holder, renewTime) last seen
        self._observed_at = 0.0

    def _observe(self, lease: dict | None) -> bool:
        """Whether the Lease is free for this candidate: no holder, or not renewed for its duration as
        observed here."""
        if lease is None:
            return True
        spec = lease.get("spec", {})
        seen = (spec.get("holderIdentity", ""), spec.get("renewTime", ""))
        if seen != self._observed:
            self._observed, self._observed_at = seen, self.clock()
        if not seen[0]:
            return True
        return self.clock() > self._observed_at + float(spec.get("leaseDurationSeconds", self.duration_s))

    def try_acquire(self) -> int | None:
        sent = self.clock()
        lease = self.api.get_lease()
        if not self._observe(lease):
            return None
        now = _micro_time()
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s, "acquireTime": now,
                "renewTime": now}
        try:
            if lease is None:
                self.api.create_lease({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                       "metadata": {"name": LEASE_NAME,
                                                    "annotations": {ADDRESS_ANNOTATION: self.address}},
                                       "spec": {**spec, "leaseTransitions": 0}})
            else:
                lease["spec"] = {**lease.get("spec", {}), **spec,
                                 "leaseTransitions": int(lease.get("spec", {}).get("leaseTransitions", 0)) + 1}
                lease.setdefault("metadata", {}).setdefault("annotations", {})[ADDRESS_ANNOTATION] = self.address
                self.api.replace_lease(lease)       # carries the resourceVersion read: 409 if another wrote
        except KubeConflict:
            return None
        self.epoch = self.db.execute(_CLAIM, (self.identity, self.address)).fetchone()[0]
        self.valid_until = sent + self.ttl_s
        return self.epoch

    def renew(self) -> bool:
        sent = self.clock()
        lease = self.api.get_lease()
        spec = (lease or {}).get("spec", {})
        term = self.db.execute("SELECT holder, epoch FROM scheduler_lease WHERE id = 1").fetchone()
        if lease is None or spec.get("holderIdentity") != self.identity or term != (self.identity, self.epoch):
            self.valid_until = 0.0
            return False
        spec["renewTime"] = _micro_time()
        try:
            self.api.replace_lease(lease)
        except KubeConflict:
            self.valid_until = 0.0
            return False
        self.valid_until = sent + self.ttl_s
        return True

    def holds(self) -> bool:
        return self.epoch > 0 and self.clock() < self.valid_until

    def current(self) -> LeaseHolder | None:
        lease = self.api.get_lease()
        if lease is None:
            return None
        spec = lease.get("spec", {})
        address = lease.get("metadata", {}).get("annotations", {}).get(ADDRESS_ANNOTATION, "")
        return LeaseHolder(spec.get("holderIdentity", ""), address, int(spec.get("leaseTransitions", 0)) + 1,
                           self._observe(lease))

    def release(self) -> None:
        if self.epoch:
            lease = self.api.get_lease()
            if lease is not None and lease.get("spec", {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                try:
                    self.api.replace_lease(lease)
                except KubeConflict:
                    pass
        self.epoch, self.valid_until = 0, 0.0

    def close(self) -> None:
        self.db.close()
