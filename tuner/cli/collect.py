"""`spectuner collect`: scrape a vLLM /metrics URL into the store, once or in a loop."""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType
from typing import Any

import typer

from collectors.scrape import DEFAULT_MAX_BODY_BYTES, Collector, CollectResult, metrics_url
from tuner.cli.common import fail_runtime, fail_usage, open_store, out_console, print_json, require_range

MAX_INTERVAL_S = 86_400.0  # a day: a longer scrape interval is a typo, not a plan
MAX_BODY_BYTES_LIMIT = 1024 * 1024 * 1024  # 1 GiB: the page is held in memory whole


def collect(
    url: str = typer.Option(..., "--url", help="vLLM server (http://HOST:PORT) or its /metrics URL."),
    db: str | None = typer.Option(
        None, "--db", help="Database URL (default: $SPECTUNER_DB, else sqlite:///spectuner.db here)."
    ),
    once: bool = typer.Option(
        False, "--once", help="Collect one window (two scrapes --interval-s apart), store it and exit."
    ),
    interval_s: float = typer.Option(10.0, "--interval-s", help="Seconds between scrapes."),
    timeout_s: float = typer.Option(5.0, "--timeout-s", help="Seconds to wait for one /metrics page."),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES,
        "--max-body-bytes",
        help=f"Largest /metrics page accepted, in bytes (default {DEFAULT_MAX_BODY_BYTES}; "
        f"at most {MAX_BODY_BYTES_LIMIT}).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print what was collected as JSON."),
) -> None:
    """Scrape vLLM's /metrics every --interval-s seconds and store per-engine windows of deltas."""
    require_range("--interval-s", interval_s, low=0.0, high=MAX_INTERVAL_S, low_open=True)
    require_range("--timeout-s", timeout_s, low=0.0, high=MAX_INTERVAL_S, low_open=True)
    require_range("--max-body-bytes", max_body_bytes, low=1, high=MAX_BODY_BYTES_LIMIT)
    try:
        target = metrics_url(url)
    except ValueError as exc:
        fail_usage(str(exc))
    store = open_store(db, None)

    with (
        store,
        Collector(
            target, store, interval_s=interval_s, timeout_s=timeout_s, max_body_bytes=max_body_bytes
        ) as collector,
    ):
        if once:
            _collect_once(collector, interval_s, as_json)
            return
        stop = threading.Event()

        def _stop(signum: int, frame: FrameType | None) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        if not as_json:
            out_console.print(
                f"collecting {collector.url} every {interval_s:g} s into {store!r}; Ctrl-C to stop", highlight=False
            )
        collector.run(stop)
        summary = _summary(collector)
        if as_json:
            print_json(summary)
        else:
            out_console.print(
                f"stopped: {summary['scrapes_ok']} good scrape(s), errors {summary['errors'] or 'none'}",
                highlight=False,
            )


def _collect_once(collector: Collector, interval_s: float, as_json: bool) -> None:
    first = collector.collect_once()
    if not first.ok:
        fail_runtime(_failure(first))
    time.sleep(interval_s)
    second = collector.collect_once()
    if not second.ok:
        fail_runtime(_failure(second))
    windows = [_window_dict(w) for w in second.windows]
    if as_json:
        print_json({**_summary(collector), "windows": windows, "events": [e.message for e in second.events]})
        return
    for w in windows:
        spec = w["spec"]
        acc = f"drafts {spec['drafts']}, accepted {spec['accepted_tokens']}" if spec else "speculation off"
        out_console.print(
            f"stored window {w['start']} → {w['end']} for {w['model_name']}/{w['engine']}: "
            f"{w['generation_tokens']:g} generated tokens, {acc}" + (" [reset]" if w["reset"] else ""),
            highlight=False,
        )
    for event in second.events:
        out_console.print(f"[yellow]{event.kind}:[/] {event.message}", highlight=False)


def _failure(result: CollectResult) -> str:
    if result.error is not None:
        return str(result.error)
    return f"could not store the window: {result.sink_error}"


def _window_dict(w: Any) -> dict[str, Any]:
    spec = w.spec
    return {
        "model_name": w.key.model_name,
        "engine": w.key.engine,
        "start": w.start.isoformat(),
        "end": w.end.isoformat(),
        "generation_tokens": w.generation_tokens,
        "prompt_tokens": w.prompt_tokens,
        "reset": w.reset,
        "spec": None
        if spec is None
        else {
            "drafts": spec.drafts,
            "draft_tokens": spec.draft_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "accepted_per_pos": list(spec.accepted_per_pos),
        },
    }


def _summary(collector: Collector) -> dict[str, Any]:
    return {
        "url": collector.url,
        "scrapes_ok": collector.scrapes_ok,
        "errors": dict(collector.errors),
        "last_success": collector.last_success.isoformat() if collector.last_success else None,
    }


def register(app: typer.Typer) -> None:
    app.command("collect")(collect)
