"""PostgreSQL connection URLs as ``--database`` takes them: checked before anything connects, and
redacted wherever they are shown."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit


class DatabaseUrlError(ValueError):
    """A ``--database`` value that names no database this release can open; the message says why."""


def check_postgres_url(url: str) -> str:
    """``url`` when it is a PostgreSQL connection URL without a password, else :class:`DatabaseUrlError`."""
    parts = urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise DatabaseUrlError(f"--database {redact(url)!r}: expected postgresql://USER@HOST:PORT/DATABASE")
    if parts.password is not None or "password" in parse_qs(parts.query):
        raise DatabaseUrlError(
            "--database: the URL carries a password; give it in PGPASSWORD, a PGPASSFILE (~/.pgpass) or the "
            "URL's passfile= parameter, never on the command line")
    if not parts.path.strip("/"):
        raise DatabaseUrlError(f"--database {redact(url)!r}: name the database (postgresql://USER@HOST:PORT/DATABASE)")
    try:
        parts.port
    except ValueError:
        raise DatabaseUrlError(f"--database {redact(url)!r}: the port is not a number") from None
    return url


def redact(url: str) -> str:
    """The URL as it may be logged: any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()
