"""`spectuner db upgrade|current|downgrade` on SQLite and PostgreSQL: output, JSON, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.store import current_revision, head_revision
from tuner.store.schema import script_directory

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]


def db(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = runner.invoke(app, ["db", *args], env=env)
    return result.exit_code, result.output


def test_upgrade_current_downgrade_round_trip(empty_db_url: str) -> None:
    code, out = db("current", "--db", empty_db_url, "--json")
    assert code == 0
    state = json.loads(out)
    assert state["revision"] is None and state["state"] == "missing"
    assert state["fix"] == f"create it with `spectuner db upgrade --db {empty_db_url}`"

    code, out = db("upgrade", "--db", empty_db_url, "--json")
    assert code == 0, out
    assert json.loads(out) == {"db": empty_db_url, "from": None, "to": head_revision()}

    code, out = db("current", "--db", empty_db_url, "--json")
    assert json.loads(out)["state"] == "up_to_date" and json.loads(out)["up_to_date"] is True

    code, out = db("downgrade", "-1", "--db", empty_db_url, "--json")  # `-1` must read as the revision
    assert code == 0, out
    previous = script_directory().get_revision(head_revision()).down_revision
    assert json.loads(out)["to"] == previous

    code, out = db("current", "--db", empty_db_url)
    assert code == 0
    assert f"revision {previous}" in out and f"run `spectuner db upgrade --db {empty_db_url}`" in out

    code, out = db("upgrade", "--db", empty_db_url)
    assert code == 0 and f"from {previous} to {head_revision()}" in out
    code, out = db("upgrade", "--db", empty_db_url)
    assert code == 0 and f"already at revision {head_revision()}" in out


def test_downgrade_defaults_to_one_step(empty_db_url: str) -> None:
    assert db("upgrade", "--db", empty_db_url)[0] == 0
    code, out = db("downgrade", "--db", empty_db_url, "--json")
    assert code == 0, out
    assert current_revision(empty_db_url) == script_directory().get_revision(head_revision()).down_revision


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert db("upgrade", "--db", url)[0] == 0
    code, out = db("downgrade", "nope", "--db", url)
    assert code == 2 and "Known revisions" in out
    code, out = db("upgrade", "--db", "mysql://u@h/db")
    assert code == 2 and "unsupported database 'mysql'" in out
    code, out = db("upgrade", "--db", "postgresql+psycopg2://u@h/db")
    assert code == 2 and "psycopg 3" in out
    code, out = db("upgrade", "--db", f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    assert code == 2 and "does not exist" in out
    code, out = db("downgrade", "--db", f"sqlite:///{tmp_path / 'missing.db'}")
    assert code == 2 and "nothing to downgrade" in out


def test_unreachable_database_is_a_runtime_failure_and_hides_the_password() -> None:
    code, out = db("current", "--db", "postgresql://spectuner:hunter2@127.0.0.1:1/spectuner")
    assert code == 1
    assert "cannot use the database" in out and "hunter2" not in out and "***" in out


def test_db_url_from_environment_then_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_url = f"sqlite:///{tmp_path / 'from-env.db'}"
    code, out = db("upgrade", "--json", env={"SPECTUNER_DB": env_url})
    assert code == 0 and json.loads(out)["db"] == env_url
    config = tmp_path / "conf" / "spectuner.toml"
    config.parent.mkdir()
    config.write_text("")
    monkeypatch.delenv("SPECTUNER_DB", raising=False)
    code, out = db("upgrade", "--config", str(config), "--json")
    assert code == 0, out
    assert json.loads(out)["db"] == f"sqlite:///{config.parent / 'spectuner.db'}"
    assert (config.parent / "spectuner.db").exists()


def test_the_installed_command_runs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECTUNER_DB", None)
    result = subprocess.run(
        [sys.executable, "-m", "tuner.cli.main", "db", "upgrade", "--db", url, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["to"] == head_revision()


def test_a_downgrade_that_loses_rows_says_what_and_asks(db_url: str) -> None:
    from datetime import UTC, datetime

    from tuner.controller import manual
    from tuner.store import Store

    with Store(db_url) as store:
        manual.pause(store, datetime.now(UTC), by="ops", note="keep me")
    refused = runner.invoke(app, ["db", "downgrade", "base", "--db", db_url])
    assert refused.exit_code == 2, refused.output
    assert "decisions (1 rows)" in refused.stderr and "Back it up first" in refused.stderr
    assert current_revision(db_url) == head_revision()  # nothing dropped
    with Store(db_url) as store:
        assert manual.active_pauses(store)
    done = runner.invoke(app, ["db", "downgrade", "base", "--yes", "--db", db_url])
    assert done.exit_code == 0, done.output
    assert current_revision(db_url) is None


def test_upgrade_refuses_another_applications_database(empty_db_url: str) -> None:
    from sqlalchemy import text

    from tuner.store.connect import make_engine

    engine = make_engine(empty_db_url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE invoices (id INTEGER PRIMARY KEY, amount INTEGER)"))
    engine.dispose()
    code, out = db("upgrade", "--db", empty_db_url)
    assert code == 2 and "invoices" in out and "--allow-foreign-tables" in out
    assert current_revision(empty_db_url) is None
    code, out = db("upgrade", "--allow-foreign-tables", "--db", empty_db_url)
    assert code == 0, out
    assert current_revision(empty_db_url) == head_revision()
