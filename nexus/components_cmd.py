"""``nexus scheduler | frontend | backend``: one component alone, for a multi-machine deployment."""

from __future__ import annotations

import argparse
import sys

from common.config import BackendConfig, ConfigError, FrontendConfig, SchedulerConfig, add_arguments, from_args
from common.security import Credentials, SecurityError
from nexus.process import run_until_signalled, setup_logging


def _run(name: str, cls, serve_path: str):
    def run(args: argparse.Namespace) -> int:
        try:
            config = from_args(cls, args)
            Credentials.load(config.security)     # unreadable TLS files or token: refuse before starting
        except (ConfigError, SecurityError) as exc:
            print(f"nexus {name}: error: {exc}", flush=True, file=sys.stderr)
            return 2
        setup_logging(args.log_level)
        path = serve_path
        if isinstance(config, FrontendConfig) and config.resolved_workers > 1:
            path = "nexus.frontend_workers.serve"      # the workers' supervisor
        module, _, func = path.rpartition(".")
        serve = getattr(__import__(module, fromlist=[func]), func)
        return run_until_signalled(name, serve, config)
    return run


def register(sub) -> None:
    for name, cls, serve_path, help_text in (
            ("scheduler", SchedulerConfig, "globalsched.rpc.service.serve", "run the global scheduler"),
            ("frontend", FrontendConfig, "frontend.server.serve", "run a KServe v2 frontend"),
            ("backend", BackendConfig, "backend.server.serve", "run a backend on one device")):
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p, cls)
        p.add_argument("--log-level", default="", help="DEBUG, INFO, WARNING (default: $NEXUS_LOG or INFO)")
        p.set_defaults(func=_run(name, cls, serve_path))
