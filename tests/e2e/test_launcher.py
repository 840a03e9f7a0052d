"""The one launcher (nexus/launcher.py): component command lines come from the config dataclasses,
`nexus serve`'s component flags are those of the components with the same defaults, and the
supervisor restarts a child that dies, with backoff, until it is stopped."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import pytest

from common.config import BackendConfig, BatchStart, FrontendConfig, SchedulerConfig, add_arguments, from_args
from nexus import serve_cmd
from nexus.launcher import Child, Supervisor, component_argv, pin_listen


def _parse_component(argv: list[str]):
    name, *flags = argv
    cls = {"scheduler": SchedulerConfig, "frontend": FrontendConfig, "backend": BackendConfig}[name]
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return from_args(cls, parser.parse_args(flags))


@pytest.mark.parametrize("config", [
    SchedulerConfig(listen="0.0.0.0:8100", data_dir=pathlib.Path("/tmp/db"), epoch_s=3.0, burst_sigma=0.0),
    BackendConfig(scheduler="10.0.0.1:8100", listen="[::]:9000", threads=1, batch_start=BatchStart.DUTY_CYCLE,
                  prefix_batching=False, advertise="10.0.0.7:9000"),
    FrontendConfig(scheduler="sched:8100", listen="0.0.0.0:8001", exec_path="unary", drain_grace_s=3.0),
])
def test_component_argv_rebuilds_the_config(config):
    argv = component_argv(config)
    assert _parse_component(argv) == config


def test_component_argv_refuses_what_is_not_a_component():
    with pytest.raises(TypeError, match="not a component"):
        component_argv(object())


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    return parser


def test_serve_flags_default_to_the_components_own_defaults(tmp_path):
    args = _serve_parser().parse_args(["serve", "--data-dir", str(tmp_path)])
    scheduler, backend, frontend = serve_cmd.configs(args)
    assert scheduler == SchedulerConfig(listen="127.0.0.1:8100", data_dir=tmp_path.resolve() / "db")
    assert backend == BackendConfig(scheduler="127.0.0.1:8100", listen="127.0.0.1:0")
    assert frontend == FrontendConfig(scheduler="127.0.0.1:8100", listen="127.0.0.1:8001",
                                      metrics_listen="127.0.0.1:8002", http_listen="127.0.0.1:8000")


def test_every_component_field_is_a_serve_flag(tmp_path):
    """No hand-declared copies: each field not set by `nexus serve` itself reaches its component."""
    args = _serve_parser().parse_args([
        "serve", "--data-dir", str(tmp_path), "--epoch-s", "7", "--solver", "exact", "--threads", "3",
        "--batch-start", "duty-cycle", "--no-prefix-batching", "--drain-grace-s", "4",
        "--frontend-drain-grace-s", "6", "--frontend-exec-path", "unary", "--frontend-default-slo-ms", "50",
        "--metrics-port", "9"])
    scheduler, backend, frontend = serve_cmd.configs(args)
    assert (scheduler.epoch_s, scheduler.solver) == (7.0, "exact")
    assert (backend.threads, backend.batch_start, backend.prefix_batching, backend.drain_grace_s) == \
        (3, BatchStart.DUTY_CYCLE, False, 4.0)
    assert (frontend.drain_grace_s, frontend.exec_path, frontend.default_slo_ms) == (6.0, "unary", 50.0)
    assert frontend.metrics_listen == "127.0.0.1:9" and backend.metrics_port == 0   # serve's own flag, not the backends'
    assert frontend.http_listen == "127.0.0.1:8000"
    own = {"scheduler": serve_cmd.SCHEDULER_OWN, "backend": serve_cmd.BACKEND_OWN, "frontend": serve_cmd.FRONTEND_OWN}
    flags = {a.dest for a in _serve_parser()._subparsers._group_actions[0].choices["serve"]._actions}
    for name, cls, prefix in (("scheduler", SchedulerConfig, ""), ("backend", BackendConfig, ""),
                              ("frontend", FrontendConfig, "frontend_")):
        for f in dataclasses.fields(cls):
            if f.name not in own[name] and f.name != "security":
                assert prefix + f.name in flags, f"{name}.{f.name} is not a flag of nexus serve"


def test_a_bad_serve_flag_is_refused_before_anything_starts(tmp_path):
    args = _serve_parser().parse_args(["serve", "--data-dir", str(tmp_path), "--threads", "-1"])
    assert serve_cmd.run(args) == 2
    assert not (tmp_path / "db").exists()


# A child that announces itself like a component, then exits with status 3 after a moment.
_FLAKY = ["-c", "import sys, time; print('NEXUS-READY flaky 127.0.0.1:1', flush=True); time.sleep(0.3); sys.exit(3)"]


def test_supervisor_restarts_a_dead_child_with_backoff_until_stopped():
    lines: list[str] = []
    supervisor = Supervisor(lines.append, initial_s=0.1, max_s=0.4)
    child = supervisor.add(Child("flaky", _FLAKY, command=[sys.executable]))
    child.wait_ready(30)
    deadline = time.monotonic() + 60
    while child.starts < 4 and time.monotonic() < deadline:
        supervisor.check()
        time.sleep(0.02)
    assert child.starts >= 4, lines
    exits = [line for line in lines if "exited with status 3" in line]
    assert len(exits) >= 3
    delays = [float(line.split("restarting in ")[1].split()[0]) for line in exits]
    assert delays[:3] == [0.1, 0.2, 0.4]            # doubling, capped at max_s
    assert any(line.startswith("flaky restarted (pid ") for line in lines)
    supervisor.stop_all()
    assert not child.running()


def test_a_stopping_supervisor_restarts_no_child_that_exits():
    """Once told to stop (serve's signal handler sets ``stopping`` first thing), a child that exits
    is neither restarted nor reported as a failure; stop_all gives every exit status."""
    now = [0.0]
    lines: list[str] = []
    supervisor = Supervisor(lines.append, initial_s=0.1, clock=lambda: now[0])
    child = supervisor.add(Child("flaky", _FLAKY, command=[sys.executable]))
    child.wait_ready(30)
    supervisor.stopping = True
    child.proc.wait(30)
    for _ in range(3):
        now[0] += 10.0
        supervisor.check()
    assert child.starts == 1 and lines == []
    assert supervisor.stop_all() == {"flaky": 3}


def test_supervisor_backoff_doubles_up_to_its_cap():
    supervisor = Supervisor(lambda line: None, initial_s=1.0, max_s=8.0)
    assert [supervisor.backoff_s(n) for n in (1, 2, 3, 4, 5)] == [1.0, 2.0, 4.0, 8.0, 8.0]


def test_pin_listen_keeps_a_restarted_component_at_its_address():
    child = Child("sched", ["-c", "print('NEXUS-READY scheduler 127.0.0.1:45678', flush=True)"],
                  command=[sys.executable])
    child.wait_ready(30)
    config = pin_listen(child, SchedulerConfig(listen="127.0.0.1:0"))
    assert config.listen == "127.0.0.1:45678"
    assert child.argv == ["scheduler", "--listen", "127.0.0.1:45678"]
    assert pin_listen(child, SchedulerConfig(listen="127.0.0.1:8100")).listen == "127.0.0.1:8100"
    child.stop()
