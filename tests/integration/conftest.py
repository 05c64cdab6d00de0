"""Integration fixtures: real databases.

``db_url`` is parametrised over SQLite and a real PostgreSQL 15 the session starts itself
(``tests/integration/pg.py``), so every store test runs on both. Each test gets a fresh database
copied from a migrated template (SQLite: a file copy; PostgreSQL: ``CREATE DATABASE ... TEMPLATE``),
so migrations run once per session. The server starts only when a PostgreSQL test runs; if its
binaries are missing the PostgreSQL tests FAIL (not skip) with the command that installs them.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.pg import PostgresServer, PostgresUnavailable
from tuner.store import Store, upgrade

BACKENDS = ("sqlite", "postgresql")
_PG_TEMPLATE = "spectuner_template"


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
    except PostgresUnavailable as exc:
        pytest.fail(f"PostgreSQL tests need a local PostgreSQL 15 server: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_template(pg_server: PostgresServer) -> str:
    """Name of a database migrated to head, used as the template of every test database."""
    upgrade(pg_server.create_database(_PG_TEMPLATE))
    return _PG_TEMPLATE


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh database at the current schema head."""
    if backend == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "spectuner.db"
        shutil.copyfile(template, path)
        yield f"sqlite:///{path}"
        return
    server: PostgresServer = request.getfixturevalue("pg_server")
    url = server.create_database(template=request.getfixturevalue("pg_template"))
    yield url
    server.drop_database(url.rsplit("/", 1)[1])


@pytest.fixture
def empty_db_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no schema at all (SQLite: a path whose file does not exist yet)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    server: PostgresServer = request.getfixturevalue("pg_server")
    url = server.create_database()
    yield url
    server.drop_database(url.rsplit("/", 1)[1])


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    with Store(db_url) as opened:
        yield opened
