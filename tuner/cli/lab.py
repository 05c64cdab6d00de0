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
) -> None:
    """Build the tokenizer, the target and the draft ladder (cached: a second call is instant)."""
    try:
        from tuner.lab.models import build_models
    except ImportError as e:  # pragma: no cover - depends on the install
        fail_usage(f"the lab needs the engine extras ({e}); install with `make install`")
    t0 = time.monotonic()
    try:
        manifest = build_models(models_dir, force=force)
    except ImportError as e:
        fail_usage(f"the lab needs torch, transformers and tokenizers ({e}); install with `make install`")
    took = time.monotonic() - t0
    if as_json:
        print_json({**manifest.to_json(), "elapsed_s": round(took, 2)})
        return
    table = Table(title=f"lab models in {models_dir} ({took:.1f}s; built in {manifest.build_seconds}s)")
    for col in ("name", "method", "params", "KV bytes/token", "greedy agreement"):
        table.add_column(col)
    table.add_row("target", "-", f"{manifest.target.params:,}", str(manifest.target.kv_bytes_per_token), "-")
    for d in manifest.drafts.values():
        agree = "-" if d.greedy_agreement is None else f"{d.greedy_agreement:.3f}"
        table.add_row(d.name, d.method, f"{d.params:,}", str(d.kv_bytes_per_token), agree)
    out_console.print(table)


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


def register(app: typer.Typer) -> None:
    app.add_typer(lab_app, name="lab")
