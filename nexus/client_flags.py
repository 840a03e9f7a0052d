"""``--tls-ca`` and ``--token-file`` of the client commands (``nexus models``, ``queries``, ``bench``).

A client verifies the server's TLS certificate against ``--tls-ca`` (and dials plaintext without
it); the cluster token comes from ``--token-file`` or ``$NEXUS_TOKEN`` and is sent on admin calls.
"""

from __future__ import annotations

import argparse

from common.config import ConfigError, SecurityConfig
from common.security import Credentials, SecurityError


class ClientFlagError(ValueError):
    pass


def add_client_security(parser: argparse.ArgumentParser, token: bool = True) -> None:
    parser.add_argument("--tls-ca", default="", metavar="CA.pem",
                        help="PEM CA that signed the server's certificate: connect over TLS (default: plaintext)")
    if token:
        parser.add_argument("--token-file", default="", metavar="PATH",
                            help="file holding the cluster token (default: $NEXUS_TOKEN; `nexus serve` writes "
                                 "<data-dir>/token)")


def client_credentials(args: argparse.Namespace) -> Credentials:
    """The credentials the flags name; ClientFlagError naming the flag when a file is unusable."""
    config = SecurityConfig(tls_ca=getattr(args, "tls_ca", ""), token_file=getattr(args, "token_file", ""))
    try:
        config.validate()
        return Credentials.load(config)
    except (ConfigError, SecurityError) as exc:
        raise ClientFlagError(str(exc)) from None
