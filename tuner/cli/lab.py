"""`spectuner lab build-models | serve | load`: the local CPU engine for demos and tests."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import typer
from rich.table import Table

from tuner.cli.common import err_console, fail_runtime, fail_usage, out_console, print_json
from tuner.lab.models import DEFAULT_MODELS_DIR

lab_app = typer.Typer(help="The lab: tiny local models and a real vLLM engine on CPU.", no_args_is_help=True)


@lab_app.command("build-models")
def build_models_cmd(
    models_dir: Path = typer.Argument(DEFAULT_MODELS_DIR, help="Where to write the models and manifest."),
    force: bool = typer.Option(False, "--force", help="Rebuild even if a matching build exists."),
    as_json: bool = typer.Option(False, "--json", help="Print the manifest as JSON."),
    recipe: str | None = typer.Option(
        None, "--recipe",
        help="tiny: 3 M-parameter models for fast tests; gpu-like: a 136 M target and drafts costing ~0.15 of it "
        "(speculation wins at low load, loses at high load, as on GPUs; 1.4 GB, about a minute). "
        "Default: the recipe the directory was built with, tiny when new.",
    ),
) -> None:
    """Build the tokenizer, the target and the draft ladder (cached: a second call is instant)."""
    try:
        from tuner.lab.models import RECIPES, build_models
    except ImportError as e:  # pragma: no cover - depends on the install
        fail_usage(f"the lab needs the engine extras ({e}); install with `make install`")
    if recipe is not None and recipe not in RECIPES:
        fail_usage(f"unknown --recipe {recipe!r}; choose one of: {', '.join(RECIPES)}")
    _progress_to_stderr()
    t0 = time.monotonic()
    try:
        manifest = build_models(models_dir, recipe=None if recipe is None else RECIPES[recipe], force=force)
    except ImportError as e:
        fail_usage(f"the lab needs torch, transformers and tokenizers ({e}); install with `make install`")
    took = time.monotonic() - t0
    if as_json:
        print_json({**manifest.to_json(), "elapsed_s": round(took, 2)})
        return
    table = Table(title=f"lab models in {models_dir} ({took:.1f}s; built in {manifest.build_seconds}s)")
    for col in ("name", "method", "params", "KV bytes/token", "greedy agreement", "cost c (1 token)"):
        table.add_column(col)
    t = manifest.target
    table.add_row("target", "-", f"{t.params:,}", str(t.kv_bytes_per_token), "-", _ms(t.step_ms))
    for d in manifest.drafts.values():
        agree = "-" if d.greedy_agreement is None else f"{d.greedy_agreement:.3f}"
        cost = "-" if d.cost_ratio is None else f"{d.cost_ratio:.3f}"
        table.add_row(d.name, d.method, f"{d.params:,}", str(d.kv_bytes_per_token), agree, cost)
    out_console.print(table)


def _ms(step_ms: dict[str, float]) -> str:
    return f"1 ({step_ms['1']:.1f} ms)" if "1" in step_ms else "-"


def _progress_to_stderr() -> None:
    """The build and calibration log what they are doing: a newcomer sees progress, not minutes of silence."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%H:%M:%S"))
    for name in ("tuner.lab.models", "tuner.lab.calibrate"):
        lg = logging.getLogger(name)
        lg.setLevel(logging.INFO)
        lg.propagate = False  # the root handler (if any) would print every line twice
        if not lg.handlers:
            lg.addHandler(handler)


@lab_app.command("serve")
def serve_cmd(
    draft: str = typer.Option("good", "--draft", help="Draft name from the manifest, 'ngram', or 'none'."),
    k: int = typer.Option(3, "--k", help="num_speculative_tokens (K_max with a per-batch-size table)."),
    per_batch_size: str | None = typer.Option(
        None, "--per-batch-size", help="K per batch size: JSON [[1,4,5],[5,16,2]] or '1-4:5,5-16:2'."
    ),
    port: int | None = typer.Option(None, "--port", help="Port on 127.0.0.1 (default: a free one)."),
    models_dir: Path = typer.Option(DEFAULT_MODELS_DIR, "--models-dir", help="Built lab models."),
    compile_graphs: bool = typer.Option(False, "--compile", help="Compile (slower start) instead of eager."),
    duration_s: float | None = typer.Option(
        None, "--duration-s", help="Stop after this many seconds (default: until Ctrl-C / SIGTERM)."
    ),
) -> None:
    """Start a real vLLM OpenAI server on the lab models, wait for health, serve until stopped."""
    from tuner.lab.serve import EngineStartError, LabServer, LabUsageError, parse_per_batch_size

    try:
        table = parse_per_batch_size(per_batch_size) if per_batch_size else None
        server = LabServer(
            draft=draft, k=k, per_batch_size=table, port=port, models_dir=models_dir, enforce_eager=not compile_graphs
        )
    except LabUsageError as e:
        fail_usage(str(e))
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    err_console.print(f"starting vLLM on {server.base_url} (draft={draft}, k={k}); log: {server.log_path}")
    try:
        took = server.start()
    except EngineStartError as e:
        err_console.print(e.log_tail, markup=False, highlight=False)
        fail_runtime(str(e))
    try:
        out_console.print(
            json.dumps(
                {
                    "base_url": server.base_url,
                    "metrics_url": server.metrics_url,
                    "model": server.model_name,
                    "pid": server.pid,
                    "startup_s": round(took, 1),
                    "speculative_config": server.spec_config,
                }
            )
        )
        deadline = None if duration_s is None else time.monotonic() + duration_s
        while not stop.is_set():
            if deadline is not None and time.monotonic() >= deadline:
                break
            if not server.alive():
                fail_runtime(f"the engine exited unexpectedly; see {server.log_path}")
            stop.wait(0.5)
    finally:
        server.stop()
        err_console.print("engine stopped")


@lab_app.command("load")
def load_cmd(
    url: str = typer.Option(..., "--url", help="Base URL of the OpenAI server, e.g. http://127.0.0.1:8000"),
    prompts: str = typer.Option("predictable", "--prompts", help="Prompt set: predictable or hard."),
    concurrency: int = typer.Option(1, "--concurrency", min=1),
    count: int = typer.Option(16, "--count", min=1),
    max_tokens: int = typer.Option(64, "--max-tokens", min=1),
    model: str = typer.Option("lab-target", "--model"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Send a bounded greedy workload and report throughput, latency and speculation totals."""
    from tuner.lab.load import run_load
    from tuner.lab.prompts import PROMPT_SETS

    if prompts not in PROMPT_SETS:
        fail_usage(f"unknown prompt set {prompts!r}; choose one of: {', '.join(PROMPT_SETS)}")
    from collectors.scrape import metrics_url

    try:
        metrics_url(url)  # the same check as every other URL option: http(s), a host, parseable
    except ValueError as exc:
        fail_usage(f"--url: {exc}")
    result = run_load(url, model, PROMPT_SETS[prompts], concurrency, count, max_tokens)
    summary = result.summary()
    if as_json:
        print_json(summary)
    else:
        for key, value in summary.items():
            out_console.print(f"{key:>16}: {value}")
    if result.errors == len(result.requests):
        fail_runtime(f"every request failed; first error: {result.requests[0].error}")


@lab_app.command("calibrate")
def calibrate_cmd(
    models_dir: Path = typer.Option(DEFAULT_MODELS_DIR, "--models-dir", help="Built lab models."),
    streams: str = typer.Option(
        "1,4,16,32,64", "--streams", help="Concurrent greedy requests to time, e.g. 1,4,16,64."
    ),
    draft: str = typer.Option("good", "--draft", help="The draft speculating at --k in the throughput runs."),
    k: int = typer.Option(3, "--k", min=1, help="num_speculative_tokens for the throughput runs."),
    max_tokens: int = typer.Option(64, "--max-tokens", min=8, help="Tokens generated per request."),
    as_json: bool = typer.Option(False, "--json", help="Print the measurements as JSON."),
) -> None:
    """Measure the lab in the vLLM engine: draft cost ratios, agreement, throughput per stream count.

    Starts one engine per config (no speculation, DRAFT/K, each draft shape alone): minutes. The result
    is also stored under `calibration` in the models' manifest.json.
    """
    from tuner.lab.calibrate import CalibrationError, CalibrationPlan, calibrate
    from tuner.lab.models import LabModelsMissing

    try:
        counts = tuple(int(x) for x in streams.split(",") if x.strip())
    except ValueError:
        fail_usage(f"--streams must be comma-separated integers, e.g. 1,4,16,64; got {streams!r}")
    if not counts or min(counts) < 1:
        fail_usage(f"--streams must be positive integers; got {streams!r}")
    _progress_to_stderr()
    try:
        result = calibrate(models_dir, CalibrationPlan(streams=counts, draft=draft, k=k, max_tokens=max_tokens))
    except LabModelsMissing as e:
        fail_usage(str(e))
    except ValueError as e:
        fail_usage(str(e))
    except CalibrationError as e:
        fail_runtime(str(e))
    if as_json:
        print_json(result)
        return
    spec_label = f"{draft}/K={k}"
    table = Table(title=f"throughput, tok/s ({models_dir}; crossover {result['crossover_streams']})")
    for col in ("streams", "off", spec_label, "gain"):
        table.add_column(col)
    for n, row in result["throughput"].items():
        table.add_row(n, f"{row['off']:.1f}", f"{row[spec_label]:.1f}", f"{row['speculation_gain']:.2f}×")
    out_console.print(table)
    drafts = Table(title=f"drafts (target step {result['target']['step_ms']} ms at 1 stream)")
    for col in ("draft", "cost ratio c", "greedy agreement"):
        drafts.add_column(col)
    for name, d in result["drafts"].items():
        c = "-" if d.get("cost_ratio") is None else f"{d['cost_ratio']:.3f}"
        a = "-" if d.get("agreement") is None else f"{d['agreement']:.3f}"
        drafts.add_row(name, c, a)
    out_console.print(drafts)


def register(app: typer.Typer) -> None:
    app.add_typer(lab_app, name="lab")
