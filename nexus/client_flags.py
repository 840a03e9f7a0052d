"""``--tls-ca``, ``--token-file`` and ``--data-dir`` of the client commands (``nexus models``,
``queries``, ``status``, ``bench``).

A client verifies the server's TLS certificate against ``--tls-ca`` (and dials plaintext without
it). The cluster token, sent on every admin call, is the first of:

1. ``--token-file PATH``;
2. ``$NEXUS_TOKEN``;
3. ``<data-dir>/token``, where ``--data-dir`` defaults to ``nexus serve``'s own default
   (``.nexus-data`` in the current directory), used only when the ``--scheduler`` address is on
   loopback (127.0.0.0/8, ::1, localhost) and the file is readable, as ``kubectl`` finds its
   config: a local cluster's operator types no token, and no token is sent to another machine
   unasked.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import pathlib

from common.config import ConfigError, SecurityConfig, scheduler_addresses, split_host_port
from common.security import TOKEN_ENV, Credentials, SecurityError, read_token

SERVE_DATA_DIR = ".nexus-data"      # `nexus serve --data-dir`'s default, where it writes the token


class ClientFlagError(ValueError):
    pass


def add_client_security(parser: argparse.ArgumentParser, token: bool = True) -> None:
    parser.add_argument("--tls-ca", default="", metavar="CA.pem",
                        help="PEM CA that signed the server's certificate: connect over TLS (default: plaintext)")
    if token:
        parser.add_argument("--token-file", default="", metavar="PATH",
                            help="file holding the cluster token (default: $NEXUS_TOKEN, else <data-dir>/token "
                                 "when the scheduler is on this machine)")
        parser.add_argument("--data-dir", default=SERVE_DATA_DIR, metavar="DIR",
                            help="a local `nexus serve`'s data directory, whose token is used when the scheduler "
                                 f"address is on loopback and no other token is given (default {SERVE_DATA_DIR})")


def is_loopback(address: str) -> bool:
    """Whether ``HOST:PORT`` names this machine by a loopback address (or ``localhost``)."""
    try:
        host, _ = split_host_port(address)
    except ValueError:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_token_file(scheduler: str, data_dir: str | os.PathLike) -> str:
    """``<data_dir>/token`` when ``scheduler`` is on loopback and the file holds a token; else ""."""
    path = pathlib.Path(data_dir) / "token"
    if not all(is_loopback(a) for a in scheduler_addresses(scheduler)):
        return ""
    try:
        read_token(path)
    except SecurityError:           # absent, unreadable or empty: not this cluster's token
        return ""
    return str(path)


def client_credentials(args: argparse.Namespace, environ=None) -> Credentials:
    """The credentials the flags name (the token as the module docstring orders); ClientFlagError
    naming the flag when a file given is unusable."""
    environ = os.environ if environ is None else environ
    token_file = getattr(args, "token_file", "")
    if not token_file and hasattr(args, "data_dir") and not environ.get(TOKEN_ENV, "").strip():
        token_file = local_token_file(getattr(args, "scheduler", ""), args.data_dir)
    config = SecurityConfig(tls_ca=getattr(args, "tls_ca", ""), token_file=token_file)
    try:
        config.validate()
        return Credentials.load(config, environ)
    except (ConfigError, SecurityError) as exc:
        raise ClientFlagError(str(exc)) from None
