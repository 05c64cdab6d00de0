"""A throwaway PostgreSQL server for tests and benchmarks: Debian's PostgreSQL 15 binaries,
``initdb`` into a temp dir, ``pg_ctl start`` on a free loopback port, socket dir inside the temp dir.

PostgreSQL refuses to run as root, so as root every server command runs as the ``postgres`` system
user (created by the Debian package) through ``runuser``, and the temp dir is handed to that user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

DEFAULT_BIN_DIR = "/usr/lib/postgresql/15/bin"
BIN_DIR_ENV = "SPECTUNER_PG_BIN"
INSTALL_HINT = (
    "run `make test` (it installs them) or `apt-get install -y postgresql-15` (Debian 12), "
    f"or point ${BIN_DIR_ENV} at a PostgreSQL bin directory with initdb and pg_ctl"
)


class PostgresUnavailable(RuntimeError):
    """The server binaries are missing or the server would not start; the message says what to do."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PostgresServer:
    """Start with :meth:`start`, stop with :meth:`stop` (or use as a context manager)."""

    def __init__(self, *, bin_dir: str | None = None, fsync: bool = False, max_connections: int = 50) -> None:
        self.bin_dir = Path(bin_dir or os.environ.get(BIN_DIR_ENV) or DEFAULT_BIN_DIR)
        self.fsync = fsync  # off for tests (speed); on for benchmarks (honest numbers)
        self.max_connections = max_connections  # a fleet benchmark holds a few per simulated sidecar
        self.port = 0
        self.root: Path | None = None
        self._run_as: list[str] = []
        self._db_counter = 0

    # --- life cycle -----------------------------------------------------------------------------

    def start(self) -> PostgresServer:
        for tool in ("initdb", "pg_ctl", "postgres"):
            if not (self.bin_dir / tool).is_file():
                raise PostgresUnavailable(f"PostgreSQL server binary {self.bin_dir / tool} not found: {INSTALL_HINT}")
        self.root = Path(tempfile.mkdtemp(prefix="spectuner-pg-"))
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError as exc:
                raise PostgresUnavailable(
                    f"running as root and there is no `postgres` user to run the server as: {INSTALL_HINT}"
                ) from exc
            if shutil.which("runuser") is None:
                raise PostgresUnavailable("running as root needs `runuser` (util-linux) to drop to `postgres`")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._run_as = ["runuser", "-u", "postgres", "--"]
        data = self.root / "data"
        self._run(
            "initdb",
            "-D",
            str(data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C",
            "--no-sync",
        )
        last_error = ""
        for _attempt in range(3):  # another process may grab the port between probe and bind
            self.port = _free_port()
            options = (
                f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                f"-c fsync={'on' if self.fsync else 'off'} -c max_connections={self.max_connections} "
                f"-c shared_buffers=64MB"
            )
            if not self.fsync:
                options += " -c synchronous_commit=off -c full_page_writes=off"
            result = self._run(
                "pg_ctl",
                "-D",
                str(data),
                "-l",
                str(self.root / "server.log"),
                "-o",
                options,
                "-w",
                "-t",
                "60",
                "start",
                check=False,
            )
            if result.returncode == 0:
                return self
            last_error = result.stdout + result.stderr + self._log_tail()
        self.stop()
        raise PostgresUnavailable(f"PostgreSQL would not start:\n{last_error}")

    def stop(self) -> None:
        if self.root is None:
            return
        data = self.root / "data"
        if (data / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "-t", "30", "stop", check=False)
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- databases ------------------------------------------------------------------------------

    def url(self, database: str = "postgres") -> str:
        """SQLAlchemy URL (psycopg 3 driver)."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres") -> str:
        """libpq connection string, for psycopg directly."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str | None = None, template: str | None = None) -> str:
        """Create a database (optionally from a template) and return its URL."""
        import psycopg

        if name is None:
            self._db_counter += 1
            name = f"t{os.getpid()}_{self._db_counter}_{int(time.time() * 1000) % 100000}"
        sql = f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else "")
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(sql)
        return self.url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    # --- helpers --------------------------------------------------------------------------------

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [*self._run_as, str(self.bin_dir / tool), *args]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=self.root, timeout=120)
        if check and result.returncode != 0:
            raise PostgresUnavailable(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}{result.stderr}")
        return result

    def postmaster_pid(self) -> int | None:
        """The server's main process id (its backends are its children), or None when stopped."""
        if self.root is None:
            return None
        with contextlib.suppress(OSError, ValueError, IndexError):
            return int((self.root / "data" / "postmaster.pid").read_text().splitlines()[0])
        return None

    def _log_tail(self) -> str:
        if self.root is None:
            return ""
        with contextlib.suppress(OSError):
            return (self.root / "server.log").read_text()[-2000:]
        return ""


@contextlib.contextmanager
def postgres_server(*, fsync: bool = False) -> Iterator[PostgresServer]:
    server = PostgresServer(fsync=fsync)
    server.start()
    try:
        yield server
    finally:
        server.stop()
