"""A daemon job that keeps raising shows on the Prometheus endpoint (a real HTTP server), not only in the
log, which names a failing job once: live, 6 Dec 2026, one malformed evidence window failed every decision
for 150 s with a single log line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.integration.test_daemon import write_config
from tests.integration.test_exporters_daemon import scrape, value
from tuner.config import load_config
from tuner.daemon import Daemon
from tuner.engine.process import free_port
from tuner.store import Store, upgrade


def test_a_failing_decide_job_is_counted_and_flagged_until_it_recovers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db_url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db_url)
    config, metrics_port = tmp_path / "spectuner.toml", free_port()
    write_config(config, free_port(), db_url)
    config.write_text(
        config.read_text()
        + f"""
[exporters.prometheus]
enabled = true
port = {metrics_port}
"""
    )

    def broken() -> None:
        raise ValueError("per-position counts need 0 ≤ successes ≤ trials")

    with Store(db_url) as store:
        daemon = Daemon(load_config(config), store)
        daemon.observers.start()  # the exporters only: no engine is started
        try:
            daemon._guard("collect", lambda: None)
            series = scrape(metrics_port)
            assert value(series, "spectuner_daemon_job_failing", daemon_job="collect") == 0
            assert value(series, "spectuner_daemon_job_failures_total", daemon_job="collect") == 0
            assert value(series, "spectuner_daemon_job_failing", daemon_job="decide") is None  # not run yet

            with caplog.at_level(logging.WARNING, logger="tuner.daemon"):
                for _ in range(3):
                    daemon._guard("decide", broken)
            series = scrape(metrics_port)
            assert value(series, "spectuner_daemon_job_failing", daemon_job="decide") == 1
            assert value(series, "spectuner_daemon_job_failures_total", daemon_job="decide") == 3
            # the log names it once; the counter counts every run
            assert sum("daemon job decide failed" in r.getMessage() for r in caplog.records) == 1
            assert daemon.ticks["decide"] == 0

            daemon._guard("decide", lambda: None)
            series = scrape(metrics_port)
            assert value(series, "spectuner_daemon_job_failing", daemon_job="decide") == 0
            assert value(series, "spectuner_daemon_job_failures_total", daemon_job="decide") == 3
            assert daemon.ticks["decide"] == 1
        finally:
            daemon.observers.close()
