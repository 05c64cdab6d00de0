"""`spectuner demo`: what `make demo` runs (see tuner/demo.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from tuner.cli.common import fail_runtime, fail_usage
from tuner.lab.models import DEFAULT_MODELS_DIR


def demo_cmd(
    models_dir: Path = typer.Option(DEFAULT_MODELS_DIR, "--models-dir", help="Lab models (built if missing)."),
    per_batch_size: bool = typer.Option(
        True, "--per-batch-size/--single-k", help="Let the controller choose a per-batch-size K table."
    ),
) -> None:
    """The closed loop on the lab engine: weak draft → swap → K per load, every decision explained."""
    if models_dir.exists() and not models_dir.is_dir():
        fail_usage(f"--models-dir {models_dir} is not a directory: give the lab models' directory (built if missing)")
    from tuner.demo import run_demo
    from tuner.lab.closed_loop import LoopSettings
    from tuner.lab.serve import LabUsageError

    try:
        result = run_demo(models_dir, settings=LoopSettings(per_batch_size=per_batch_size))
    except LabUsageError as e:
        fail_usage(str(e))
    except RuntimeError as e:
        fail_runtime(str(e))
    if result.swaps != 1:
        fail_runtime(f"expected exactly one draft swap, saw {result.swaps}; see the audit log above")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
