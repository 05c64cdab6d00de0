"""`spectuner run --config spectuner.toml`: the sidecar daemon (collect, decide, act, verify).

Heavy modules (the store, APScheduler, the controller) are imported inside the command so that
``spectuner --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from tuner.cli.common import fail_runtime, fail_usage, load_config_or_exit, open_store


class TickPrinter:
    """Which tick results reach the terminal: none of the quiet ones (hold, none: the audit log has
    them), and a blocked one only when it changes — "[blocked] override_waiting" on every tick of a
    pause would bury everything else. Anything else is always printed."""

    QUIET = frozenset({"hold", "none"})

    def __init__(self) -> None:
        self._last: tuple[str, str] | None = None

    def should_print(self, action: str, reason: str) -> bool:
        current = (action, reason)
        repeated = current == self._last
        self._last = current
        if action in self.QUIET:
            return False
        return not (action == "blocked" and repeated)


def run(
    config: Path = typer.Option(
        ..., "--config", "-c", help="The daemon's TOML config (see docs/spectuner.example.toml)."
    ),
    db: str | None = typer.Option(
        None, "--db", help="Database URL (default: [database] url, $SPECTUNER_DB, else spectuner.db beside the config)."
    ),
    check: bool = typer.Option(False, "--check", help="Validate the config and the database, print them, and exit."),
    as_json: bool = typer.Option(False, "--json", help="Print each decision as one JSON line (and --check as JSON)."),
) -> None:
    """Run the sidecar: scrape the engine, decide, apply through the actuator, verify, audit."""
    from tuner.checks import start_problems
    from tuner.config import ConfigError

    cfg = load_config_or_exit(config)
    problems = start_problems(cfg)  # the same checks for `run` and `run --check`
    if problems:
        fail_usage(str(ConfigError(str(config), problems)))
    store = open_store(db, config, cfg)

    if check:
        summary = {
            "config": str(config),
            "db": repr(store),
            "mode": cfg.controller.mode.value,
            "actuator": cfg.actuator.kind,
            "metrics_url": cfg.engine.metrics_url,
            "speculative_config": cfg.speculative.to_spec_config().to_vllm(),
        }
        store.close()
        if as_json:
            sys.stdout.write(json.dumps(summary) + "\n")
        else:
            for k, v in summary.items():
                typer.echo(f"{k}: {v}")
        return

    from tuner.controller.audit import TickResult
    from tuner.daemon import Daemon, DaemonStartError

    printer = TickPrinter()

    def show(result: TickResult) -> None:
        if not printer.should_print(result.action, result.reason):
            return
        if as_json:
            sys.stdout.write(json.dumps(result.__dict__) + "\n")
        else:
            typer.echo(f"[{result.action}] {result.reason}: {result.message}")
        sys.stdout.flush()

    try:
        daemon = Daemon(cfg, store, on_tick=show)  # may refuse (e.g. the live actuator's token file is missing)
        daemon.run()
    except DaemonStartError as exc:
        fail_runtime(str(exc))
    finally:
        store.close()


def register(app: typer.Typer) -> None:
    app.command("run")(run)
