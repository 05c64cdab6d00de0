"""`spectuner tap`: a recording reverse proxy in front of vLLM's OpenAI API."""

from __future__ import annotations

import signal
from types import FrameType

import httpx
import typer
import uvicorn

from collectors.batch_writer import BatchWriter
from collectors.records import RequestRecord
from collectors.scrape import metrics_url
from collectors.tap import TRANSPORTS, TapProxy, create_tap_app, parse_listen, tune_process_for_latency
from tuner.cli.common import fail_runtime, fail_usage, out_console
from tuner.store import DatabaseUrlError, SchemaError, Store, resolve_db_url


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die by the
    signal; the tap has flushed its records by then and should exit 0, as the CLI contract says."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop now
        else:
            self.should_exit = True


def tap(
    upstream: str = typer.Option(..., "--upstream", help="The vLLM server to forward to (http://HOST:PORT)."),
    listen: str = typer.Option("127.0.0.1:8001", "--listen", help="Where clients connect: 127.0.0.1:PORT."),
    db: str | None = typer.Option(
        None, "--db", help="Database URL (default: $SPECTUNER_DB, else sqlite:///spectuner.db here)."
    ),
    no_record: bool = typer.Option(False, "--no-record", help="Forward only; store nothing."),
    batch_size: int = typer.Option(500, "--batch-size", help="Most records written in one transaction."),
    max_queue: int = typer.Option(10_000, "--max-queue", help="Records held for writing before new ones drop."),
    http_client: str = typer.Option(
        "lean", "--http-client", help="Upstream HTTP client: lean (default, fastest) or httpcore (httpx's own)."
    ),
    metrics_url_option: str | None = typer.Option(
        None,
        "--metrics-url",
        help="The engine's /metrics URL as the collector scrapes it (default: UPSTREAM/metrics); requests "
        "are tagged with the config in force on that engine.",
    ),
) -> None:
    """Forward OpenAI API traffic to vLLM untouched and store each response's per-request
    speculative-decoding metrics (vLLM needs --per-request-spec-decode-metrics summary|detailed;
    streaming clients need stream_options.include_usage, or vLLM --enable-force-include-usage)."""
    try:
        host, port = parse_listen(listen)
    except ValueError as exc:
        fail_usage(str(exc))
    try:
        parsed = httpx.URL(upstream)
    except httpx.InvalidURL as exc:
        fail_usage(f"--upstream {upstream!r} is not a URL ({exc}); write http://HOST:PORT")
    if parsed.scheme not in ("http", "https") or not parsed.host:
        fail_usage(f"--upstream {upstream!r} is not an http(s) URL; write http://HOST:PORT")
    if batch_size < 1 or max_queue < 1:
        fail_usage("--batch-size and --max-queue must be at least 1")
    if http_client not in TRANSPORTS:
        fail_usage(f"--http-client must be one of {', '.join(TRANSPORTS)}, not {http_client!r}")
    try:
        engine_metrics_url = metrics_url(metrics_url_option or upstream)
    except ValueError as exc:
        fail_usage(f"--metrics-url: {exc}")

    store: Store | None = None
    writer: BatchWriter[RequestRecord] | None = None
    if not no_record:
        try:
            store = Store(resolve_db_url(db))
        except (DatabaseUrlError, SchemaError) as exc:
            fail_usage(str(exc))
        from tuner.store.tagging import RequestConfigTagger

        tagger = RequestConfigTagger(store, engine_metrics_url)
        writer = BatchWriter(tagger, name="requests", batch_size=batch_size, max_queue=max_queue)
    proxy = TapProxy(upstream, writer, transport=http_client)
    app = create_tap_app(proxy, on_startup=tune_process_for_latency)
    out_console.print(
        f"tap: http://{listen} → {proxy.upstream}"
        + (f", recording into {store!r}" if store is not None else " (not recording)"),
        highlight=False,
    )
    # A proxy adds no headers of its own: the upstream's Date and Server pass through as sent. The
    # tap never reads client addresses, so uvicorn's X-Forwarded-For middleware is not wanted.
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        server_header=False,
        date_header=False,
        proxy_headers=False,
    )
    server = _Server(config)
    try:
        server.run()
    except OSError as exc:
        fail_runtime(f"cannot listen on {listen}: {exc}")
    finally:
        if store is not None:
            store.close()
    if not server.started:
        fail_runtime(f"the tap did not start on {listen} (is the port in use?)")


def register(app: typer.Typer) -> None:
    app.command("tap")(tap)
