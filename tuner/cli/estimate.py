"""`spectuner estimate`: α and vLLM's acceptance figures from saved /metrics dumps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from collectors.offline import DumpError, MixedKError, engine_counters, looks_swapped, read_dump, total
from policies.acceptance import estimate_alpha
from tuner.cli.common import fail_runtime, fail_usage, out_console, print_json


def estimate(
    metrics_file: list[Path] = typer.Option(
        ...,
        "--metrics-file",
        help="A saved /metrics page (curl -s http://HOST:PORT/metrics > F). Give two for the delta F2 − F1.",
    ),
    by_engine: bool = typer.Option(False, "--by-engine", help="One estimate per engine instead of the sum."),
    confidence: float = typer.Option(0.95, "--confidence", help="Level of alpha_ci, in (0, 1)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (keys as in docs/architecture.md)."),
) -> None:
    """Estimate α (per-token acceptance of the draft) from one /metrics dump (totals since the
    engine started) or two (what happened between them)."""
    if len(metrics_file) > 2:
        fail_usage(f"give one or two --metrics-file, not {len(metrics_file)}")
    if not 0.0 < confidence < 1.0:
        fail_usage(f"--confidence must be between 0 and 1 (exclusive) but got {confidence}")
    try:
        dumps = [read_dump(p) for p in metrics_file]
    except DumpError as exc:
        fail_usage(str(exc))
    if not dumps[0]:
        fail_usage(f"{metrics_file[0]}: no vLLM engine series on this page (is it a vLLM /metrics page?)")
    if len(dumps) == 2 and looks_swapped(dumps[0], dumps[1]):
        fail_usage(
            f"{metrics_file[1]} looks older than {metrics_file[0]} (its counters are all lower and the engines "
            "did not restart): give the older dump first, --metrics-file OLD --metrics-file NEW"
        )
    per_engine = engine_counters(dumps[0], dumps[1] if len(dumps) == 2 else None)
    sources = [str(p) for p in metrics_file]

    if by_engine:
        engines = []
        for ec in per_engine:
            item: dict[str, Any] = {"model_name": ec.model_name, "engine": ec.engine}
            item["speculation"] = ec.spec is not None
            if ec.spec is not None:
                est = estimate_alpha(ec.spec, confidence)
                item.update(est.to_dict())
                item["reason"] = est.reason.value
            item["reset"] = ec.reset
            if ec.note:
                item["note"] = ec.note
            engines.append(item)
        if not any(e["speculation"] for e in engines):
            fail_runtime(_no_spec_message(sources))
        result: dict[str, Any] = {"sources": sources, "engines": engines}
    else:
        try:
            summed = total(per_engine)
        except MixedKError as exc:
            fail_usage(str(exc))
        if summed is None:
            fail_runtime(_no_spec_message(sources))
        est = estimate_alpha(summed, confidence)
        result = {
            **est.to_dict(),
            "reason": est.reason.value,
            "engines_summed": sum(1 for ec in per_engine if ec.spec is not None),
            "reset": any(ec.reset for ec in per_engine),
            "sources": sources,
            "message": est.message,
        }

    if as_json:
        print_json(result)
        return
    _print_human(result, by_engine)


def _no_spec_message(sources: list[str]) -> str:
    return (
        f"no speculative-decoding counters in {', '.join(sources)}: speculation is off on this engine "
        "(start vLLM with --speculative-config to use it)"
    )


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v, digits) for v in value) + "]"
    return str(value)


_ROWS = (
    ("K (num_spec_tokens)", "num_spec_tokens", 0),
    ("drafts D", "drafts", 0),
    ("draft tokens T", "draft_tokens", 0),
    ("accepted tokens A", "accepted_tokens", 0),
    ("draft acceptance rate A/T", "draft_acceptance_rate", 3),
    ("mean acceptance length 1+A/D", "mean_acceptance_length", 2),
    ("α (per-token acceptance)", "alpha", 3),
    ("α interval", "alpha_ci", 3),
    ("conditional acceptance c_i", "conditional_acceptance_by_position", 2),
)


def _print_human(result: dict[str, Any], by_engine: bool) -> None:
    """Quantities down, engines across: fits a terminal whatever K is."""
    columns = result["engines"] if by_engine else [result]
    table = Table(title="Speculative decoding acceptance", title_justify="left")
    table.add_column("quantity")
    for col in columns:
        name = f"{col['model_name']}/{col['engine']}" if by_engine else f"{result['engines_summed']} engine(s)"
        table.add_column(name, justify="right")
    for label, key, digits in _ROWS:
        cells = [_fmt(col.get(key), digits) if col.get("speculation", True) else "off" for col in columns]
        table.add_row(label, *cells)
    out_console.print(table)
    if not by_engine and result.get("message"):
        out_console.print(result["message"], highlight=False)
    for col in columns:
        if col.get("note"):
            out_console.print(f"[yellow]note:[/] {col['model_name']}/{col['engine']}: {col['note']}", highlight=False)
    if not by_engine and result.get("reset"):
        out_console.print(
            "[yellow]note:[/] an engine restarted between the dumps; its counts start at the restart.",
            highlight=False,
        )


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
