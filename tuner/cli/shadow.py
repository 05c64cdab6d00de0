"""`spectuner shadow run|forget`: measure each draft candidate's α on the recorded traffic sample
(``tuner.shadow``), and delete that sample (it holds user data)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import typer

from tuner.cli.common import (
    CONFIG_HELP,
    DB_HELP,
    JSON_HELP,
    db_error_detail,
    fail_runtime,
    fail_usage,
    load_config_or_exit,
    open_store,
    out_console,
    print_json,
    say,
)

shadow_app = typer.Typer(
    name="shadow",
    help="Measure draft candidates on recorded traffic without loading them (run, forget).",
    no_args_is_help=True,
)

SAMPLES_HELP = "The traffic record's directory (the tap's --record-dir)."


@shadow_app.command("run")
def run_cmd(
    samples_dir: Path = typer.Option(..., "--samples", help=SAMPLES_HELP),
    target: Path = typer.Option(..., "--target", help="The target model's directory (its tokenizer.json)."),
    k: int = typer.Option(3, "--k", min=1, max=32, help="Speculative tokens per step to replay with."),
    max_samples: int = typer.Option(2000, "--max-samples", min=1, help="Newest recorded samples to replay."),
    max_model_len: int = typer.Option(
        1 << 30, "--max-model-len", min=1, help="The engine's max_model_len (ngram drafts stop there)."
    ),
    threads: int = typer.Option(1, "--threads", min=1, help="CPU threads the worker may use (torch, BLAS)."),
    nice: int = typer.Option(19, "--nice", min=0, max=19, help="Lower the worker's CPU priority by this much."),
    cpu_share: float = typer.Option(
        0.1, "--cpu-share", help="Most CPU time the worker takes, as a share of one core's wall time (0, 1]."
    ),
    only: list[str] = typer.Option([], "--candidate", help="Evaluate only these candidates (repeatable)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Replay the recorded traffic through every draft candidate (registry and config) and store α̂."""
    from sqlalchemy.exc import SQLAlchemyError

    from collectors.traffic_record import RecorderSettings, SampleStore
    from tuner.controller.drafts import registered_drafts
    from tuner.shadow import ShadowCandidate, ShadowInputError, Throttle, limit_resources, select_samples
    from tuner.shadow_job import evaluate_and_store

    if not samples_dir.is_dir():
        fail_usage(f"--samples {samples_dir}: no such directory (record traffic with the tap's --record-dir first)")
    if not target.is_dir():
        fail_usage(f"--target {target}: no such directory; give the target model's directory")
    cfg = load_config_or_exit(config)
    try:
        throttle = Throttle(cpu_share)
    except ShadowInputError as exc:
        fail_usage(str(exc))
    limit_resources(threads, nice)
    store = open_store(db, config, cfg)
    now = datetime.now(UTC)
    sample_store = SampleStore(RecorderSettings(samples_dir))
    sample_store.sweep()
    samples = select_samples(sample_store, None, max_samples)
    if not samples:
        fail_usage(f"--samples {samples_dir}: no recorded samples to replay")
    try:
        with store:
            cands = [ShadowCandidate(s.name, s.method, s.model, dict(s.extra)) for s in registered_drafts(store)]
            known = {c.name for c in cands}
            for item in cfg.drafts if cfg is not None else []:
                if item.name not in known:
                    cands.append(ShadowCandidate(item.name, item.method, item.model, dict(item.extra)))
            if only:
                missing = sorted(set(only) - {c.name for c in cands})
                if missing:
                    fail_usage(f"--candidate {', '.join(missing)}: not a registered or configured draft")
                cands = [c for c in cands if c.name in only]
            if not cands:
                fail_usage("no draft candidates: add one with `spectuner drafts add NAME --method M --model PATH`")
            try:
                rows = evaluate_and_store(
                    store, cands, samples, target=target, k=k, threads=threads, max_model_len=max_model_len,
                    throttle=throttle, now=now,
                )
            except ShadowInputError as exc:
                fail_usage(str(exc))
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database {store!r}: {db_error_detail(exc)}")
    result_doc = {"samples": len(samples), "candidates": rows}
    if as_json:
        print_json(result_doc)
        return
    from rich.table import Table

    table = Table(title=f"shadow evaluation on {len(samples)} recorded requests", title_justify="left")
    for col in ("candidate", "method", "K", "α̂", "interval", "drafts", "note"):
        table.add_column(col)
    for r in rows:
        if r.get("skipped"):
            table.add_row(r["candidate"], r["method"], str(r["k"]), "—", "—", "—", r["skipped"])
            continue
        ci = r["alpha_ci"]
        table.add_row(
            r["candidate"],
            r["method"],
            str(r["k"]),
            f"{r['alpha']:.3f}" if r["alpha"] is not None else "—",
            f"[{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "—",
            str(r["drafts"]),
            "greedy-only" if r["greedy_only"] else "",
        )
    out_console.print(table)


@shadow_app.command("forget")
def forget_cmd(
    samples_dir: Path = typer.Option(..., "--samples", help=SAMPLES_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Delete every recorded traffic sample (prompts and outputs: user data)."""
    from collectors.traffic_record import RecorderSettings, SampleStore

    if not samples_dir.is_dir():
        fail_usage(f"--samples {samples_dir}: no such directory")
    deleted = SampleStore(RecorderSettings(samples_dir)).forget()
    if as_json:
        print_json({"deleted_samples": deleted, "directory": str(samples_dir)})
        return
    say(f"deleted {deleted} recorded samples from {samples_dir}")


def register(app: typer.Typer) -> None:
    app.add_typer(shadow_app, name="shadow")
