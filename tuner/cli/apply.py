"""`spectuner apply`: a manual override. Shows the config in force and the new one, asks for
confirmation (``--yes`` skips), then writes an ``override`` row to the audit log; the controller
applies it on its next tick (even in advisory mode), unless paused or a change is being verified."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer

from policies.spec_config import EXAMPLE, K_KEY, K_TABLE_KEY
from tuner.cli.common import (
    BY_HELP,
    CONFIG_HELP,
    DB_HELP,
    JSON_HELP,
    confirm_or_exit,
    db_error_detail,
    default_by,
    fail_runtime,
    fail_usage,
    iso,
    load_config_or_exit,
    note,
    open_store,
    print_json,
    say,
)
from tuner.config import K_LIMIT

BUILTIN_DRAFTS = ("ngram", "suffix", "off")  # --draft names that need no registry entry


def check_config(config: Any, k_max: int | None) -> dict[str, Any]:
    """Validate a speculative config for an override (``tuner.controller.override_check``, the check
    the daemon repeats before applying it); raise ``ValueError`` naming what is wrong."""
    from tuner.controller.override_check import validate_spec_config

    return validate_spec_config(config, k_max)




def _parse_json(text: str, option: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        fail_usage(f"{option} is not valid JSON ({exc.msg} at column {exc.colno}): {text!r}")


def build_config(
    store: Any, cfg: Any, config_json: str | None, draft: str | None, k: int | None, k_table: str | None
) -> dict[str, Any]:
    """The override's speculative config from ``--config-json`` or ``--draft/--k/--k-table``."""
    if config_json is not None:
        if draft is not None or k is not None or k_table is not None:
            fail_usage("give either --config-json or --draft/--k/--k-table, not both")
        parsed: dict[str, Any] = _parse_json(config_json, "--config-json")
        return parsed
    if draft is None:
        fail_usage(f"give --draft NAME --k N (see `spectuner drafts list`) or --config-json '{EXAMPLE}'")
    if draft == "off":
        if k is not None or k_table is not None:
            fail_usage("--draft off switches speculation off; drop --k and --k-table")
        return {"method": "off"}
    table = _parse_json(k_table, "--k-table") if k_table is not None else None
    if k is None and isinstance(table, list) and table and all(isinstance(r, list) and len(r) == 3 for r in table):
        k = max(r[2] for r in table) if all(isinstance(r[2], int) for r in table) else None  # the table's maximum
    if k is None:
        fail_usage(f"--draft {draft} needs --k N ({K_KEY}) or a --k-table")
    spec = _find_draft(store, cfg, draft)
    try:
        config = spec.to_spec_config(k).to_vllm()
    except ValueError as exc:
        fail_usage(f"--k: {exc}")
    if table is not None:
        config[K_TABLE_KEY] = table  # as given: validate_spec_config says what is wrong with it
    return config


def _find_draft(store: Any, cfg: Any, name: str) -> Any:
    from tuner.controller.drafts import DraftSpec, registered_drafts

    for spec in registered_drafts(store):
        if spec.name == name:
            return spec
    for spec in config_candidates(cfg):
        if spec.name == name:
            return spec
    if name in ("ngram", "suffix"):
        return DraftSpec(name=name, method=name)
    known = [s.name for s in registered_drafts(store)] + [s.name for s in config_candidates(cfg)]
    fail_usage(
        f"no draft named {name!r}: registered {', '.join(known) or 'none'}; builtin {', '.join(BUILTIN_DRAFTS)}. "
        f"Register one with `spectuner drafts add {name} --method draft_model --model PATH`"
    )


def config_candidates(cfg: Any) -> list[Any]:
    """The ``[[drafts]]`` entries of the config file as ``DraftSpec``; a relative model path that
    exists beside the config file is made absolute, as the daemon does (``tuner.daemon``)."""
    from tuner.controller.drafts import DraftRegistryError, DraftSpec

    out = []
    for item in cfg.drafts if cfg is not None else []:
        data = item.model_dump()
        if data.get("model") and Path(cfg.resolve(data["model"])).exists():
            data["model"] = str(cfg.resolve(data["model"]))
        try:
            out.append(DraftSpec.from_dict(data))
        except (DraftRegistryError, TypeError):
            continue  # a shape the registry does not take (the config's own validation differs); skip it
    return out


def pick_engine(store: Any, url: str | None) -> Any:
    """The engine series the override is for: ``url``'s (engine 0 of the first model), or the only
    server in the database; None when no series is recorded yet."""
    keys = [e.key for e in store.engines() if url is None or e.key.url == url]
    if url is not None and not keys:
        fail_usage(f"no engine series scraped from {url} in this database; `spectuner status` lists them")
    urls = sorted({k.url for k in keys})
    if len(urls) > 1:
        fail_usage(f"this database holds several servers ({', '.join(urls)}): choose one with --engine URL")
    return min(keys, key=lambda k: (k.model_name, k.engine)) if keys else None


def apply(
    config_json: str | None = typer.Option(None, "--config-json", help=f"The speculative config, e.g. '{EXAMPLE}'."),
    draft: str | None = typer.Option(
        None,
        "--draft",
        help="A registered draft (`spectuner drafts list`), a drafts entry of --config, ngram, suffix or off.",
    ),
    k: int | None = typer.Option(
        None, "--k", help="K with --draft (default with --k-table: its largest K)."
    ),
    k_table: str | None = typer.Option(
        None, "--k-table", help="K per batch size with --draft: JSON rows [lo, hi, K], e.g. '[[1,4,5],[5,16,2]]'."
    ),
    engine: str | None = typer.Option(None, "--engine", help="The vLLM server (when the database holds several)."),
    k_max: int | None = typer.Option(None, "--k-max", help="Largest K allowed (default: policy.k_max of --config)."),
    canary: bool = typer.Option(
        False,
        "--canary",
        help="Apply it to this replica first and judge it against the untouched replicas that share the database "
        "([canary] in the sidecar's config); promote it to them or roll it back.",
    ),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    by: str | None = typer.Option(None, "--by", help=BY_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    config: Path | None = typer.Option(None, "--config", "-c", help=CONFIG_HELP),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Ask the controller to apply a config (a manual override, audited with who and when)."""
    from sqlalchemy.exc import SQLAlchemyError

    from tuner.cli.status import _engine_url, describe_config

    who = default_by(by)
    if k_max is not None and not 0 <= k_max <= K_LIMIT:
        fail_usage(f"--k-max must be between 0 and {K_LIMIT} but got {k_max}")
    cfg = load_config_or_exit(config)
    limit = k_max if k_max is not None else (cfg.policy.k_max if cfg is not None else None)
    url = _engine_url(engine or (cfg.engine.metrics_url if cfg is not None else None))
    store = open_store(db, config, cfg)
    try:
        with store:
            proposed = build_config(store, cfg, config_json, draft, k, k_table)
            try:
                proposed = check_config(proposed, limit)
            except ValueError as exc:
                fail_usage(f"cannot apply this config: {exc}")
            key = pick_engine(store, url)
            current = store.current_config(key) if key is not None else None
            previous = current.config.spec_config if current is not None else None
            warnings = _warnings(store, key, previous, proposed)
            _show(key, previous, proposed, warnings, as_json, describe_config)
            confirm_or_exit("Write this override to the audit log for the controller to apply?", yes)
            audit_id = _write(store, proposed, key, who, canary)
            row = store.decision(audit_id)
    except SQLAlchemyError as exc:
        fail_runtime(f"cannot use the database {store!r}: {db_error_detail(exc)}")
    result = {
        "audit_id": audit_id,
        "action": row.decision.action,
        "status": row.decision.status,
        "by": who,
        "created_at": iso(row.decision.created_at),
        "engine": None if key is None else {"url": key.url, "model_name": key.model_name, "engine": key.engine},
        "previous_config": previous,
        "config": proposed,
        "warnings": warnings,
        "canary": canary,
    }
    if as_json:
        print_json(result)
        return
    say(
        f"wrote override (audit id {audit_id}) by {who} at {result['created_at']}: {describe_config(proposed)}; "
        "the controller applies it on its next tick" + (" as a canary" if canary else "")
    )


def _write(store: Any, proposed: dict[str, Any], key: Any, who: str, canary: bool) -> int:
    from tuner.controller import manual

    audit_id: int = manual.request_override(store, datetime.now(UTC), proposed, engine=key, by=who, canary=canary)
    return audit_id


def _warnings(store: Any, key: Any, previous: dict[str, Any] | None, proposed: dict[str, Any]) -> list[str]:
    from tuner.actuators.base import config_fingerprint
    from tuner.controller import manual
    from tuner.controller.audit import CHANGE
    from tuner.store import DecisionStatus

    out = []
    if key is None:
        out.append("no engine series is recorded yet: the controller applies this once it sees the engine")
    if manual.active_pauses(store):
        out.append("the controller is paused: this waits for `spectuner resume`")
    waiting = manual.pending_overrides(store)
    if waiting:
        ids = ", ".join(str(d.id) for d in waiting)
        out.append(f"override(s) {ids} are already waiting and are applied first (oldest first)")
    if store.decisions(status=DecisionStatus.APPLYING) or any(
        d.decision.action in (CHANGE, manual.OVERRIDE) for d in store.decisions(status=DecisionStatus.APPLIED)
    ):
        out.append("a change is being applied or verified: this waits until it is verified")
    if previous is not None and config_fingerprint(previous) == config_fingerprint(proposed):
        out.append("this is the config already in force: the actuator will leave the engine as it is")
    return out


def _show(
    key: Any,
    previous: dict[str, Any] | None,
    proposed: dict[str, Any],
    warnings: list[str],
    as_json: bool,
    describe: Any,
) -> None:
    """current → new, on stderr with --json (stdout carries only the JSON document)."""
    where = "no engine series yet" if key is None else f"{key.model_name} / engine {key.engine} @ {key.url}"
    say(f"engine:  {where}", err=as_json)
    say(f"current: {describe(previous) if previous else 'unknown (nothing recorded)'}", err=as_json)
    if previous:
        say(f"         {json.dumps(previous)}", err=as_json)
    say(f"new:     {describe(proposed)}", err=as_json)
    say(f"         {json.dumps(proposed)}", err=as_json)
    for w in warnings:
        note(w, err=as_json)


def register(app: typer.Typer) -> None:
    app.command("apply")(apply)
