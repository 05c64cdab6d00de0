"""`spectuner demo`: what `make demo` runs (see tuner/demo.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from tuner.cli.common import err_console, fail_runtime, fail_usage
from tuner.lab.models import DEFAULT_MODELS_DIR


def demo_cmd(
    models_dir: Path = typer.Option(DEFAULT_MODELS_DIR, "--models-dir", help="Lab models (built if missing)."),
    draft: str = typer.Option("medium", "--draft", help="Draft the engine starts with."),
    k: int = typer.Option(3, "--k", min=0, help="num_speculative_tokens to start with."),
    interval_s: float = typer.Option(5.0, "--interval-s", min=0.5, help="Seconds between scrapes."),
) -> None:
    """Start the lab engine, run a phased workload, print live speculation statistics per interval."""
    from tuner.demo import run_demo
    from tuner.engine.process import EngineStartError
    from tuner.lab.serve import LabUsageError

    try:
        run_demo(models_dir, draft=draft, k=k, interval_s=interval_s)
    except LabUsageError as e:
        fail_usage(str(e))
    except EngineStartError as e:
        err_console.print(e.log_tail, markup=False, highlight=False)
        fail_runtime(str(e))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
