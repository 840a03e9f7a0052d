"""Local admin commands find the cluster token by themselves: `<data-dir>/token` (default
`.nexus-data`, where `nexus serve` writes it) when the scheduler is on loopback and the file is
readable; `--token-file` and `$NEXUS_TOKEN` still win, and no token goes to another machine unasked."""

from __future__ import annotations

import argparse
import os
import subprocess

import pytest

from nexus.client_flags import client_credentials, local_token_file
from nexus.launcher import nexus_command
from tests.conftest import start_serve


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    c = start_serve(tmp_path_factory.mktemp("admin-token") / "data", "--no-samples", "--backends", "0")
    yield c
    c.stop()


def _nexus(cwd, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    """``nexus ARGS`` run in ``cwd`` as an operator would, with ``$NEXUS_TOKEN`` only when ``token`` is given."""
    env = {k: v for k, v in os.environ.items() if k != "NEXUS_TOKEN"}
    if token is not None:
        env["NEXUS_TOKEN"] = token
    return subprocess.run([*nexus_command(), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_admin_commands_find_a_local_clusters_token(local_cluster, tmp_path):
    here = tmp_path / "where-serve-ran"
    here.mkdir()
    (here / ".nexus-data").symlink_to(local_cluster.data_dir)
    scheduler = ["--scheduler", local_cluster.scheduler]
    for argv in (["models", "list"], ["queries", "list"], ["status"]):
        found = _nexus(here, *argv, *scheduler)
        assert found.returncode == 0, (argv, found.stderr)
    elsewhere = _nexus(tmp_path, "models", "list", *scheduler, "--data-dir", str(local_cluster.data_dir))
    assert elsewhere.returncode == 0, elsewhere.stderr

    missing = _nexus(tmp_path, "models", "list", *scheduler)
    assert missing.returncode == 2 and "missing cluster token" in missing.stderr
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    by_flag = _nexus(here, "models", "list", *scheduler, "--token-file", str(wrong))
    assert by_flag.returncode == 2 and "wrong cluster token" in by_flag.stderr
    by_env = _nexus(here, "models", "list", *scheduler, token="not-the-token")
    assert by_env.returncode == 2 and "wrong cluster token" in by_env.stderr


def test_the_data_dir_token_is_for_a_scheduler_on_loopback_only(tmp_path):
    (tmp_path / "token").write_text("t0k\n")
    token = str(tmp_path / "token")
    for address, expected in (("127.0.0.1:8100", token), ("127.8.9.1:1", token), ("[::1]:8100", token),
                              ("localhost:8100", token), ("10.0.0.1:8100", ""), ("[fd00::1]:8100", ""),
                              ("scheduler.example:8100", ""), ("nonsense", "")):
        assert local_token_file(address, tmp_path) == expected, address
    assert local_token_file("127.0.0.1:8100", tmp_path / "absent") == ""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "token").write_text("\n")
    assert local_token_file("127.0.0.1:8100", tmp_path / "empty") == ""

    args = argparse.Namespace(tls_ca="", token_file="", data_dir=str(tmp_path), scheduler="127.0.0.1:8100")
    assert client_credentials(args, environ={}).token == "t0k"
    assert client_credentials(args, environ={"NEXUS_TOKEN": "from-env"}).token == "from-env"
    args.scheduler = "10.0.0.1:8100"
    assert client_credentials(args, environ={}).token is None
