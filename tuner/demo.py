"""`spectuner demo`: a real lab engine, a phased workload, and live speculation statistics per interval.

The collector scrapes the engine's ``/metrics`` every interval; each window's counters go through the
same estimator the controller uses (α̂ with its interval) and are printed beside vLLM's own figures.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from collectors.records import WindowRecord
from collectors.scrape import Collector
from policies.acceptance import estimate_alpha
from policies.counters import SpecCounters
from tuner.lab.load import LoadResult, run_load
from tuner.lab.models import build_models
from tuner.lab.prompts import PROMPT_SETS
from tuner.lab.serve import LabServer
from tuner.store import Store, upgrade


@dataclass(frozen=True)
class Phase:
    name: str
    prompts: str
    concurrency: int
    count: int
    max_tokens: int = 64


DEFAULT_PHASES: tuple[Phase, ...] = (
    Phase("predictable, 1 stream", "predictable", 1, 24),
    Phase("hard, 1 stream", "hard", 1, 24),
    Phase("predictable, 8 streams", "predictable", 8, 64),
)


@dataclass
class DemoResult:
    startup_s: float
    windows: list[WindowRecord]
    loads: list[tuple[Phase, LoadResult]]
    total: SpecCounters


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def run_demo(
    models_dir: Path,
    draft: str = "medium",
    k: int = 3,
    interval_s: float = 5.0,
    phases: Sequence[Phase] = DEFAULT_PHASES,
    console: Console | None = None,
    db_path: Path | None = None,
) -> DemoResult:
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    db_path = db_path or Path(models_dir).parent / "demo.db"
    for suffix in ("", "-wal", "-shm"):  # each demo starts from an empty database
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    db_url = f"sqlite:///{db_path}"
    upgrade(db_url)
    store = Store(db_url)
    t0 = time.monotonic()
    manifest = build_models(models_dir)
    console.print(f"lab models ready in {time.monotonic() - t0:.1f}s ({models_dir})")
    for d in manifest.drafts.values():
        if d.greedy_agreement is not None:
            console.print(f"  draft {d.name:<7} {d.params:>9,} params, greedy agreement {d.greedy_agreement:.3f}")

    server = LabServer(draft=draft, k=k, models_dir=models_dir)
    console.print(f"starting vLLM (draft={draft}, K={k}) on {server.base_url}; log {server.log_path}")
    startup = server.start()
    console.print(f"engine healthy after {startup:.1f}s")
    windows: list[WindowRecord] = []
    loads: list[tuple[Phase, LoadResult]] = []
    current = {"phase": "idle"}
    try:
        collector = Collector(server.metrics_url, store, interval_s=interval_s, timeout_s=5.0)
        collector.collect_once()  # baseline

        def workload() -> None:
            for ph in phases:
                current["phase"] = ph.name
                loads.append((ph, run_load(server.base_url, server.model_name, PROMPT_SETS[ph.prompts],
                                           ph.concurrency, ph.count, ph.max_tokens)))
            current["phase"] = "done"

        worker = threading.Thread(target=workload, name="demo-load", daemon=True)
        worker.start()
        table_cols = ("t (s)", "phase", "drafts", "α̂ [95% CI]", "accept rate", "mean acc len", "tok/s")
        console.print("  ".join(f"{c:>14}" if i else f"{c:>6}" for i, c in enumerate(table_cols)))
        started = time.monotonic()
        while True:
            worker.join(timeout=interval_s)
            finished = not worker.is_alive()
            label = current["phase"]
            result = collector.collect_once()
            for w in result.windows:
                windows.append(w)
                if w.duration_s < 0.5 and not w.generation_tokens:
                    continue  # the closing scrape right after the workload: nothing to show
                _print_window(console, time.monotonic() - started, label, w)
            if not result.ok:
                console.print(f"[yellow]scrape failed: {result.error or result.sink_error}[/]")
            if finished:
                break
        worker.join()
    finally:
        server.stop()
        console.print("engine stopped")

    total = SpecCounters()
    for w in windows:
        if w.spec is not None:
            total = total + w.spec
    _print_summary(console, startup, windows, loads, total)
    stored = sum(len(store.windows(e.key)) for e in store.engines())
    store.close()
    console.print(f"{stored} windows stored in {db_url}")
    return DemoResult(startup, windows, loads, total)


def _print_window(console: Console, t: float, phase: str, w: WindowRecord) -> None:
    tok_s = w.generation_tokens / w.duration_s if w.duration_s > 0 else None
    if w.spec is None or w.spec.drafts == 0:
        cells = [f"{t:6.1f}", f"{phase[:14]:>14}", f"{0:>14}", f"{'-':>14}", f"{'-':>14}", f"{'-':>14}",
                 f"{_fmt(tok_s, '.0f'):>14}"]
    else:
        est = estimate_alpha(w.spec)
        ci = est.alpha_ci
        alpha = "-" if est.alpha is None or ci is None else f"{est.alpha:.3f} [{ci[0]:.2f},{ci[1]:.2f}]"
        cells = [
            f"{t:6.1f}", f"{phase[:14]:>14}", f"{w.spec.drafts:>14}", f"{alpha:>14}",
            f"{_fmt(est.draft_acceptance_rate, '.3f'):>14}", f"{_fmt(est.mean_acceptance_length, '.2f'):>14}",
            f"{_fmt(tok_s, '.0f'):>14}",
        ]
    console.print("  ".join(cells), highlight=False)


def _print_summary(
    console: Console, startup: float, windows: list[WindowRecord], loads: list[tuple[Phase, LoadResult]],
    total: SpecCounters,
) -> None:
    table = Table(title="workload phases (client side)")
    for col in ("phase", "requests", "errors", "tokens", "tok/s", "p50 s", "p99 s", "drafts / accepted (per request)"):
        table.add_column(col)
    for ph, res in loads:
        s = res.summary()
        table.add_row(ph.name, str(s["requests"]), str(s["errors"]), str(s["output_tokens"]),
                      str(s["tokens_per_s"]), _fmt(s["p50_latency_s"], ".3f"), _fmt(s["p99_latency_s"], ".3f"),
                      f"{s['drafts']} / {s['accepted_tokens']}")
    console.print(table)
    if total.drafts:
        est = estimate_alpha(total)
        console.print(f"whole run: {est.message}")
    console.print(f"engine start-up {startup:.1f}s; {len(windows)} windows collected")
