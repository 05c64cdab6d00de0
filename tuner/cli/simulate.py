"""`spectuner simulate`: run a scenario through the simulated engine under each policy and compare."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from tuner.cli.common import err_console, fail_usage, out_console, print_json


def simulate(
    scenario: Path = typer.Option(..., "--scenario", help="A scenario TOML file (see bench/scenarios/README.md)."),
    policy: list[str] = typer.Option(
        [],
        "--policy",
        help="A policy to run (repeat for several): spectuner, fixed_k3, no_spec, best_fixed, sglang_ma, "
        "trtllm_cutoff, ucb, spectuner_stepcost. Default: all.",
    ),
    seed: int | None = typer.Option(None, "--seed", help="Random seed (default: the scenario's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines on stderr."),
) -> None:
    """Simulate a speculative-decoding engine (seeded, deterministic) and drive the real controller and
    the comparison policies through it.

    Goodput is generated tokens/s over the whole run, restarts included; ratio_to_oracle is against the
    best fixed config in hindsight."""
    from tuner.sim.run import POLICIES, run_scenario
    from tuner.sim.scenario import ScenarioError, load_scenario

    chosen = list(dict.fromkeys(policy)) or list(POLICIES)
    unknown = [p for p in chosen if p not in POLICIES]
    if unknown:
        fail_usage(f"unknown --policy {', '.join(unknown)}; choose from {', '.join(POLICIES)}")
    try:
        sc = load_scenario(scenario)
    except ScenarioError as exc:
        fail_usage(exc.one_line())
    progress = None if quiet else (lambda msg: err_console.print(f"[dim]{msg}[/]", highlight=False))
    result = run_scenario(sc, chosen, seed=seed, progress=progress)
    if as_json:
        print_json(result)
        return
    _print_table(result)


def _print_table(result: dict[str, Any]) -> None:
    from rich.table import Table

    oracle = result["oracle"]
    table = Table(title=f"{result['scenario']} — oracle (best fixed in hindsight): {oracle['config']}")
    for col in ("policy", "goodput tok/s", "× oracle", "changes", "restarts", "downtime s", "final config"):
        table.add_column(col, justify="left" if col in ("policy", "final config") else "right")
    for name, p in result["policies"].items():
        table.add_row(
            name,
            f"{p['goodput']:.1f}",
            f"{p['ratio_to_oracle']:.3f}" if p["ratio_to_oracle"] is not None else "n/a",
            str(p["changes"]),
            str(p["restarts"]),
            f"{p['downtime_s']:.0f}",
            p["final_config"],
        )
    out_console.print(table)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate)
