"""Connections of the PostgreSQL manifest: its address, connecting, and riding out a lost connection.

Address::

    postgresql://[USER[:PASSWORD]@]HOST[:PORT]/DB[?LIBPQ_PARAMS]#NAME      (postgres:// too)

NAME is the manifest: a schema of its own in DB, so several runs share one server. It is 1-63
characters of ``A-Z a-z 0-9 _ -`` and does not start with ``pg_``. Anything libpq takes
(``sslmode=require``, ``~/.pgpass``, ``PGPASSWORD``) works as it does for psql. Messages name
the address without its password.

Every session sets ``search_path`` to NAME, turns TCP keepalives and ``tcp_user_timeout`` on (a dead
link is noticed in seconds, not after the kernel's two hours), and sets
``idle_in_transaction_session_timeout`` (the server ends a transaction whose client vanished
midway and releases its row locks). A first connection that fails is bad input and fails at once
with one line saying what to fix (unreachable server, refused credentials, no such database).

**Lost connection.** Each manifest operation is one function run in one transaction
(:meth:`Session.run`). When the connection breaks (server restart, network loss), it is
reconnected with exponential backoff (0.1 s doubling to 2 s) for up to ``DFLASH_PG_RETRY_S``
seconds (default :data:`RETRY_S`), and the operation runs again from the start, told that it is a
retry: the transaction in flight either committed or did not, and every operation of
:class:`~dflash_staged.manifest.postgres.PostgresManifest` is written to be right either way.
Past the bound the operation raises :class:`ManifestError` naming the server, and the handle
refuses further use at once, so the process stops cleanly; nothing half-done is recorded, since
a transaction that did not commit changed nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dflash_staged.manifest.states import ManifestError

SCHEMES = ("postgresql://", "postgres://")
RETRY_S = 120.0  # how long a lost connection is retried before the process stops
CONNECT_TIMEOUT_S = 5
IDLE_TX_TIMEOUT_S = 15  # a transaction whose client went silent is ended by the server after this
INSTALL = "pip install 'dflash-staged[postgres]'"
DRIVER = "psycopg"  # the module of the [postgres] extra
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,63}$")


def retry_s() -> float:
    return float(os.environ.get("DFLASH_PG_RETRY_S") or RETRY_S)


def driver():
    """The psycopg 3 module, or one line naming the extra to install."""
    try:
        import psycopg as pg
        import psycopg.rows  # noqa: F401
        import psycopg.sql  # noqa: F401
    except ImportError:
        raise ManifestError(f"a postgresql:// manifest needs psycopg 3: {INSTALL}") from None
    return pg


@dataclass(frozen=True)
class PgAddress:
    url: str  # libpq URL without the fragment
    name: str  # the manifest (schema) name
    display: str  # the address without a password, for messages
    server: str  # host:port
    db: str
    user: str | None

    @classmethod
    def parse(cls, address) -> PgAddress:
        text = str(address)
        url, _, name = text.partition("#")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            raise ManifestError(f"manifest address {text!r} is not a valid postgresql:// URL ({e})") from None
        db = parts.path.lstrip("/")
        if not name or not db:
            raise ManifestError(
                f"manifest address {_hide(text)!r} needs a database and a manifest name: "
                "postgresql://USER@HOST:PORT/DB#NAME"
            )
        if not _NAME.match(name) or name.lower().startswith("pg_"):
            raise ManifestError(
                f"manifest name {name!r} in {_hide(text)!r}: use 1-63 letters, digits, '_' or '-' "
                "(not starting with pg_)"
            )
        server = f"{parts.hostname or 'localhost'}:{port or 5432}"
        return cls(url=url, name=name, display=_hide(text), server=server, db=db, user=parts.username)


def _hide(text: str) -> str:
    """The address with its password replaced by ***."""
    return re.sub(r"^(\w+://[^:/@#?]*):[^@/#?]*@", r"\1:***@", text)


def _detail(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return re.sub(
        r"^(connection failed: )?(connection to server at [^:]*(, port \d+)? failed: )?(FATAL: +)?", "", text
    )[:300]


def connect_error(addr: PgAddress, e: BaseException) -> str:
    """One line saying what to fix, for a connection that could not be made."""
    detail, low = _detail(e), str(e).lower()
    if any(
        w in low
        for w in (
            "password authentication failed",
            "no password supplied",
            "pg_hba.conf",
            "authentication failed",
        )
    ) or re.search(r'role ".*" does not exist', low):
        return (
            f"PostgreSQL server {addr.server} refused user {addr.user or '(default)'!r} ({detail}): "
            f"fix the user or password in the manifest address {addr.display!r} "
            "(or in ~/.pgpass / PGPASSWORD)"
        )
    if re.search(r'database ".*" does not exist', low):
        return (
            f"database {addr.db!r} does not exist on PostgreSQL server {addr.server}: create it "
            f"(createdb -h {addr.server.rsplit(':', 1)[0]} {addr.db}) or fix the manifest address "
            f"{addr.display!r}"
        )
    return (
        f"cannot reach PostgreSQL server {addr.server} for manifest {addr.display!r} ({detail}): "
        "check the host and port in the address and that the server runs"
    )


def one(cur, q: str, args: tuple = ()) -> dict | None:
    """The first row of statement ``q`` run on cursor ``cur``, or None."""
    return cur.execute(q, args).fetchone()


class Session:
    """One connection to the manifest's server, used by one thread; see the module docstring."""

    def __init__(self, addr: PgAddress, *, readonly: bool = False, schema: bool = True):
        self.addr, self.readonly, self.schema = addr, readonly, schema
        self._pg = driver()
        self._gone: str | None = None
        try:
            self._conn = self._connect()
        except self._pg.OperationalError as e:
            raise ManifestError(connect_error(addr, e)) from None

    def _connect(self):
        pg = self._pg
        params: dict[str, Any] = {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "keepalives": 1,
            "keepalives_idle": 5,
            "keepalives_interval": 2,
            "keepalives_count": 3,
            "tcp_user_timeout": 10000,
            "application_name": "dflash-staged",
        }
        params.update(pg.conninfo.conninfo_to_dict(self.addr.url))
        conn = pg.connect(
            pg.conninfo.make_conninfo("", **params), autocommit=True, row_factory=pg.rows.dict_row
        )
        setup = [
            pg.sql.SQL("SET idle_in_transaction_session_timeout = {}").format(
                pg.sql.Literal(f"{IDLE_TX_TIMEOUT_S}s")
            )
        ]
        if self.schema:
            setup.append(pg.sql.SQL("SET search_path TO {}").format(pg.sql.Identifier(self.addr.name)))
        if self.readonly:
            setup.append(pg.sql.SQL("SET default_transaction_read_only = on"))
        for s in setup:
            conn.execute(s)
        return conn

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
            self._conn = None

    def _lost(self) -> bool:
        c = self._conn
        return c is None or c.closed or c.broken

    def run(self, body: Callable[[Any, bool], Any], retry: float | None = None, tx: bool = True):
        """``body(cursor, is_retry)`` in one transaction (with ``tx=False``: each statement its own);
        see the module docstring. ``retry`` (seconds) overrides the bound; with 0 a lost connection
        raises at once and the handle stays usable."""
        pg = self._pg
        if self._gone:
            raise ManifestError(self._gone)
        bound = retry_s() if retry is None else retry
        deadline, delay, again, said, rollbacks = None, 0.1, False, False, 0
        while True:
            try:
                if self._lost():
                    self.close()
                    self._conn = self._connect()
                with self._conn.transaction() if tx else contextlib.nullcontext():
                    with self._conn.cursor() as cur:
                        return body(cur, again)
            except pg.errors.ReadOnlySqlTransaction:
                raise ManifestError(f"{self.addr.display} is open read-only") from None
            except pg.errors.TransactionRollback:  # deadlock or serialization failure: nothing changed
                rollbacks += 1
                if rollbacks > 50:
                    raise ManifestError(
                        f"{self.addr.display}: a transaction kept failing with deadlocks"
                    ) from None
                again = True
                continue
            except (pg.OperationalError, pg.InterfaceError) as e:
                if not self._lost():
                    raise ManifestError(f"manifest {self.addr.display}: {_detail(e)}") from None
                self.close()
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + bound
                if now >= deadline:
                    msg = (
                        f"lost the connection to PostgreSQL server {self.addr.server} (manifest "
                        f"{self.addr.display!r}) and could not reconnect for {bound:.0f} s ({_detail(e)}); "
                        "nothing half-done was recorded: check the server and the network, then rerun "
                        "this command"
                    )
                    if retry is None:
                        self._gone = msg
                    raise ManifestError(msg) from None
                if not said and bound >= 1:
                    print(
                        "manifest: lost the connection to PostgreSQL server "
                        f"{self.addr.server} ({_detail(e)}); reconnecting for up to {bound:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    said = True
                time.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(2 * delay, 2.0)
                again = True
