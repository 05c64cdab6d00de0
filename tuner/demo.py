"""`spectuner demo` (`make demo`): the closed loop on a real lab engine.

The sidecar daemon (the same :class:`~tuner.daemon.Daemon` as ``spectuner run``) supervises a vLLM
server that starts with the *weak* draft. A steady workload runs in phases; spectuner measures α̂,
sees acceptance staying below 0.4, swaps to the best candidate (a restart), and from then on the
per-batch-size table it chose picks K per step as concurrency moves 1 → 16 → 1. Every decision is
printed with its reason and predicted gain as it happens; at the end a summary shows each phase's
goodput and latency, and each decision's predicted and realized gain (from the audit log).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from policies.acceptance import alpha_of_windows
from tuner.config import parse_config
from tuner.controller.audit import TickResult
from tuner.daemon import Daemon
from tuner.engine.process import free_port
from tuner.lab.closed_loop import LoopSettings, lab_daemon_config
from tuner.lab.models import GPU_LIKE, MANIFEST, Recipe, build_models
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.lab.serve import LabServer
from tuner.lab.workload import BackgroundLoad, PhaseStats
from tuner.store import DecisionStatus, Store, StoredDecision, upgrade

# Easy and hard prompts alternate: the weak draft's α̂ is ~0.2 on this mix, the good one's above 0.85.
PROMPTS = tuple(p for pair in zip(PREDICTABLE, HARD, strict=False) for p in pair)


@dataclass(frozen=True)
class LoopPhase:
    name: str
    concurrency: int
    duration_s: float
    until_swap: bool = False  # end early once a draft swap has been applied (bounded by duration_s)


DEFAULT_PHASES: tuple[LoopPhase, ...] = (
    LoopPhase("weak draft, 1 stream", 1, 240.0, until_swap=True),
    LoopPhase("1 stream", 1, 45.0),
    LoopPhase("16 streams", 16, 50.0),
    LoopPhase("back to 1 stream", 1, 30.0),
)


@dataclass
class DemoResult:
    startup_s: float
    phases: list[PhaseStats]
    decisions: list[StoredDecision]
    changes: int
    swaps: int
    elapsed_s: float
    printed: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)  # apply events with their client impact

    def summary(self) -> dict[str, Any]:
        """What ``spectuner demo --json`` prints: phases (client side) and changes (audit log)."""
        return {
            "startup_s": self.startup_s,
            "elapsed_s": self.elapsed_s,
            "swaps": self.swaps,
            "changes_applied": self.changes,
            "phases": [
                {
                    "phase": p.phase,
                    "duration_s": p.duration_s,
                    "requests": len(p.completions),
                    "errors": p.errors,
                    "tokens_per_s": p.tokens_per_s,
                    "p50_s": p.latency_quantile(0.5),
                    "p99_s": p.latency_quantile(0.99),
                }
                for p in self.phases
            ],
            "changes": [
                {
                    "id": d.id,
                    "at": d.decision.created_at.isoformat(),
                    "reason": d.decision.reason,
                    "status": d.status,
                    "predicted_gain": d.decision.predicted_gain,
                    "realized_gain": d.realized_gain,
                    "message": d.status_message or d.decision.message,
                }
                for d in self.decisions
            ],
            "apply_events": self.events,
        }


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


class _TickPrinter:
    """Prints each controller step that says something new (a blocked proposal once, not every tick)."""

    def __init__(self, console: Console, store: Store, t0: float) -> None:
        self.console, self.store, self.t0 = console, store, t0
        self.last: tuple[str, str] | None = None
        self.swapped = threading.Event()

    def __call__(self, tick: TickResult) -> None:
        if tick.action in ("none", "hold") or (tick.action, tick.reason) == self.last:
            return
        self.last = (tick.action, tick.reason)
        gain = ""
        if tick.decision_id is not None:
            d = self.store.decision(tick.decision_id)
            if d.decision.predicted_gain is not None:
                gain = f" predicted ×{d.decision.predicted_gain:.2f}"
            if d.realized_gain is not None:
                gain += f", realized ×{d.realized_gain:.2f}"
            if tick.action == "applied" and d.decision.reason in ("swap_draft", "fallback_ngram"):
                self.swapped.set()
        style = {"applied": "green", "rolled_back": "red", "failed": "red", "blocked": "yellow"}.get(tick.action, "")
        head = f"[{style}]{tick.action}[/]" if style else tick.action
        self.console.print(f"{time.monotonic() - self.t0:6.0f}s  decision {head} ({tick.reason}){gain}: {tick.message}")


def _engine_up(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def _status_line(store: Store, daemon: Daemon, load: BackgroundLoad, t0: float, phase: str) -> str:
    keys = daemon.controller.engine_keys()
    if not keys:
        return f"{time.monotonic() - t0:6.0f}s  [{phase}] waiting for the engine"
    cfg = store.current_config(keys[0])
    w = store.latest_window(keys[0])
    draft = "-"
    if cfg is not None:
        model = cfg.config.draft_model
        draft = Path(model).name.removeprefix("draft-") if model else cfg.config.method
    tok_s = w.generation_tokens / w.duration_s if w is not None and w.duration_s > 0 else None
    alpha, k_drafted = "-", "-"
    if w is not None and w.spec is not None and w.spec.drafts > 0:
        k_drafted = f"{w.spec.draft_tokens / w.spec.drafts:.1f}"
        est = alpha_of_windows([w.spec])  # the controller's estimate, on the latest window
        if est.alpha is not None and est.alpha_ci is not None:
            alpha = f"{est.alpha:.2f} [{est.alpha_ci[0]:.2f},{est.alpha_ci[1]:.2f}]"
    elif w is not None:
        k_drafted = "0"
    running = _fmt(w.requests_running if w is not None else None, ".0f")
    age_s = (daemon.clock() - w.end).total_seconds() if w is not None else 0.0
    if age_s > 3 * daemon.config.controller.collect_interval_s:
        return f"{time.monotonic() - t0:6.0f}s  [{phase}] no fresh window for {age_s:.0f} s (engine restarting)"
    return (
        f"{time.monotonic() - t0:6.0f}s  [{phase}] draft={draft} K/step={k_drafted} running={running} "
        f"α̂={alpha} {_fmt(tok_s, '.0f')} tok/s"
    )


class _ToConsole(logging.Handler):
    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(f"  {record.getMessage()}", markup=False, highlight=False)


def _lab_progress(console: Console) -> None:
    """The model build logs its stages; show them, so a first demo is not minutes of silence."""
    lg = logging.getLogger("tuner.lab.models")
    lg.setLevel(logging.INFO)
    lg.propagate = False
    if not any(isinstance(h, _ToConsole) for h in lg.handlers):
        lg.addHandler(_ToConsole(console))


def run_demo(
    models_dir: Path,
    phases: Sequence[LoopPhase] = DEFAULT_PHASES,
    settings: LoopSettings = LoopSettings(per_batch_size=True),
    console: Console | None = None,
    db_path: Path | None = None,
    status_every_s: float = 10.0,
    on_started: Callable[[LabServer], None] | None = None,
    front_door: bool = True,
    recipe: Recipe | None = None,
) -> DemoResult:
    console = console or Console(width=None if sys.stdout.isatty() else 140)
    t_begin = time.monotonic()
    if not (Path(models_dir) / MANIFEST).exists():
        recipe = recipe or GPU_LIKE
        console.print(f"building the {recipe.name} lab models in {models_dir} (once; about a minute, progress below)")
        _lab_progress(console)
    manifest = build_models(models_dir, recipe)  # recipe None: the directory keeps the one it was built with
    for d in manifest.drafts.values():
        if d.greedy_agreement is not None:
            console.print(f"  draft {d.name:<7} greedy agreement with the target {d.greedy_agreement:.3f}")
    db_path = db_path or Path(models_dir).parent / "demo.db"
    for suffix in ("", "-wal", "-shm"):  # each demo starts from an empty database
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    db_url = f"sqlite:///{db_path}"
    upgrade(db_url)
    server = LabServer(draft=settings.start_draft, k=settings.start_k, models_dir=models_dir)
    if front_door and settings.front_door_port is None:
        # Clients go through the tap inside the daemon; the default strategy (auto) then changes the
        # engine blue/green on the CPU lab (a second engine fits), so no client sees the swap.
        settings = replace(settings, front_door_port=free_port(), blue_green_port=free_port())
    client_url = f"http://127.0.0.1:{settings.front_door_port}" if settings.front_door_port else server.base_url
    config = parse_config(tomllib.loads(lab_daemon_config(server, db_url, settings)), base_dir=server.workdir)
    assert server.workdir is not None
    server.workdir.mkdir(parents=True, exist_ok=True)
    server.tmp_dir.mkdir(parents=True, exist_ok=True)
    store = Store(db_url)
    t0 = time.monotonic()
    printer = _TickPrinter(console, store, t0)
    daemon = Daemon(config, store, on_tick=printer)
    console.print(
        f"spectuner daemon (auto mode) starting vLLM with the [bold]{settings.start_draft}[/] draft at "
        f"K={settings.start_k} on {server.base_url}; candidates: {', '.join(settings.candidates)}; "
        f"engine log {server.log_path}"
        + (
            f"; clients connect to the front door {client_url} (strategy {settings.strategy})"
            if settings.front_door_port
            else ""
        )
    )
    errors: list[BaseException] = []

    def run_daemon() -> None:
        try:
            daemon.run(install_signals=False)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=run_daemon, name="spectuner-daemon", daemon=True)
    thread.start()
    load = BackgroundLoad(client_url, server.model_name, max_tokens=48)
    startup_s = 0.0
    try:
        while not _engine_up(f"{client_url}/health"):
            if errors or not thread.is_alive():
                raise RuntimeError(f"the daemon stopped before the engine came up: {errors[0] if errors else '?'}")
            time.sleep(0.5)
        startup_s = time.monotonic() - t0
        console.print(f"{startup_s:6.0f}s  engine healthy")
        if on_started is not None:
            on_started(server)
        for phase in phases:
            console.print(f"[bold]── phase: {phase.name} ({phase.concurrency} concurrent, easy + hard prompts)[/]")
            load.set_phase(phase.name, PROMPTS, phase.concurrency)
            end = time.monotonic() + phase.duration_s
            next_status = time.monotonic() + status_every_s
            while time.monotonic() < end:
                if errors:
                    raise RuntimeError(f"the daemon failed: {errors[0]}")
                if phase.until_swap and printer.swapped.is_set():
                    break
                time.sleep(0.5)
                if time.monotonic() >= next_status:
                    console.print(_status_line(store, daemon, load, t0, phase.name), highlight=False, markup=False)
                    next_status += status_every_s
            if phase.until_swap and not printer.swapped.is_set():
                console.print(f"[yellow]no swap within {phase.duration_s:.0f} s[/]")
    finally:
        stats = load.stop()
        daemon.request_stop()
        thread.join(timeout=120)
        console.print("daemon stopped; engine stopped")
    decisions = [
        d for d in store.decisions() if d.decision.action == "change" and d.decision.status != DecisionStatus.BLOCKED
    ]
    applied = [d for d in decisions if d.status in (DecisionStatus.APPLIED, DecisionStatus.VERIFIED, "rolled_back")]
    # a swap is a draft that came up and served (its draft_swapped event), not a decision whose new
    # engine never started and was rolled back
    swaps = sum(1 for e in store.events() if e.kind == "draft_swapped")
    _print_summary(console, stats, store, startup_s)
    apply_events = [
        {"kind": e.kind, "at": e.ts.isoformat(), **{k: v for k, v in e.data.items() if k != "detail"}}
        for e in store.events()
        if isinstance(e.data, dict) and "strategy" in e.data
    ]
    store.close()
    elapsed = time.monotonic() - t_begin
    console.print(f"whole demo {elapsed:.0f} s; audit log and windows in {db_url}")
    return DemoResult(startup_s, stats, decisions, len(applied), swaps, elapsed, events=apply_events)


def _print_summary(console: Console, stats: Sequence[PhaseStats], store: Store, startup_s: float) -> None:
    table = Table(title="phases (client side)")
    for col in ("phase", "s", "requests", "errors", "tok/s", "p50 s", "p99 s"):
        table.add_column(col)
    for p in stats:
        table.add_row(
            p.phase, f"{p.duration_s:.0f}", str(len(p.completions)), str(p.errors), f"{p.tokens_per_s:.0f}",
            _fmt(p.latency_quantile(0.5), ".3f"), _fmt(p.latency_quantile(0.99), ".3f"),
        )
    console.print(table)
    audit = Table(title="changes (audit log; proposals held back by a guardrail are counted below)")
    for col in ("id", "at", "reason", "status", "predicted", "realized", "message"):
        audit.add_column(col, overflow="fold")
    held = 0
    for d in store.decisions():
        if d.decision.action != "change":
            continue
        if d.status == DecisionStatus.BLOCKED:
            held += 1
            continue
        audit.add_row(
            str(d.id), d.decision.created_at.strftime("%H:%M:%S"), d.decision.reason, d.status,
            _fmt(d.decision.predicted_gain, ".2f"), _fmt(d.realized_gain, ".2f"),
            (d.status_message or d.decision.message)[:160],
        )
    console.print(audit)
    console.print(f"{held} proposal(s) held back by guardrails (see `spectuner history` or the decisions table)")
    events = store.events()
    console.print("events: " + ", ".join(f"{e.kind}" for e in events if e.kind != "counter_reset") or "none")
    console.print(f"first engine start {startup_s:.0f} s")


__all__ = ["DEFAULT_PHASES", "DemoResult", "LoopPhase", "run_demo"]
