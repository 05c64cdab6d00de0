"""Database URL resolution (docs/architecture.md: --db, else $SPECTUNER_DB, else sqlite beside the config)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.store import DatabaseUrlError, resolve_db_url
from tuner.store.url import normalize_db_url, render_url


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECTUNER_DB", "postgresql://env@db/spectuner")
    assert resolve_db_url("sqlite:////var/lib/x.db") == "sqlite:////var/lib/x.db"
    assert resolve_db_url(None) == "postgresql+psycopg://env@db/spectuner"
    monkeypatch.setenv("SPECTUNER_DB", "  ")
    config = tmp_path / "etc" / "spectuner.toml"
    assert resolve_db_url(None, config) == f"sqlite:///{tmp_path / 'etc' / 'spectuner.db'}"
    monkeypatch.delenv("SPECTUNER_DB")
    monkeypatch.chdir(tmp_path)
    assert resolve_db_url("") == f"sqlite:///{tmp_path / 'spectuner.db'}"


def test_normalisation_and_refusals() -> None:
    assert normalize_db_url("postgres://u@h:5433/d") == "postgresql+psycopg://u@h:5433/d"
    assert normalize_db_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    with pytest.raises(DatabaseUrlError, match="psycopg 3"):
        normalize_db_url("postgresql+asyncpg://u@h/d")
    with pytest.raises(DatabaseUrlError, match="in-memory"):
        normalize_db_url("sqlite://")
    with pytest.raises(DatabaseUrlError, match="cannot parse"):
        normalize_db_url("not a url")
    with pytest.raises(DatabaseUrlError, match="unsupported database 'mysql'"):
        normalize_db_url("mysql://u@h/d")


def test_passwords_never_reach_messages() -> None:
    assert render_url("postgresql://u:s3cret@h/d") == "postgresql://u:***@h/d"
    assert normalize_db_url("postgresql://u:s3cret@h/d") == "postgresql+psycopg://u:s3cret@h/d"
