"""A throwaway PostgreSQL cluster for the tests: Debian's PostgreSQL binaries, a temporary
directory, a free port; started once per test session (see the ``pg`` fixture in conftest.py).

``initdb`` refuses to run as root, so as root the server runs as the ``postgres`` user in a
directory that user owns. Authentication is ``trust`` except for the role ``pwuser`` (password
``right``, scram-sha-256), which the wrong-credentials test uses. The server listens on
127.0.0.1 and on the addresses a test adds (:meth:`PgCluster.listen_on`: the host ends of the
veth pairs of its network namespaces).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGE = "postgresql"  # Debian's package with initdb / pg_ctl
REQUIRE_ENV = "DFLASH_REQUIRE_POSTGRES"  # set (CI): no PostgreSQL is a failure, not a skip


def find_bindir() -> Path | None:
    """Where initdb and pg_ctl are: $PG_BINDIR, else the newest /usr/lib/postgresql/*/bin, else PATH."""
    cands = [os.environ.get("PG_BINDIR", "")] + sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for c in cands:
        if c and (Path(c) / "initdb").is_file() and (Path(c) / "pg_ctl").is_file():
            return Path(c)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgCluster:
    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="dflash-pg-"))
        self.data, self.log = self.root / "data", self.root / "log"
        self.port = free_port()
        self.listen = ["127.0.0.1"]
        self.user = None
        if os.geteuid() == 0:  # initdb refuses root: run the server as postgres
            self.user = "postgres"
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        os.chmod(self.root, 0o755)
        self._names = 0

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / args[0]), *args[1:]]
        if self.user:
            cmd = ["runuser", "-u", self.user, "--"] + cmd
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=120)

    def init(self, durable: bool = False) -> PgCluster:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        hba = self.data / "pg_hba.conf"
        hba.write_text(
            "local all all trust\n"
            "host all pwuser 127.0.0.1/32 scram-sha-256\n"
            "host all all 127.0.0.1/32 trust\n"
            "host all all 10.231.0.0/16 trust\n"
        )
        # A test server: durability costs (fsync) off unless `durable`; the server is only ever stopped,
        # never the host (committed data survives `-m immediate` in the page cache). See
        # docs/multinode.md for the settings a real run needs.
        with open(self.data / "postgresql.conf", "a") as f:
            f.write(
                ("" if durable else "\nfsync = off\nfull_page_writes = off") + "\nmax_connections = 200\n"
                "shared_buffers = 64MB\nunix_socket_directories = ''\n"
            )
        return self

    def start(self) -> None:
        opts = f"-p {self.port} -c listen_addresses='{','.join(self.listen)}'"
        r = self._run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-o",
            opts,
            "-l",
            str(self.log),
            "-w",
            "-t",
            "60",
            "start",
            check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {r.stdout}{r.stderr}\n{self.log_tail()}")

    def stop(self, mode: str = "immediate") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop", check=False)

    def restart(self) -> None:
        self.stop()
        self.start()

    def listen_on(self, addrs: list[str]) -> None:
        """Listen on 127.0.0.1 plus ``addrs`` (restarts the server)."""
        self.listen = ["127.0.0.1"] + list(addrs)
        self.restart()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text()[-n:]
        except OSError:
            return ""

    def url(
        self,
        name: str | None = None,
        host: str = "127.0.0.1",
        user: str = "postgres",
        db: str = "postgres",
        password: str | None = None,
    ) -> str:
        """A manifest address; a fresh manifest name unless ``name`` is given."""
        if name is None:
            self._names += 1
            name = f"t{os.getpid()}_{self._names}_{int(time.time() * 1000) % 10**8}"
        auth = f"{user}:{password}" if password is not None else user
        return f"postgresql://{auth}@{host}:{self.port}/{db}#{name}"

    def sql(self, statement: str, db: str = "postgres") -> str:
        """Run an administrative statement with psql (the server's own client)."""
        r = subprocess.run(
            [
                str(self.bindir / "psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                db,
                "-v",
                "ON_ERROR_STOP=1",
                "-qAtc",
                statement,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode != 0:
            raise RuntimeError(f"psql {statement!r}: {r.stderr}")
        return r.stdout

    def schemas(self, db: str = "postgres") -> set[str]:
        return set(self.sql("SELECT nspname FROM pg_namespace", db).split())

    def terminate_clients(self, application: str = "dflash-staged") -> None:
        """End every session of ``application`` (what a server restart does to them)."""
        self.sql(
            f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{application}'"
        )

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_cluster(durable: bool = False) -> PgCluster:
    bindir = find_bindir()
    if bindir is None:
        raise FileNotFoundError(
            f"no PostgreSQL server binaries (initdb, pg_ctl); install the {PACKAGE!r} package "
            f"(apt-get install {PACKAGE}) or set PG_BINDIR"
        )
    c = PgCluster(bindir).init(durable)
    c.start()
    c.sql("CREATE ROLE pwuser LOGIN PASSWORD 'right'")
    c.sql("CREATE ROLE noperm LOGIN")  # may connect, may not create schemas
    return c


# ---------------------------------------------------------------------------------------------- fixtures
try:
    import pytest
except ImportError:  # pragma: no cover - the module is also a plain helper
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="session")
    def pg():
        """The session's PostgreSQL cluster. Without the server binaries or the driver the tests that use
        it are skipped, naming what to install; with DFLASH_REQUIRE_POSTGRES=1 (CI) they fail instead."""
        from dflash_staged.manifest.postgres.conn import driver
        from dflash_staged.manifest.states import ManifestError

        required = os.environ.get(REQUIRE_ENV) == "1"
        try:
            driver()  # the PostgreSQL driver of the [postgres] extra
        except ManifestError as e:
            pytest.fail(str(e)) if required else pytest.skip(str(e))
        try:
            cluster = start_cluster()
        except (FileNotFoundError, RuntimeError, subprocess.SubprocessError) as e:
            pytest.fail(str(e)) if required else pytest.skip(str(e))
        yield cluster
        cluster.destroy()

    BOTH = ["sqlite", "postgres"]  # for @pytest.mark.parametrize("backend", ..., indirect=True)
    PG_SLOW = ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)]  # the PostgreSQL variant is `slow`

    @pytest.fixture(params=BOTH)
    def backend(request):
        """Each manifest backend in turn: ``backend.name``, and ``backend.address(tmp_path, name)``."""
        cluster = request.getfixturevalue("pg") if request.param == "postgres" else None

        class Backend:
            name = request.param
            pg = cluster

            @staticmethod
            def address(tmp_path: Path, name: str = "manifest"):
                return tmp_path / name if cluster is None else cluster.url()

        return Backend
