"""`spectuner drafts list|add|remove`: the registry of draft candidates (``tuner.controller.drafts``),
kept as audit rows so every change says who and when."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from tuner.cli.common import (
    BY_HELP,
    CONFIG_HELP,
    DB_HELP,
    JSON_HELP,
    db_error_detail,
    default_by,
    fail_runtime,
    fail_usage,
    iso,
    load_config_or_exit,
    note,
    open_store,
    out_console,
    print_json,
    say,
    short_time,
)

drafts_app = typer.Typer(
    name="drafts", help="The registry of draft candidates (list, add, remove; audited).", no_args_is_help=True
)

# "org/name" or "name": what a Hugging Face hub id looks like (checked by vLLM when it loads it).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _spec_dict(spec: Any, source: str, who_when: tuple[str, datetime] | None) -> dict[str, Any]:
    return {
        **spec.to_dict(),
        "source": source,
        "added_by": who_when[0] if who_when else None,
        "added_at": iso(who_when[1]) if who_when else None,
    }


@drafts_app.command("list")
def list_cmd(
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="spectuner.toml: also list its drafts section (and use its database)."
    ),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The registered drafts (and, with --config, the config file's draft candidates)."""
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.controller.drafts import registered_drafts, who_and_when
    from tuner.store.shadow import latest_shadow_results

    cfg = load_config_or_exit(config)
    store = open_store(db, config, cfg)
    try:
        with store:
            registered = registered_drafts(store)
            added = who_and_when(store)
            shadow = latest_shadow_results(store)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot read the database {store!r}: {db_error_detail(exc)}")
    rows = [_spec_dict(s, "registry", added.get(s.name)) for s in registered]
    # The config file's [[drafts]] as written (prior_alpha, cost_ratio... included), marked as such.
    rows += [{**item.model_dump(), "source": "config"} for item in (cfg.drafts if cfg is not None else [])]
    now = datetime.now(UTC)
    for r in rows:
        found = shadow.get(r["name"])
        r["measured"] = (
            {
                "source": "shadow",
                **{k: v for k, v in found.to_json().items() if k not in ("candidate", "method", "model_path")},
                "age_s": round((now - found.computed_at).total_seconds(), 1),
            }
            if found is not None
            else None
        )
    # Ranked: measured α̂ first (highest first), then the unmeasured in registry order.
    rows.sort(key=_rank)
    result: dict[str, Any] = {"drafts": rows}
    if as_json:
        print_json(result)
        return
    if not rows:
        say("no drafts registered; add one with `spectuner drafts add NAME --method M --model PATH`")
        return
    from rich.table import Table

    table = Table(title="draft candidates", title_justify="left")
    for col, wrap in (
        ("name", False), ("method", False), ("model", True), ("size", True), ("measured α̂", True), ("source", True)
    ):
        table.add_column(col, overflow="fold", no_wrap=not wrap)
    for r in rows:
        size = [f"{r['num_params']:,} params" if r.get("num_params") is not None else None, r.get("dtype")]
        if r.get("kv_bytes_per_token") is not None:
            size.append(f"KV {r['kv_bytes_per_token']:,} B/token")
        if r.get("extra"):
            size.append(json.dumps(r["extra"]))
        source = r["source"]
        if r.get("added_by"):
            source += f", added by {r['added_by']} {short_time(r['added_at'])}"
        table.add_row(
            r["name"], r["method"], r.get("model") or "—", " · ".join(x for x in size if x) or "—",
            _measured_text(r["measured"]), source,
        )
    out_console.print(table)


def _rank(row: dict[str, Any]) -> tuple[int, float]:
    measured = row["measured"]
    return (0, -measured["alpha"]) if measured and measured["alpha"] is not None else (1, 0.0)


def _measured_text(m: dict[str, Any] | None) -> str:
    if not m or m.get("alpha") is None:
        return "—"
    lo, hi = m["alpha_ci"]
    greedy = ", greedy-only" if m.get("greedy_only") else ""
    return f"{m['alpha']:.3f} [{lo:.3f}, {hi:.3f}] ({m['source']}, {m['drafts']:,} drafts{greedy})"


def _check_model(model: str, method: str) -> tuple[str, dict[str, Any] | None, str | None]:
    """(model as stored, its config.json or None, a warning). A local path must be a directory with a
    config.json (stored absolute, so the daemon finds it from anywhere); a hub id is not checked."""
    path = Path(model).expanduser()
    looks_local = model.startswith(("/", "./", "../", "~")) or path.exists()
    if not looks_local:
        if not _HUB_ID.match(model):
            fail_usage(f"--model {model!r} is neither an existing directory nor a hub id like org/name")
        return model, None, f"{model!r} is not a local directory; taken as a hub id (not checked: vLLM loads it)"
    if not path.is_dir():
        fail_usage(f"--model {model}: no such directory; give the {method} draft's model directory")
    config_json = path / "config.json"
    if not config_json.is_file():
        fail_usage(f"--model {model}: {config_json} is missing; a {method} draft directory holds a config.json")
    try:
        data = json.loads(config_json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        fail_usage(f"--model {model}: {config_json} is not readable JSON ({exc})")
    if not isinstance(data, dict):
        fail_usage(f"--model {model}: {config_json} does not hold a JSON object")
    return str(path.resolve()), data, None


@drafts_app.command("add")
def add_cmd(
    name: str = typer.Argument(..., help="The candidate's name (used by `spectuner apply --draft NAME`)."),
    method: str = typer.Option(..., "--method", help="draft_model, eagle, eagle3, ngram or suffix."),
    model: str | None = typer.Option(None, "--model", help="The draft model directory (or hub id)."),
    num_params: int | None = typer.Option(
        None, "--num-params", help="Draft parameter count (default: counted from a local draft's safetensors)."
    ),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight dtype (default: torch_dtype of its config.json)."),
    extra_json: str | None = typer.Option(
        None, "--extra-json", help="More vLLM speculative-config keys, e.g. '{\"prompt_lookup_max\": 5}'."
    ),
    by: str | None = typer.Option(None, "--by", help=BY_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Register a draft candidate (audited)."""
    from sqlalchemy.exc import SQLAlchemyError

    from policies.memory import dtype_bytes, kv_bytes_per_token
    from tuner.controller.drafts import DraftRegistryError, DraftSpec, add_draft

    who = default_by(by)
    extra: Any = {}
    if extra_json is not None:
        try:
            extra = json.loads(extra_json)
        except json.JSONDecodeError as exc:
            fail_usage(f"--extra-json is not valid JSON ({exc.msg}): {extra_json!r}")
    warning = None
    kv = None
    stored_model = model
    if model is not None and method not in ("ngram", "suffix"):
        stored_model, model_config, warning = _check_model(model, method)
        if model_config is not None:
            if dtype is None:
                found = model_config.get("torch_dtype") or model_config.get("dtype")
                dtype = found if isinstance(found, str) else None
            try:
                kv = kv_bytes_per_token(model_config, dtype)
            except (ValueError, KeyError, TypeError):
                kv = None  # not every architecture's config names its KV shape; the size stays unknown
            if num_params is None:
                from tuner.controller.candidates import count_params

                num_params = count_params(stored_model)  # from the safetensors headers; None if there are none
    if dtype is not None:
        try:
            dtype_bytes(dtype)
        except ValueError as exc:
            fail_usage(f"--dtype: {exc}")
    try:
        spec = DraftSpec(
            name=name,
            method=method,
            model=stored_model,
            num_params=num_params,
            dtype=dtype,
            extra=extra,
            kv_bytes_per_token=kv,
        )
    except DraftRegistryError as exc:
        fail_usage(str(exc))
    store = open_store(db, config)
    try:
        with store:
            try:
                audit_id = add_draft(store, datetime.now(UTC), spec, who)
            except DraftRegistryError as exc:
                fail_usage(str(exc))
            row = store.decision(audit_id)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database {store!r}: {db_error_detail(exc)}")
    result = {
        "audit_id": audit_id,
        "action": row.decision.action,
        "by": who,
        "created_at": iso(row.decision.created_at),
        "draft": spec.to_dict(),
        "warnings": [warning] if warning else [],
    }
    if warning:
        note(warning, label="warning", err=True)
    if as_json:
        print_json(result)
        return
    say(
        f"registered draft {name} [{method}]{' ' + stored_model if stored_model else ''} "
        f"(audit id {audit_id}) by {who} at {result['created_at']}"
    )


@drafts_app.command("remove")
def remove_cmd(
    name: str = typer.Argument(..., help="The registered draft's name."),
    by: str | None = typer.Option(None, "--by", help=BY_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Unregister a draft candidate (audited; the config in force is not changed)."""
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.controller.drafts import DraftRegistryError, remove_draft

    who = default_by(by)
    store = open_store(db, config)
    try:
        with store:
            try:
                audit_id = remove_draft(store, datetime.now(UTC), name, who)
            except DraftRegistryError as exc:
                fail_usage(str(exc))
            row = store.decision(audit_id)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database {store!r}: {db_error_detail(exc)}")
    result = {
        "audit_id": audit_id,
        "action": row.decision.action,
        "by": who,
        "created_at": iso(row.decision.created_at),
        "name": name,
    }
    if as_json:
        print_json(result)
        return
    say(f"removed draft {name} (audit id {audit_id}) by {who} at {result['created_at']}")


def register(app: typer.Typer) -> None:
    app.add_typer(drafts_app, name="drafts")
