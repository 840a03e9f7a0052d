"""A real PostgreSQL server for tests and benchmarks: ``initdb`` and ``pg_ctl`` in a temporary directory, as an
unprivileged user (PostgreSQL refuses to run as root), on a free loopback port.

The superuser ``nexus`` has a password, and TCP connections must give it (scram-sha-256): clients
find it in the ``PGPASSFILE`` :attr:`PostgresServer.env` names, as an operator's would, never in the
URL. :meth:`PostgresServer.database` creates a fresh database per test.
"""

from __future__ import annotations

import glob
import os
import pathlib
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time

from harness.ports import free_port

USER = "nexus"


def postgres_bin() -> pathlib.Path | None:
    """The directory of ``initdb`` and ``pg_ctl`` (Debian keeps them outside PATH), or None."""
    found = shutil.which("initdb")
    if found:
        return pathlib.Path(found).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), reverse=True)
    return pathlib.Path(candidates[0]).parent if candidates else None


class PostgresServer:
    def __init__(self, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        """``tls_cert``/``tls_key``: serve TLS (``ssl = on``) with this certificate as well."""
        bindir = postgres_bin()
        if bindir is None:
            raise RuntimeError("PostgreSQL is not installed (no initdb on PATH or under /usr/lib/postgresql)")
        self.bindir = bindir
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="nexus-pg-"))
        self.port = free_port()
        self.password = secrets.token_hex(16)
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "nobody", "--"]
            os.chmod(self.root, 0o755)
        data = self.root / "data"
        data.mkdir()
        pwfile = self.root / "pw"
        pwfile.write_text(self.password + "\n")
        if os.geteuid() == 0:
            nobody = pwd.getpwnam("nobody")
            for p in (data, pwfile):
                os.chown(p, nobody.pw_uid, nobody.pw_gid)
        self._run(str(bindir / "initdb"), "-D", str(data), "-U", USER, f"--pwfile={pwfile}",
                  "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")
        pwfile.unlink()
        self.data = data
        options = f"-p {self.port} -k {data} -c listen_addresses=127.0.0.1 -c fsync=off"
        if tls_cert and tls_key:
            for src, name in ((tls_cert, "server.crt"), (tls_key, "server.key")):
                shutil.copyfile(src, data / name)
                os.chmod(data / name, 0o600)
                if os.geteuid() == 0:
                    os.chown(data / name, nobody.pw_uid, nobody.pw_gid)
            options += " -c ssl=on"
        self.log = self.root / "log"
        if os.geteuid() == 0:
            self.log.touch()
            os.chown(self.log, nobody.pw_uid, nobody.pw_gid)
        self._run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(self.log), "-w", "-t", "60", "-o", options,
                  "start")
        self.passfile = self.root / "pgpass"
        self.passfile.write_text(f"127.0.0.1:{self.port}:*:{USER}:{self.password}\n")
        self.passfile.chmod(0o600)
        self.env = {"PGPASSFILE": str(self.passfile)}

    def _run(self, *argv: str) -> None:
        proc = subprocess.run([*self._as, *argv], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{pathlib.Path(argv[0]).name} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        """A new empty database; its URL (no password: the passfile has it)."""
        import psycopg

        name = "t_" + secrets.token_hex(6)
        with psycopg.connect(self.url(), autocommit=True, passfile=str(self.passfile)) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        deadline = time.monotonic() + 10
        while (self.data / "postmaster.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.root, ignore_errors=True)
