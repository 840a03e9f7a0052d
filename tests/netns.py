"""Linux network namespaces on a bridge: one "machine" per namespace, each with its own address.

:class:`Hosts` makes a bridge in the root namespace and, per host, a namespace joined to it by a
veth pair, with an IPv4 address (10.R.R.N/24) and an IPv6 one (fd00:R:R::N/64) on ``eth0``
and loopback up. Every name carries a random tag, so parallel runs never collide, and
:meth:`Hosts.close` removes everything it made (processes running in a namespace are the
caller's to stop first). :func:`netns_problem` says why namespaces cannot be used here (not
root, no ``ip``), for a skip reason.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def netns_problem() -> str | None:
    """Why this process cannot create network namespaces (None when it can)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"nxprobe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` failed (needs root): {exc.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class Hosts:
    """Namespaces on one bridge; ``hosts[name]`` is its IPv4 address, ``v6[name]`` its IPv6 one."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(2)
        self.bridge = f"nxb{self.tag}"
        self.namespaces: dict[str, str] = {}
        self._links: list[str] = []
        self.v4: dict[str, str] = {}
        self.v6: dict[str, str] = {}
        octet = int(self.tag, 16) % 250 + 1
        self._v4_prefix = f"10.{octet}.{int(self.tag[:2], 16) % 250 + 1}"
        self._v6_prefix = f"fd00:{int(self.tag, 16):x}:1"   # canonical text: no leading zeros
        self._made_bridge = False
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made_bridge = True
        _ip("link", "set", self.bridge, "up")

    def add(self, name: str) -> str:
        """A new namespace ("machine") called ``name`` on the bridge; returns its IPv4 address."""
        n = len(self.namespaces) + 2
        ns = f"nx{self.tag}-{name}"
        host_if, peer_if = f"nxv{self.tag}{n}", f"nxp{self.tag}{n}"
        _ip("netns", "add", ns)
        self.namespaces[name] = ns
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        self._links.append(host_if)
        _ip("link", "set", host_if, "master", self.bridge, "up")
        _ip("link", "set", peer_if, "netns", ns)
        _ip("-n", ns, "link", "set", peer_if, "name", "eth0")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{self._v4_prefix}.{n}/24", "dev", "eth0")
        _ip("-n", ns, "-6", "addr", "add", f"{self._v6_prefix}::{n}/64", "dev", "eth0", "nodad")
        _ip("-n", ns, "link", "set", "eth0", "up")
        self.v4[name] = f"{self._v4_prefix}.{n}"
        self.v6[name] = f"{self._v6_prefix}::{n}"
        return self.v4[name]

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program on host ``name``."""
        return ["ip", "netns", "exec", self.namespaces[name]]

    def close(self) -> None:
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()
        for link in self._links:      # gone with their namespace's end already, unless a step failed
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
        self._links.clear()
        if self._made_bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            self._made_bridge = False

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
