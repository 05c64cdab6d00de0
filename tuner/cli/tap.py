"""`spectuner tap`: a recording reverse proxy in front of vLLM's OpenAI API."""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType

import httpx
import typer
import uvicorn

from collectors.batch_writer import BatchWriter
from collectors.front_door import DEFAULT_MAX_HELD, DEFAULT_MAX_HOLD_S, FrontDoor
from collectors.records import RequestRecord
from collectors.scrape import metrics_url
from collectors.tap import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_READ_TIMEOUT_S,
    TRANSPORTS,
    TapProxy,
    bind_listen,
    create_tap_app,
    parse_listen,
    tune_process_for_latency,
)
from collectors.traffic_record import TrafficRecorder
from tuner.actuators.front_door import load_or_create_control_token
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


def _traffic_recorder(
    directory: Path, tokenizer: Path | None, sample_rate: float, max_bytes: int, retention_s: float
) -> TrafficRecorder:
    from collectors.traffic_record import RecorderSettings, SampleStore, load_tokenizer

    try:
        settings = RecorderSettings(directory, sample_rate, max_bytes, retention_s)
        tokenize = load_tokenizer(tokenizer) if tokenizer is not None else None
        return TrafficRecorder(SampleStore(settings), tokenize)
    except (ValueError, OSError) as exc:
        fail_usage(f"--record-*: {exc}")


def tap(
    upstreams: list[str] = typer.Option(
        ..., "--upstream", help="The vLLM server to forward to (http://HOST:PORT); repeat for several replicas."
    ),
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
    read_timeout_s: float = typer.Option(
        DEFAULT_READ_TIMEOUT_S, "--read-timeout-s",
        help="Longest silence from the upstream (first byte, then between chunks) before the client gets a 504.",
    ),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, "--max-body-bytes", help="Larger request bodies get a 413 and are not read."
    ),
    control_token_file: Path | None = typer.Option(
        None, "--control-token-file",
        help="Turn on the front-door control endpoint (POST /_spectuner/control) with the token in this file "
        "(created 0600 if missing); the sidecar's drain-and-hold / blue-green apply drives it.",
    ),
    max_hold_s: float = typer.Option(
        DEFAULT_MAX_HOLD_S, "--max-hold-s", help="Longest a request is held during a change; then 503 + Retry-After."
    ),
    max_held: int = typer.Option(DEFAULT_MAX_HELD, "--max-held", help="Held requests beyond this get a 503 at once."),
    record_dir: Path | None = typer.Option(
        None, "--record-dir",
        help="Keep a sampled record of prompts and outputs as token IDs here, for `spectuner shadow run` "
        "(USER DATA; off by default; `spectuner shadow forget` deletes it).",
    ),
    record_tokenizer: Path | None = typer.Option(
        None, "--record-tokenizer", help="The target model's directory (its tokenizer.json), to tokenise text "
        "when clients did not ask vLLM for return_token_ids.",
    ),
    record_sample_rate: float = typer.Option(0.05, "--record-sample-rate", help="Share of requests recorded."),
    record_max_bytes: int = typer.Option(256 * 1024 * 1024, "--record-max-bytes", help="Size cap of the record."),
    record_retention_s: float = typer.Option(7 * 86400.0, "--record-retention-s", help="Age limit of a sample."),
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
    for upstream in upstreams:
        try:
            parsed = httpx.URL(upstream)
        except httpx.InvalidURL as exc:
            fail_usage(f"--upstream {upstream!r} is not a URL ({exc}); write http://HOST:PORT")
        if parsed.scheme not in ("http", "https") or not parsed.host:
            fail_usage(f"--upstream {upstream!r} is not an http(s) URL; write http://HOST:PORT")
    upstream = upstreams[0]
    if batch_size < 1 or max_queue < 1 or max_held < 1 or max_body_bytes < 1:
        fail_usage("--batch-size, --max-queue, --max-held and --max-body-bytes must be at least 1")
    for name, value in (("--read-timeout-s", read_timeout_s), ("--max-hold-s", max_hold_s)):
        if not 0 < value < float("inf"):
            fail_usage(f"{name} must be a positive number of seconds but got {value}")
    token: str | None = None
    if control_token_file is not None:
        try:
            token = load_or_create_control_token(control_token_file)
        except (OSError, ValueError) as exc:
            fail_usage(f"--control-token-file: {exc}")
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
    traffic = None
    if record_dir is not None:
        traffic = _traffic_recorder(
            record_dir, record_tokenizer, record_sample_rate, record_max_bytes, record_retention_s
        )
    elif record_tokenizer is not None:
        fail_usage("--record-tokenizer needs --record-dir (the record is off without it)")
    door = FrontDoor(upstreams, max_hold_s=max_hold_s, max_held=max_held)
    proxy = TapProxy(
        upstreams, writer, transport=http_client, read_timeout_s=read_timeout_s, max_body_bytes=max_body_bytes,
        door=door, control_token=token, traffic=traffic,
    )
    app = create_tap_app(proxy, on_startup=tune_process_for_latency)
    try:
        # Bound here, before uvicorn: a port in use is one clear line and exit 2, not uvicorn's exit 3.
        sock = bind_listen(host, port)
    except OSError as exc:
        if store is not None:
            store.close()
        fail_usage(f"cannot listen on {listen}: {exc.strerror or exc} (is another server on that port?)")
    out_console.print(
        f"tap: http://{listen} → {', '.join(door.upstreams)}"
        + (f", recording into {store!r}" if store is not None else " (not recording)"),
        highlight=False,
    )
    # A proxy adds no headers of its own: the upstream's Date and Server pass through as sent. The
    # tap never reads client addresses, so uvicorn's X-Forwarded-For middleware is not wanted.
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        lifespan="on",
        server_header=False,
        date_header=False,
        proxy_headers=False,
    )
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    except OSError as exc:
        fail_runtime(f"cannot serve on {listen}: {exc}")
    finally:
        sock.close()
        if store is not None:
            store.close()
    if not server.started:
        fail_runtime(f"the tap did not start on {listen} (is the port in use?)")


def register(app: typer.Typer) -> None:
    app.command("tap")(tap)
