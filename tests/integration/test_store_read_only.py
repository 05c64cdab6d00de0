"""Read-only commands (status, history, db current, report) on a SQLite file in a directory nobody
may write: they open it read-only and never need the WAL files.

The directory is made immutable with ``chattr +i`` (which binds root too); where that is not
possible, a non-root user gets the same from ``chmod 0555``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.store import Store, upgrade

pytestmark = pytest.mark.integration


def _lock(directory: Path) -> bool:
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return True
    if shutil.which("chattr") is None:
        return False
    return subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0


def _unlock(directory: Path) -> None:
    if os.geteuid() != 0:
        directory.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(directory)], capture_output=True)


@pytest.fixture
def locked_db(tmp_path: Path) -> Iterator[str]:
    directory = tmp_path / "ro"
    directory.mkdir()
    url = f"sqlite:///{directory / 'spectuner.db'}"
    upgrade(url)
    with Store(url) as store:  # something to read
        from tuner.controller import manual

        manual.pause(store, datetime.now(UTC), by="ops", note="read-only test")
    assert not list(directory.glob("*-wal")), "the writer left its WAL behind"
    if not _lock(directory):
        pytest.skip("cannot make a directory read-only here (no chattr)")
    try:
        assert not os.access(directory, os.W_OK)
        yield url
    finally:
        _unlock(directory)


@pytest.mark.parametrize(
    "args",
    [["status"], ["status", "--json"], ["history", "--json"], ["db", "current"], ["report", "--out", "{out}"]],
    ids=lambda a: " ".join(a),
)
def test_read_only_commands_work_in_a_read_only_directory(locked_db: str, args: list[str], tmp_path: Path) -> None:
    argv = [a.replace("{out}", str(tmp_path / "report")) for a in args] + ["--db", locked_db]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    if args[0] == "history":
        assert "read-only test" in result.stdout


def test_writing_commands_say_the_directory_is_not_writable(locked_db: str) -> None:
    result = CliRunner().invoke(app, ["db", "upgrade", "--db", locked_db])
    assert result.exit_code == 2 and "not writable" in result.stderr
    paused = CliRunner().invoke(app, ["pause", "--note", "x", "--db", locked_db])
    assert paused.exit_code in (1, 2) and "Traceback" not in paused.output
    assert len(paused.stderr.strip().splitlines()) == 1
