"""Every CLI command, driven with hostile arguments and bad databases: each must exit 1 or 2 with one
line on stderr and never a traceback.

In-process through the typer app (one import for all cases), so the whole file takes seconds. The
bad stores are real files: not a database, two rows in ``alembic_version``, a revision from the
future, a directory that is a file, an unwritable directory (as a non-root user only), and a
PostgreSQL URL nobody listens on.
"""

from __future__ import annotations

import os
import socket
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.store import upgrade

pytestmark = pytest.mark.integration

runner = CliRunner()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def bad_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("bad_stores")
    good = root / "good.db"
    upgrade(f"sqlite:///{good}")
    (root / "not_a_db.db").write_bytes(b"\x00\x01 this is not sqlite \xff" * 100)
    two = root / "two_rows.db"
    two.write_bytes(good.read_bytes())
    future = root / "future.db"
    future.write_bytes(good.read_bytes())
    with sqlite3.connect(two) as conn:
        conn.execute("INSERT INTO alembic_version VALUES ('9999_other')")
    with sqlite3.connect(future) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    stores = {
        "not_a_database": f"sqlite:///{root / 'not_a_db.db'}",
        "two_alembic_rows": f"sqlite:///{two}",
        "future_revision": f"sqlite:///{future}",
        "parent_is_a_file": f"sqlite:///{root / 'not_a_db.db' / 'spectuner.db'}",
        "unreachable_postgres": f"postgresql://spectuner:secret@127.0.0.1:{_closed_port()}/spectuner",
    }
    if os.geteuid() != 0:  # root writes anywhere: the case only means something for other users
        locked = root / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        stores["unwritable_directory"] = f"sqlite:///{locked / 'spectuner.db'}"
    return stores


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "spectuner.toml"
    path.write_text(
        '[engine]\nmetrics_url = "http://127.0.0.1:9"\n[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 3\n'
    )
    return path


@pytest.fixture(scope="module")
def engine() -> str:
    """An engine URL nobody answers on: every case must fail before, or because of, that."""
    return f"http://127.0.0.1:{_closed_port()}"


def _fill(args: list[str], values: dict[str, str]) -> list[str]:
    """``{name}`` placeholders replaced (not str.format: JSON arguments hold braces)."""
    out = []
    for arg in args:
        for name, value in values.items():
            arg = arg.replace("{" + name + "}", value)
        out.append(arg)
    return out


def assert_clean_failure(args: list[str], *, allowed: tuple[int, ...] = (1, 2)) -> None:
    result = runner.invoke(app, args)
    shown = f"spectuner {' '.join(args)} → exit {result.exit_code}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert result.exception is None or isinstance(result.exception, SystemExit), shown
    assert result.exit_code in allowed, shown
    assert "Traceback" not in result.stdout + result.stderr, shown
    if result.exit_code != 0:
        first, *rest = [line for line in result.stderr.splitlines() if line.strip()]
        assert first.startswith("error:"), shown
        assert "unexpected" not in first, shown  # the boundary's net caught it: a command missed a check
        # One line; only a config with several problems lists them, one "  - key: problem" each.
        assert all(line.startswith("  - ") for line in rest), shown


# Every command that opens the database, with what it needs besides --db. {cfg} is a valid config.
STORE_COMMANDS: dict[str, list[str]] = {
    "status": ["status"],
    "status --fleet": ["status", "--fleet"],
    "history": ["history"],
    "apply": ["apply", "--draft", "ngram", "--k", "2", "--yes", "--config", "{cfg}"],
    "pause": ["pause", "--note", "fuzz"],
    "resume": ["resume"],
    "drafts list": ["drafts", "list"],
    "drafts add": ["drafts", "add", "fuzz", "--method", "ngram"],
    "drafts remove": ["drafts", "remove", "fuzz"],
    "collect": ["collect", "--url", "{engine}", "--once", "--interval-s", "0.01"],
    "tap": ["tap", "--upstream", "{engine}", "--listen", "127.0.0.1:{port}"],
    "db upgrade": ["db", "upgrade"],
    "db current": ["db", "current"],
    "db downgrade": ["db", "downgrade", "base"],
    "report": ["report", "--out", "{out}"],
    "run --check": ["run", "--config", "{cfg}", "--check"],
}
STORES = [
    "not_a_database",
    "two_alembic_rows",
    "future_revision",
    "parent_is_a_file",
    "unreachable_postgres",
    "unwritable_directory",
]


@pytest.mark.parametrize("store_name", STORES)
@pytest.mark.parametrize("command", list(STORE_COMMANDS))
def test_every_command_on_a_bad_store_fails_in_one_line(
    command: str,
    store_name: str,
    bad_stores: dict[str, str],
    config_file: Path,
    engine: str,
    tmp_path: Path,
) -> None:
    if store_name not in bad_stores:
        pytest.skip("a directory cannot be made unwritable for root")
    fill = {"cfg": str(config_file), "engine": engine, "port": str(_closed_port()), "out": str(tmp_path / "r")}
    args = [*_fill(STORE_COMMANDS[command], fill), "--db", bad_stores[store_name]]
    # `db current` is the diagnosis: "written by a newer spectuner" and "no schema yet" are answers.
    diagnosis = command == "db current" and store_name in (
        "future_revision",
        "parent_is_a_file",
        "unwritable_directory",
    )
    allowed = (0, 1, 2) if diagnosis else (1, 2)
    assert_clean_failure(args, allowed=allowed)


HOSTILE: list[list[str]] = [
    ["recommend", "--alpha", "nan", "--cost-ratio", "0.1", "--k-max", "5"],
    ["recommend", "--alpha", "inf", "--cost-ratio", "0.1", "--k-max", "5"],
    ["recommend", "--alpha", "0.7", "--cost-ratio", "inf", "--k-max", "5"],
    ["recommend", "--alpha", "0.7", "--cost-ratio", "nan", "--k-max", "5"],
    ["recommend", "--alpha", "0.7", "--cost-ratio", "0.1", "--k-max", "1000000"],
    ["recommend", "--alpha", "0.7", "--cost-ratio", "0.1", "--k-max", "5", "--batch-sizes", "1-100000000"],
    ["recommend", "--alpha", "0.7", "--cost-ratio", "0.1", "--k-max", "5", "--batch-sizes", "nan"],
    ["recommend", "--alpha", "0.7", "--cost-ratio", "0.1", "--k-max", "5", "--budget-bytes", "999999999999TiB"],
    ["collect", "--url", "{engine}", "--once", "--interval-s", "nan", "--db", "{db}"],
    ["collect", "--url", "{engine}", "--once", "--interval-s", "inf", "--db", "{db}"],
    ["collect", "--url", "{engine}", "--once", "--interval-s", "-1", "--db", "{db}"],
    ["collect", "--url", "{engine}", "--once", "--timeout-s", "nan", "--db", "{db}"],
    ["collect", "--url", "{engine}", "--once", "--max-body-bytes", "0", "--db", "{db}"],
    ["collect", "--url", "http://[::1", "--once", "--db", "{db}"],
    ["collect", "--url", "ftp://127.0.0.1/metrics", "--once", "--db", "{db}"],
    ["collect", "--url", "{engine}", "--once", "--db", "mysql://root@127.0.0.1/x"],
    ["collect", "--url", "{engine}", "--once", "--db", "sqlite://"],
    ["tap", "--upstream", "not a url", "--listen", "127.0.0.1:{port}", "--db", "{db}"],
    ["tap", "--upstream", "{engine}", "--listen", "127.0.0.1:99999", "--db", "{db}"],
    ["tap", "--upstream", "{engine}", "--listen", "127.0.0.1:{port}", "--batch-size", "0", "--db", "{db}"],
    ["status", "--window-s", "nan", "--db", "{db}"],
    ["status", "--window-s", "inf", "--db", "{db}"],
    ["status", "--events-window-s", "-5", "--db", "{db}"],
    ["status", "--engine", "http://[::1", "--db", "{db}"],
    ["status", "--fleet", "--window-s", "nan", "--db", "{db}"],
    ["status", "--fleet", "--window-s", "-1", "--db", "{db}"],
    ["status", "--fleet", "--engine", "{engine}", "--db", "{db}"],
    ["status", "--fleet", "--config", "{binary}", "--db", "{db}"],
    ["history", "--since", "nanh", "--db", "{db}"],
    ["history", "--since", "99999999999999999999d", "--db", "{db}"],
    ["history", "--limit", "-1", "--db", "{db}"],
    ["apply", "--draft", "ngram", "--k", "1000", "--yes", "--db", "{db}"],
    ["apply", "--draft", "ngram", "--k", "-1", "--yes", "--config", "{cfg}", "--db", "{db}"],
    ["apply", "--config-json", '{"method": "ngram", "num_speculative_tokens": 2, "evil": 1}', "--yes", "--db", "{db}"],
    ["apply", "--config-json", "[1, 2", "--yes", "--db", "{db}"],
    ["apply", "--draft", "ngram", "--k-table", "[[1, 100000000, 2]]", "--yes", "--config", "{cfg}", "--db", "{db}"],
    ["drafts", "add", "x", "--method", "no-such-method", "--db", "{db}"],
    ["estimate", "--metrics-file", "{binary}"],
    ["estimate", "--metrics-file", "{missing}"],
    ["estimate", "--metrics-file", "/dev/null"],
    ["estimate", "--metrics-file", "{good_page}", "--confidence", "nan"],
    ["report", "--out", "{out}", "--since", "inf", "--db", "{db}"],
    ["report", "--out", "{binary}", "--db", "{db}"],
    ["run", "--config", "{missing}", "--check"],
    ["run", "--config", "{binary}", "--check"],
    ["db", "downgrade", "no-such-revision", "--db", "{db}"],
    ["db", "upgrade", "--revision", "no-such-revision", "--db", "{db}"],
    ["simulate", "--scenario", "{missing}"],
    ["simulate", "--scenario", "{binary}"],
    ["lab", "serve", "--k", "-3", "--models-dir", "{missing}"],
    ["lab", "load", "--url", "http://[::1", "--count", "1"],
    ["demo", "--models-dir", "{binary}"],
    ["demo", "--recipe", "huge", "--models-dir", "{missing}"],
    ["lab", "build-models", "{missing}", "--recipe", "huge"],
    ["lab", "calibrate", "--models-dir", "{missing}"],
    ["lab", "calibrate", "--models-dir", "{binary}"],
    ["lab", "calibrate", "--streams", "1,,x", "--models-dir", "{missing}"],
]


@pytest.mark.parametrize("args", HOSTILE, ids=lambda a: " ".join(a)[:70])
def test_hostile_arguments_fail_in_one_line(
    args: list[str], bad_stores: dict[str, str], config_file: Path, engine: str, tmp_path: Path
) -> None:
    good = tmp_path / "good.db"
    upgrade(f"sqlite:///{good}")
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    page = tmp_path / "page.prom"
    page.write_text(Path(__file__).parents[1].joinpath("data", "lab_metrics_good_k3.prom").read_text())
    fill = {
        "db": f"sqlite:///{good}",
        "cfg": str(config_file),
        "engine": engine,
        "port": str(_closed_port()),
        "out": str(tmp_path / "r"),
        "binary": str(binary),
        "missing": str(tmp_path / "missing"),
        "good_page": str(page),
    }
    assert_clean_failure(_fill(args, fill))
