"""`spectuner demo`: what `make demo` runs (see tuner/demo.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from tuner.cli.common import fail_runtime, fail_usage, print_json
from tuner.lab.models import GPU_LIKE_MODELS_DIR, RECIPES


def demo_cmd(
    models_dir: Path = typer.Option(GPU_LIKE_MODELS_DIR, "--models-dir", help="Lab models (built if missing)."),
    recipe: str | None = typer.Option(
        None, "--recipe",
        help="Lab recipe: gpu-like (GPU-like step costs; the default for a new directory) or tiny. "
        "Default: the recipe the directory was built with.",
    ),
    per_batch_size: bool = typer.Option(
        True, "--per-batch-size/--single-k", help="Let the controller choose a per-batch-size K table."
    ),
    front_door: bool = typer.Option(
        True,
        "--front-door/--no-front-door",
        help="Clients go through the tap inside the daemon (default strategy: no client sees a change).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON on stdout (progress on stderr)."),
) -> None:
    """The closed loop on the lab engine: weak draft → swap → K per load, every decision explained."""
    if recipe is not None and recipe not in RECIPES:
        fail_usage(f"unknown --recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")
    if models_dir.exists() and not models_dir.is_dir():
        fail_usage(f"--models-dir {models_dir} is not a directory: give the lab models' directory (built if missing)")
    from rich.console import Console

    from tuner.demo import run_demo
    from tuner.lab.closed_loop import LoopSettings
    from tuner.lab.serve import LabUsageError

    console = Console(stderr=True) if as_json else None
    try:
        result = run_demo(
            models_dir,
            settings=LoopSettings(per_batch_size=per_batch_size),
            console=console,
            front_door=front_door,
            recipe=None if recipe is None else RECIPES[recipe],
        )
    except LabUsageError as e:
        fail_usage(str(e))
    except RuntimeError as e:
        fail_runtime(str(e))
    if as_json:
        print_json(result.summary())
    if result.swaps != 1:
        fail_runtime(f"expected exactly one draft swap, saw {result.swaps}; see the audit log above")
    failed = {s.phase: s.errors for s in result.phases if s.errors}
    if failed:
        fail_runtime(f"client requests failed during the demo (phase: errors): {failed}; see the summary above")


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_cmd)
