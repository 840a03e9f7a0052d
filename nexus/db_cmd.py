"""``nexus db migrate --from sqlite:DIR --to postgresql://...``: move an installation's model database.

Stop the scheduler that owns the source first. The source is only read; the destination must hold no
model. Afterwards start every scheduler with ``--database`` and the same URL.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

from common.database_url import DatabaseUrlError, check_postgres_url, redact


def _error(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def _url_error(url: str, flag: str) -> str:
    """Why ``url`` (given as ``flag``) is no PostgreSQL URL this command takes; "" when it is one."""
    try:
        check_postgres_url(url)
    except DatabaseUrlError as exc:
        return str(exc).replace("--database", flag)
    return ""


def _migrate(args: argparse.Namespace) -> int:
    prog = "nexus db migrate"
    if not args.source.startswith("sqlite:"):
        return _error(prog, f"--from {args.source!r}: expected sqlite:DIR (a scheduler's --data-dir)", 2)
    source_dir = pathlib.Path(args.source.removeprefix("sqlite:"))
    if why := _url_error(args.dest, "--to"):
        return _error(prog, why, 2)
    # lazy: the model database modules (and sqlite3) add ~8 ms to every nexus command's start-up, --help included
    from globalsched.state.database.migrate import MigrationError, copy_database
    from globalsched.state.modeldb import ModelDatabase  # lazy: as above
    from globalsched.state.querydb import QueryStore  # lazy: as above

    try:
        source = ModelDatabase(source_dir, read_only=True)
    except (FileNotFoundError, RuntimeError) as exc:
        return _error(prog, f"--from: {exc}", 1)
    try:
        with tempfile.TemporaryDirectory(prefix="nexus-migrate-") as work:
            try:
                dest = ModelDatabase(pathlib.Path(work), database_url=args.dest)
            except (ConnectionError, RuntimeError) as exc:
                return _error(prog, f"--to: {exc}", 1)
            source_queries = QueryStore.beside(source.sql, source_dir)
            dest_queries = QueryStore.beside(dest.sql, pathlib.Path(work))
            try:
                report = copy_database(source, source_queries, dest, dest_queries)
            except MigrationError as exc:
                return _error(prog, str(exc), 1)
            finally:
                source_queries.close()
                dest_queries.close()
                dest.close()
    finally:
        source.close()
    tables = ", ".join(f"{n} {t}" for t, n in report.rows.items() if n)
    print(f"migrated {source_dir} to {redact(args.dest)}: {report.files} model files ({report.bytes} bytes), "
          f"{tables or 'no rows'}, {report.queries} queries")
    return 0


def _forget_token(args: argparse.Namespace) -> int:
    prog = "nexus db forget-token"
    if why := _url_error(args.database, "--database"):
        return _error(prog, why, 2)
    # lazy: the database modules (and sqlite3) add ~5 ms to every nexus command's start-up, --help included
    from globalsched.state.database.cluster_token import forget_token
    from globalsched.state.database.connection import PostgresConnection  # lazy: as above

    try:
        db = PostgresConnection(args.database, application_name="nexus-db")
    except ConnectionError as exc:
        return _error(prog, str(exc), 1)
    try:
        forgot = forget_token(db)
    finally:
        db.close()
    print("forgot the cluster token's fingerprint: the next scheduler to start records its own" if forgot
          else "no cluster token was recorded")
    return 0


def register(sub) -> None:
    p = sub.add_parser("db", help="manage the model database", description="manage the model database")
    dbsub = p.add_subparsers(dest="db_command", metavar="COMMAND", required=True)
    m = dbsub.add_parser("migrate", help="copy a SQLite model database into PostgreSQL",
                         description="Copy a scheduler's SQLite model database (models, versions, profiles, "
                                     "queries and model files) into an empty PostgreSQL database. Stop that "
                                     "scheduler first; the source is only read. Then start every scheduler with "
                                     "--database and the same URL.")
    m.add_argument("--from", dest="source", required=True, help="sqlite:DIR, the old scheduler's --data-dir")
    m.add_argument("--to", dest="dest", required=True,
                   help="postgresql://USER@HOST:PORT/DATABASE (password from PGPASSWORD or a PGPASSFILE)")
    m.set_defaults(func=_migrate)
    f = dbsub.add_parser("forget-token", help="forget the cluster token's fingerprint (to rotate the token)",
                         description="Forget the fingerprint of the cluster token that the schedulers sharing this "
                                     "database recorded, so that schedulers with a new token may start. Stop every "
                                     "scheduler first.")
    f.add_argument("--database", required=True,
                   help="postgresql://USER@HOST:PORT/DATABASE (password from PGPASSWORD or a PGPASSFILE)")
    f.set_defaults(func=_forget_token)
