"""A cluster across "machines": scheduler, frontend, backends and a client, each in its own network
namespace with its own address on a bridge, started with exactly the commands of docs/deployment.md, the
"Deploy across machines" section (addresses substituted). The client uploads a model and is served
through the frontend's address; a backend is killed, a new one joins from another namespace and
takes over. Skipped, with the reason, where network namespaces cannot be made (not root)."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from common.sample_models import mlp_small, model_bytes
from nexus.launcher import Child, nexus_command
from tests.netns import Hosts, netns_problem

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]
MARKER = "<!-- deploy-commands:"

# Served through the frontend with the standard Triton client, from the client's namespace.
CLIENT = r'''
import sys, time
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

url, model, timeout_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = grpcclient.InferenceServerClient(url)
deadline = time.monotonic() + timeout_s
last = None
while time.monotonic() < deadline:
    try:
        x = grpcclient.InferInput("input", [2, 64], "FP32")
        x.set_data_from_numpy(np.ones((2, 64), np.float32))
        result = client.infer(model, [x], client_timeout=10)
        print("served", result.as_numpy("logits").shape, flush=True)
        sys.exit(0)
    except InferenceServerException as exc:
        last = exc
        time.sleep(0.5)
print("never served:", last, flush=True)
sys.exit(1)
'''


def readme_commands() -> dict[str, list[str]]:
    """The deployment commands of docs/deployment.md, by component: the first word after ``nexus``."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    start = text.index(MARKER)
    block = re.search(r"```sh\n(.*?)```", text[start:], re.S).group(1)
    commands = {}
    for line in block.splitlines():
        if line.strip() and not line.startswith("#"):
            argv = shlex.split(line)
            assert argv[0] == "nexus", line
            commands[argv[1] if argv[1] != "models" else "upload"] = argv
    assert set(commands) == {"scheduler", "backend", "frontend", "upload"}, commands
    return commands


def substitute(argv: list[str], values: dict[str, str]) -> list[str]:
    """``argv`` with its placeholders replaced, and ``nexus`` by this environment's nexus command."""
    out = []
    for word in argv[1:]:
        for placeholder, value in values.items():
            word = word.replace(placeholder, value)
        out.append(word)
    return out


@pytest.fixture
def hosts():
    problem = netns_problem()
    if problem:
        pytest.skip(f"network namespaces unavailable: {problem}")
    h = Hosts()
    try:
        yield h
    finally:
        h.close()


class Cluster:
    """Components started in their namespaces from docs/deployment.md's commands; all stopped at the end."""

    def __init__(self, hosts: Hosts, tmp: pathlib.Path, family: str) -> None:
        self.hosts = hosts
        self.tmp = tmp
        self.v6 = family == "ipv6"
        self.commands = readme_commands()
        self.children: list[Child] = []
        self.logs: dict[str, pathlib.Path] = {}

    def host(self, name: str) -> str:
        return f"[{self.hosts.v6[name]}]" if self.v6 else self.hosts.v4[name]

    def values(self) -> dict[str, str]:
        values = {"SCHEDULER_HOST": self.host("scheduler"), "DEVICE": "cpu",
                  "/var/lib/nexus": str(self.tmp / "db"), "model.onnx": str(self.tmp / "model.onnx")}
        if self.v6:
            values["0.0.0.0"] = "[::]"
        return values

    def start(self, component: str, host: str) -> Child:
        argv = substitute(self.commands[component], self.values())
        log = self.tmp / f"{host}.log"
        self.logs[host] = log
        env = dict(os.environ, NEXUS_LOG="INFO")
        child = Child(host, argv, env, wrap=self.hosts.exec_prefix(host), stderr=open(log, "w"))
        self.children.append(child)
        child.wait_ready(120)
        return child

    def run_in(self, host: str, argv: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*self.hosts.exec_prefix(host), *argv], capture_output=True, text=True,
                              timeout=timeout_s)

    def wait_log(self, host: str, pattern: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = re.search(pattern, self.logs[host].read_text())
            if match:
                return match.group(0)
            time.sleep(0.2)
        raise AssertionError(f"{host}: no {pattern!r} in its log:\n{self.logs[host].read_text()[-3000:]}")

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop(timeout_s=30)


def _serve(cluster: Cluster, timeout_s: float = 180) -> str:
    done = cluster.run_in("client", [sys.executable, "-c", CLIENT, f"{cluster.host('frontend')}:8001", "mymodel",
                                     str(timeout_s)], timeout_s=timeout_s + 60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_cluster_across_namespaces(hosts, tmp_path, family):
    for name in ("scheduler", "frontend", "backend1", "backend2", "backend3", "client"):
        hosts.add(name)
    (tmp_path / "model.onnx").write_bytes(model_bytes(mlp_small()))
    cluster = Cluster(hosts, tmp_path, family)
    try:
        cluster.start("scheduler", "scheduler")
        b1 = cluster.start("backend", "backend1")
        b2 = cluster.start("backend", "backend2")
        cluster.start("frontend", "frontend")
        for name in ("backend1", "backend2", "frontend"):
            # each node is known by the address of its own machine, never 0.0.0.0 / [::] or loopback
            cluster.wait_log(name, rf"registered as (be|fe)-\w+; peers reach it at {re.escape(cluster.host(name))}:")
        upload = cluster.run_in("client", [*nexus_command(), *substitute(cluster.commands["upload"], cluster.values())])
        assert upload.returncode == 0, upload.stderr
        assert "uploaded mymodel" in upload.stdout
        assert "served (2, 10)" in _serve(cluster)
        if family == "ipv6":
            return
        # A backend dies; a new one joins from another machine; once the other original one is
        # gone too, only the newcomer can be serving.
        b1.proc.send_signal(signal.SIGKILL)
        b1.proc.wait(timeout=30)
        cluster.start("backend", "backend3")
        cluster.wait_log("backend3", rf"peers reach it at {re.escape(cluster.host('backend3'))}:9000")
        b2.proc.send_signal(signal.SIGKILL)
        b2.proc.wait(timeout=30)
        assert "served (2, 10)" in _serve(cluster)
        cluster.wait_log("backend3", r"serving mymodel")
    finally:
        cluster.stop()
