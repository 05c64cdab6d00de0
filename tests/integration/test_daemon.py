"""`spectuner run` as a real subprocess, supervising the fake engine (a real server process): it
starts the engine, collects, decides, restarts the engine with a better K, verifies the gain, and
stops cleanly on SIGTERM (engine stopped, nothing left running). Then a restart of the daemon picks
the applied config up from the database."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.integration.engine_fixtures import fake_engine_argv
from tuner.cli.main import app
from tuner.config import load_config
from tuner.daemon import Daemon
from tuner.engine.process import free_port, group_alive
from tuner.store import AppliedBy, DecisionStatus, Store, upgrade

ROOT = Path(__file__).resolve().parents[2]


def write_config(path: Path, port: int, db_url: str, *, mode: str = "auto", engine_flags: tuple[str, ...] = ()) -> None:
    argv = json.dumps(fake_engine_argv(port, "--alpha", "0.8", "--cost-ratio", "0.05", *engine_flags))
    path.write_text(
        f"""
[engine]
metrics_url = "http://127.0.0.1:{port}"

[speculative]
method = "ngram"
num_speculative_tokens = 2

[actuator]
kind = "restart"

[actuator.restart]
argv = {argv}
startup_timeout_s = 30
shutdown_timeout_s = 2
log_path = "engine.log"

[policy]
k_max = 8
cost_ratio = 0.05
evidence_window_s = 5

[guardrails]
min_drafts = 300
min_evidence_s = 2
hysteresis_ticks = 2
cooldown_s = 5
restart_downtime_s = 1

[controller]
mode = "{mode}"
collect_interval_s = 0.5
decide_interval_s = 1
health_interval_s = 1
retention_interval_s = 30
verify_window_s = 3

[database]
url = "{db_url}"
"""
    )


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, proc: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"daemon exited with {proc.returncode} while waiting for {what}:\n{out}\n{err[-3000:]}")
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def served_k(port: int) -> int | None:
    try:
        cfg = httpx.get(f"http://127.0.0.1:{port}/info", timeout=2).json()["speculative_config"]
    except httpx.HTTPError:
        return None
    return int(cfg["num_speculative_tokens"]) if cfg else None


def nothing_listens(port: int) -> bool:
    # (not a bind test: the stopped server's closed connections leave the port in TIME_WAIT)
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def start_daemon(config: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "SPECTUNER_LOG": "INFO", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "tuner.cli.main", "run", "--config", str(config), "--json"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_leftovers(proc: subprocess.Popen[str], tmp_path: Path) -> None:
    """After a failed test: kill the daemon, then its engine (its own process group, via the pid file)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    with contextlib.suppress(OSError, ValueError):
        os.killpg(int((tmp_path / "engine.log.pid").read_text()), signal.SIGKILL)


def stop_daemon(proc: subprocess.Popen[str], timeout_s: float = 30) -> tuple[str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-3000:]
    return out, err


def test_daemon_closes_the_loop_and_stops_cleanly(tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db_url)
    port = free_port()
    config = tmp_path / "spectuner.toml"
    write_config(config, port, db_url)
    proc = start_daemon(config)
    try:
        wait_for("the engine at K = 2", lambda: served_k(port) == 2, 30, proc)
        engine_pgid = int((tmp_path / "engine.log.pid").read_text())
        with Store(db_url) as store:

            def applied() -> Any:
                return store.decisions(status=DecisionStatus.APPLIED) or store.decisions(status=DecisionStatus.VERIFIED)

            [decision] = wait_for("a change to be applied", applied, 60, proc)
            assert decision.decision.proposed_config is not None
            assert decision.decision.proposed_config["num_speculative_tokens"] == 8  # α = 0.8, c = 0.05 ⇒ K = 8
            wait_for("the engine at K = 8", lambda: served_k(port) == 8, 30, proc)
            assert not group_alive(engine_pgid)  # the K = 2 engine was stopped, group and all
            verified = wait_for(
                "the change to be verified", lambda: store.decisions(status=DecisionStatus.VERIFIED), 60, proc
            )
            assert verified[0].realized_gain is not None and verified[0].realized_gain > 1.1
            key = store.engines()[0].key
            configs = store.configs(key)
            assert [c.config.applied_by for c in configs] == [AppliedBy.STARTUP, AppliedBy.RESTART]
            assert configs[1].config.decision_id == decision.id
            assert store.latest_window(key) is not None
            assert [e.kind for e in store.events(kind="config_applied")] == ["config_applied"]
            new_pgid = int((tmp_path / "engine.log.pid").read_text())
        out, _ = stop_daemon(proc)
    finally:
        kill_leftovers(proc, tmp_path)
    actions = [json.loads(line)["action"] for line in out.splitlines() if line.startswith("{")]
    assert "applied" in actions and "verified" in actions
    assert not group_alive(new_pgid) and nothing_listens(port)  # the engine was stopped with the daemon
    assert not (tmp_path / "engine.log.pid").exists()

    # A restarted daemon starts the engine with the config recorded in the database (K = 8), not the
    # file's K = 2 (in-process: the start-up path, without paying for another interpreter).
    with Store(db_url) as store:
        daemon = Daemon(load_config(config), store)
        try:
            started = daemon.start_engine()
            assert started.reason == "database"
            assert served_k(port) == 8
        finally:
            daemon.actuator.stop()
    assert nothing_listens(port)


def test_daemon_refuses_an_unmigrated_database(tmp_path: Path) -> None:
    config = tmp_path / "spectuner.toml"
    write_config(config, free_port(), f"sqlite:///{tmp_path / 'fresh.db'}")
    result = CliRunner().invoke(app, ["run", "--config", str(config)])
    assert result.exit_code == 2 and "spectuner db upgrade" in result.output
    assert not (tmp_path / "engine.log.pid").exists()  # no engine was started


def test_kill_9_mid_apply_then_restart_recovers(tmp_path: Path) -> None:
    """The daemon dies (SIGKILL) while the K = 8 engine is starting; the next daemon closes the
    interrupted apply, stops the orphaned engine and serves the last recorded config (K = 2)."""
    db_url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db_url)
    port = free_port()
    config = tmp_path / "spectuner.toml"
    write_config(config, port, db_url, engine_flags=("--slow-start-k", "8", "--startup-delay-s", "20"))
    pid_file = tmp_path / "engine.log.pid"

    def engine_group() -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(pid_file.read_text())
        return None

    proc = start_daemon(config)
    try:
        with Store(db_url) as store:
            wait_for("the K = 2 engine", lambda: served_k(port) == 2, 90, proc)
            first = engine_group()
            [applying] = wait_for(
                "an apply in progress", lambda: store.decisions(status=DecisionStatus.APPLYING), 90, proc
            )
            # the K = 8 engine's process group, once the daemon has stopped the K = 2 one and written the new
            # one's pid (between the two the file is gone, or still names the stopping engine: on a loaded
            # machine a read there found no orphan to test)
            orphan = wait_for(
                "the K = 8 engine starting",
                lambda: served_k(port) is None and (g := engine_group()) not in (None, first) and group_alive(g) and g,
                30,
                proc,
            )
            proc.kill()  # SIGKILL: no cleanup at all
            proc.wait()
            assert group_alive(orphan)  # the engine outlived its daemon

            daemon = Daemon(load_config(config), store)
            try:
                started = daemon.start_engine()
                assert started.reason == "database"
                assert served_k(port) == 2  # the last recorded config, engine serving
                assert not _alive(orphan)
                d = store.decision(applying.id)
                assert d.status == DecisionStatus.FAILED and "interrupted" in (d.status_message or "")
                assert [e.kind for e in store.events(kind="apply_interrupted")] == ["apply_interrupted"]
                current = daemon.controller.current_config()
                assert current is not None and current.config.num_spec_tokens == 2
            finally:
                daemon.actuator.stop()
    finally:
        kill_leftovers(proc, tmp_path)
    assert nothing_listens(port)


def _alive(pgid: int) -> bool:
    from tuner.actuators.restart import _alive_reaping

    return _alive_reaping(pgid)
