"""A stand-in for the Kubernetes API server's Lease endpoints, over HTTPS, for tests/e2e/test_kube_lease.py.

Kubernetes cannot run on these machines, so the scheduler's Lease client is tested against this: the
``coordination.k8s.io/v1`` Lease REST paths with the API server's rules that leader election relies
on: a bearer token (401 without it), GET 404 for a Lease not there, POST 409 for one that is, and
optimistic concurrency (PUT with a stale ``metadata.resourceVersion`` gets 409; every write bumps it).
It implements nothing else.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_PATH = re.compile(r"^/apis/coordination\.k8s\.io/v1/namespaces/([^/]+)/leases(?:/([^/]+))?$")


class LeaseServer:
    def __init__(self, cert: str, key: str, token: str) -> None:
        self.token = token
        self.leases: dict[tuple[str, str], dict] = {}
        self.writes = 0
        self._lock = threading.Lock()
        self._version = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _handle(self, method: str) -> None:
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._reply(401, {"kind": "Status", "code": 401, "reason": "Unauthorized"})
                match = _PATH.match(self.path)
                if not match:
                    return self._reply(404, {"kind": "Status", "code": 404})
                body = None
                if method in ("POST", "PUT"):
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                code, out = server.handle(method, match.group(1), match.group(2), body)
                self._reply(code, out)

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PUT(self) -> None:
                self._handle("PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def handle(self, method: str, namespace: str, name: str | None, body: dict | None) -> tuple[int, dict]:
        with self._lock:
            if method == "GET":
                lease = self.leases.get((namespace, name or ""))
                return (200, lease) if lease else (404, {"kind": "Status", "code": 404, "reason": "NotFound"})
            name = name or body["metadata"]["name"]
            current = self.leases.get((namespace, name))
            if method == "POST" and current is not None:
                return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
            if method == "PUT":
                if current is None:
                    return 404, {"kind": "Status", "code": 404, "reason": "NotFound"}
                if body.get("metadata", {}).get("resourceVersion") != current["metadata"]["resourceVersion"]:
                    return 409, {"kind": "Status", "code": 409, "reason": "Conflict"}
            self._version += 1
            self.writes += 1
            body.setdefault("metadata", {}).update(name=name, namespace=namespace, resourceVersion=str(self._version))
            self.leases[(namespace, name)] = body
            return (201 if method == "POST" else 200), body

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
