"""The sampled traffic record: prompts and the target's outputs as token IDs, for shadow evaluation.

**This holds user data** (prompts and completions, as token IDs that decode back to text). It is
off unless configured, sampled (``sample_rate``), bounded (``max_bytes``; the oldest samples are
dropped first and counted), expires (``retention_s``), lives in its own directory (never in the
metrics database, so database backups and the exporters never carry it) and is deleted by one
command (``spectuner shadow forget``).

The tap calls :meth:`TrafficRecorder.observe` once per completed completion exchange, after the
client has its last byte. ``observe`` only draws the sample and queues the raw bodies (bounded queue,
a full queue drops and counts); a background thread parses, tokenises and writes, so recording never
sits on the request path. A streamed exchange is drawn before it starts (:meth:`TrafficRecorder.draw`)
and, when drawn, copied chunk by chunk (:class:`StreamCopy`, bounded) and queued whole at its end
(:meth:`TrafficRecorder.enqueue` with ``sse=True``); the thread folds its server-sent events into the
non-streamed response's shape (:func:`merge_sse_stream`), so a streamed and a non-streamed answer to the
same request give the same sample. Most production traffic is streamed: without this the record would
hold only the minority that is not.

Token IDs come from the response when the client asked vLLM for them (``return_token_ids``), else
the text is tokenised with the target's ``tokenizer.json`` (the ``tokenizers`` library, not the
engine): the prompt with special tokens as vLLM's completion endpoint adds them, the output without.
Re-tokenised output can differ from the generated IDs where the model produced a non-canonical
split; such samples carry ``ids_source = "tokenized"``. Chat requests need the chat template to
tokenise, so they are recorded only with ``return_token_ids``.

Files: ``DIR/segment-<first ts µs>.jsonl`` (one sample a line), rolled at ``max_bytes / 8``, and
``DIR/state.json`` (samples written and dropped for space or age, cumulative; saved at most every
``state_save_interval_s`` while appending, always on sweep and close).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from collectors.sse import data_payloads

logger = logging.getLogger(__name__)

Tokenize = Callable[[str, bool], list[int]]
"""(text, add_special_tokens) → token IDs."""

_SEGMENT_PREFIX = "segment-"
_STATE = "state.json"
_SEGMENTS_PER_CAP = 8


@dataclass(frozen=True)
class RecorderSettings:
    directory: Path
    sample_rate: float = 0.05
    """Share of eligible requests recorded (0 < rate ≤ 1)."""
    max_bytes: int = 256 * 1024 * 1024
    """Cap on the files in ``directory``; past it the oldest segment goes (its samples counted)."""
    retention_s: float = 7 * 24 * 3600.0
    """Samples older than this are deleted (whole segments, at the next write or sweep)."""
    max_queue: int = 256
    """Exchanges waiting to be tokenised; more are dropped and counted, never waited for."""
    state_save_interval_s: float = 5.0
    """Appends save ``state.json`` at most this often (rewriting it on every append was most of the
    recorder thread's CPU); a crash loses at most this long of counts. 0: on every append."""

    def __post_init__(self) -> None:
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"sample_rate must lie in (0, 1] but got {self.sample_rate!r}")
        if self.max_bytes < 4096:
            raise ValueError(f"max_bytes must be at least 4096 but got {self.max_bytes!r}")
        if self.retention_s <= 0 or self.max_queue < 1:
            raise ValueError("retention_s must be > 0 and max_queue ≥ 1")
        if not self.state_save_interval_s >= 0:
            raise ValueError(f"state_save_interval_s must be ≥ 0 but got {self.state_save_interval_s!r}")


@dataclass(frozen=True)
class TrafficSample:
    """One recorded exchange. ``greedy``: the request asked for temperature 0 (the target's tokens are
    its argmax, so greedy acceptance is exact); ``logprobs``: the response carried them."""

    ts: datetime
    request_id: str
    model: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    greedy: bool
    logprobs: bool
    ids_source: str  # "response" (vLLM's return_token_ids) or "tokenized"
    endpoint: str  # "completions" or "chat"

    def to_json(self) -> dict[str, Any]:
        # shallow: asdict() deep-copies every token id, most of an append's CPU for a long sample
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["ts"] = self.ts.isoformat()
        data["prompt_ids"] = list(self.prompt_ids)
        data["output_ids"] = list(self.output_ids)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TrafficSample:
        return cls(
            ts=datetime.fromisoformat(data["ts"]),
            request_id=str(data["request_id"]),
            model=str(data["model"]),
            prompt_ids=tuple(int(x) for x in data["prompt_ids"]),
            output_ids=tuple(int(x) for x in data["output_ids"]),
            greedy=bool(data["greedy"]),
            logprobs=bool(data["logprobs"]),
            ids_source=str(data["ids_source"]),
            endpoint=str(data["endpoint"]),
        )


class NotRecordable(ValueError):
    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


# A sampled stream is copied up to this size; a longer one (long outputs with logprobs) is not recorded.
STREAM_COPY_LIMIT_BYTES = 8 * 1024 * 1024


class StreamCopy:
    """The bytes of one sampled streamed response, kept while the tap relays it; past ``limit_bytes``
    the copy is dropped (``overflowed``) rather than holding an unbounded body in memory."""

    __slots__ = ("_parts", "_size", "limit_bytes", "overflowed")

    def __init__(self, limit_bytes: int = STREAM_COPY_LIMIT_BYTES) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self.limit_bytes = limit_bytes
        self.overflowed = False

    def feed(self, chunk: bytes) -> None:
        if self.overflowed:
            return
        self._size += len(chunk)
        if self._size > self.limit_bytes:
            self.overflowed = True
            self._parts = []
            return
        self._parts.append(chunk)

    def body(self) -> bytes:
        return b"".join(self._parts)


def merge_sse_stream(body: bytes) -> dict[str, Any]:
    """An OpenAI-style server-sent event stream (completions or chat) folded into the non-streamed
    response's shape for its first choice: the text (a chat delta's ``content``) and ``token_ids``
    joined in order, ``prompt_token_ids`` from the chunk that carried them (vLLM sends them once, with
    ``return_token_ids``). Output IDs are kept only when every chunk that carried text carried them too.
    ``NotRecordable`` when the stream holds no chunk, a chunk that is not JSON, or an error event."""
    events: list[dict[str, Any]] = []
    for payload in data_payloads(body):
        try:
            event = json.loads(payload)
        except ValueError as exc:
            raise NotRecordable("bad_json", f"a stream event is not JSON ({exc})") from exc
        if not isinstance(event, dict):
            raise NotRecordable("bad_json", "a stream event is not a JSON object")
        if "error" in event:
            raise NotRecordable("stream_error", f"the stream carried an error event: {str(event['error'])[:200]}")
        events.append(event)
    text: list[str] = []
    output_ids: list[int] = []
    saw_ids = saw_choice = logprobs = False
    ids_complete = True
    prompt_ids: Any = None
    response: dict[str, Any] = {"id": "", "model": "", "prompt_token_ids": None}
    for event in events:
        for key in ("id", "model"):
            if not response[key] and isinstance(event.get(key), str):
                response[key] = event[key]
        if response["prompt_token_ids"] is None and isinstance(event.get("prompt_token_ids"), list):
            response["prompt_token_ids"] = event["prompt_token_ids"]  # chat: on the first chunk
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n > 1: the first choice only, as for a non-streamed response
            saw_choice = True
            if prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                prompt_ids = choice["prompt_token_ids"]  # completions: on the first chunk
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            piece = piece if isinstance(piece, str) else ""
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                saw_ids = True
                output_ids.extend(ids)
            elif piece:
                ids_complete = False
            text.append(piece)
            logprobs = logprobs or choice.get("logprobs") is not None
    if not saw_choice:
        raise NotRecordable("no_choices", "the stream carried no choice")
    choice_out: dict[str, Any] = {
        "text": "".join(text),
        "token_ids": output_ids if saw_ids and ids_complete else None,
        "logprobs": {} if logprobs else None,
    }
    if prompt_ids is not None:  # absent, not None: a chat response's IDs sit beside the choices
        choice_out["prompt_token_ids"] = prompt_ids
    response["choices"] = [choice_out]
    return response


def sample_from_exchange(
    ts: datetime, request_body: bytes, response_body: bytes, tokenize: Tokenize | None, *, sse: bool = False
) -> TrafficSample:
    """Parse one completion exchange into a sample (``sse``: the response is a server-sent event
    stream); ``NotRecordable`` says why not."""
    try:
        req = json.loads(request_body)
        resp = merge_sse_stream(response_body) if sse else json.loads(response_body)
    except ValueError as exc:
        if isinstance(exc, NotRecordable):
            raise
        raise NotRecordable("bad_json", f"request or response is not JSON ({exc})") from exc
    if not isinstance(req, dict) or not isinstance(resp, dict):
        raise NotRecordable("bad_json", "request or response is not a JSON object")
    choices = resp.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise NotRecordable("no_choices", "the response has no choices")
    choice = choices[0]
    chat = "messages" in req
    prompt_ids = _ids(choice.get("prompt_token_ids", resp.get("prompt_token_ids")))
    output_ids = _ids(choice.get("token_ids"))
    source = "response"
    if prompt_ids is None or output_ids is None:
        if chat:
            raise NotRecordable("chat_without_token_ids", "chat prompts need return_token_ids to be recorded")
        if tokenize is None:
            raise NotRecordable("no_tokenizer", "no token IDs in the response and no tokenizer configured")
        prompt = req.get("prompt")
        text = choice.get("text")
        if not isinstance(prompt, str) or not isinstance(text, str):
            raise NotRecordable("not_text", "only a single string prompt can be tokenised")
        prompt_ids = tokenize(prompt, True) if prompt_ids is None else prompt_ids
        output_ids = tokenize(text, False) if output_ids is None else output_ids
        source = "tokenized"
    if not output_ids:
        raise NotRecordable("empty_output", "the response generated no tokens")
    temperature = req.get("temperature")
    greedy = (isinstance(temperature, int | float) and temperature == 0) or req.get("top_k") == 1
    return TrafficSample(
        ts=ts,
        request_id=str(resp.get("id") or ""),
        model=str(resp.get("model") or ""),
        prompt_ids=tuple(prompt_ids),
        output_ids=tuple(output_ids),
        greedy=bool(greedy),
        logprobs=choice.get("logprobs") is not None,
        ids_source=source,
        endpoint="chat" if chat else "completions",
    )


def _ids(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return None
    return list(value)


@dataclass
class SampleStoreStats:
    written: int = 0
    dropped_for_space: int = 0
    dropped_for_age: int = 0


class SampleStore:
    """Segments of JSON lines in one directory, capped in bytes and age; the oldest go first.

    The counters (``stats``) are saved to ``state.json`` by :meth:`sweep`, :meth:`flush` /
    :meth:`close` and, at most once per ``settings.state_save_interval_s`` (by ``clock``), by
    :meth:`append`: close the store on a clean shutdown (``TrafficRecorder.close`` does); a crash
    loses at most that interval's counts (the samples themselves are written at once)."""

    def __init__(self, settings: RecorderSettings, clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.settings = settings
        self.dir = Path(settings.directory)
        self.clock = clock
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.stats = self._load_state()
        self._dirty = False  # counts changed since the last save
        self._saved_at: float | None = None  # clock timestamp of the last save

    def _load_state(self) -> SampleStoreStats:
        try:
            data = json.loads((self.dir / _STATE).read_text())
            return SampleStoreStats(**{k: int(v) for k, v in data.items() if k in SampleStoreStats.__annotations__})
        except (OSError, ValueError, TypeError):
            return SampleStoreStats()

    def _save_state(self) -> None:
        tmp = self.dir / (_STATE + ".tmp")
        tmp.write_text(json.dumps(asdict(self.stats)))
        os.replace(tmp, self.dir / _STATE)
        self._dirty = False
        self._saved_at = self.clock().timestamp()

    def _save_state_throttled(self) -> None:
        self._dirty = True
        if self._saved_at is not None:
            elapsed = self.clock().timestamp() - self._saved_at
            if 0 <= elapsed < self.settings.state_save_interval_s:  # a clock stepped back saves now
                return
        self._save_state()

    def flush(self) -> None:
        """Save the counters if an append changed them since the last save."""
        with self._lock:
            if self._dirty:
                self._save_state()

    def close(self) -> None:
        """Save what is unsaved (a clean shutdown loses no counts); the store stays usable."""
        self.flush()

    def segments(self) -> list[Path]:
        return sorted(self.dir.glob(f"{_SEGMENT_PREFIX}*.jsonl"))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.segments())

    def append(self, samples: Sequence[TrafficSample]) -> None:
        if not samples:
            return
        lines = "".join(json.dumps(s.to_json(), separators=(",", ":")) + "\n" for s in samples).encode()
        with self._lock:
            segs = self.segments()
            roll = self.settings.max_bytes // _SEGMENTS_PER_CAP
            if not segs or segs[-1].stat().st_size + len(lines) > roll:
                micros = int(samples[0].ts.timestamp() * 1e6)
                path = self.dir / f"{_SEGMENT_PREFIX}{micros:017d}.jsonl"
                while path.exists():
                    micros += 1
                    path = self.dir / f"{_SEGMENT_PREFIX}{micros:017d}.jsonl"
            else:
                path = segs[-1]
            with path.open("ab") as fh:
                fh.write(lines)
            self.stats.written += len(samples)
            self._enforce_locked()
            self._save_state_throttled()

    def sweep(self) -> None:
        """Apply the age and size limits now (the shadow worker calls it before reading)."""
        with self._lock:
            self._enforce_locked()
            self._save_state()

    def _enforce_locked(self) -> None:
        segs = self.segments()
        horizon = self.clock().timestamp() - self.settings.retention_s
        # A segment's newest sample is at most as old as its file's modification time.
        while segs and segs[0].stat().st_mtime < horizon:
            self.stats.dropped_for_age += _count_lines(segs[0])
            segs.pop(0).unlink()
        total = sum(p.stat().st_size for p in segs)
        while segs and total > self.settings.max_bytes:
            oldest = segs.pop(0)
            total -= oldest.stat().st_size
            self.stats.dropped_for_space += _count_lines(oldest)
            oldest.unlink()

    def __iter__(self) -> Iterator[TrafficSample]:
        for seg in self.segments():
            try:
                text = seg.read_text()
            except FileNotFoundError:
                continue  # dropped while we read
            for line in text.splitlines():
                if line.strip():
                    yield TrafficSample.from_json(json.loads(line))

    def forget(self) -> int:
        """Delete every sample (and the counters); how many samples went."""
        with self._lock:
            n = 0
            for seg in self.segments():
                n += _count_lines(seg)
                seg.unlink()
            (self.dir / _STATE).unlink(missing_ok=True)
            self.stats = SampleStoreStats()
            self._dirty = False  # nothing to save: no state file means zero counts
            return n


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as fh:
            return sum(1 for _ in fh)
    except FileNotFoundError:
        return 0


@dataclass
class RecorderStats:
    seen: int = 0
    queued: int = 0
    recorded: int = 0
    not_recorded: Counter[str] = field(default_factory=Counter)


class TrafficRecorder:
    """The tap's hook: ``observe`` per completed exchange (cheap), a thread does the rest."""

    def __init__(
        self,
        store: SampleStore,
        tokenize: Tokenize | None,
        *,
        rng: random.Random | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.tokenize = tokenize
        self.rng = rng or random.Random()
        self.clock = clock
        self.stats = RecorderStats()
        self._queue: queue.Queue[tuple[datetime, bytes, bytes, bool] | None] = queue.Queue(store.settings.max_queue)
        self._thread: threading.Thread | None = None

    def draw(self) -> bool:
        """Count one eligible exchange and draw whether it is sampled (before a stream starts, so only
        sampled streams are copied)."""
        self.stats.seen += 1
        return self.rng.random() < self.store.settings.sample_rate

    def observe(self, request_body: bytes, response_body: bytes) -> None:
        """A completed non-streamed exchange: drawn, and queued when sampled."""
        if self.draw():
            self.enqueue(request_body, response_body)

    def enqueue(self, request_body: bytes, response_body: bytes, *, sse: bool = False) -> None:
        """Queue a drawn exchange (``sse``: the response is its server-sent event stream, whole)."""
        try:
            self._queue.put_nowait((self.clock(), request_body, response_body, sse))
            self.stats.queued += 1
        except queue.Full:
            self.stats.not_recorded["queue_full"] += 1

    def skip(self, reason: str) -> None:
        """A drawn exchange that could not be kept (a stream cut short or over the copy limit)."""
        self.stats.not_recorded[reason] += 1

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spectuner-traffic-record", daemon=True)
            self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread after what is queued, then save the store's counters (throttled while
        appending)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
            self._thread = None
        try:
            self.store.close()
        except OSError as exc:
            logger.warning("traffic record: cannot save the counters in %s: %s", self.store.dir, exc)

    def drain(self) -> None:
        """Process what is queued, in the caller's thread (tests; shutdown without a thread)."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._process([item])

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < 64:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._process(batch)
                    return
                batch.append(nxt)
            self._process(batch)

    def _process(self, items: Sequence[tuple[datetime, bytes, bytes, bool]]) -> None:
        samples = []
        for ts, req, resp, sse in items:
            try:
                samples.append(sample_from_exchange(ts, req, resp, self.tokenize, sse=sse))
            except NotRecordable as exc:
                self.stats.not_recorded[exc.reason] += 1
            except Exception as exc:  # a tokenizer bug must not kill the recorder thread
                self.stats.not_recorded["tokenize_error"] += 1
                logger.warning("traffic record: cannot tokenise a sample: %s", exc)
        try:
            self.store.append(samples)
            self.stats.recorded += len(samples)
        except OSError as exc:
            self.stats.not_recorded["write_error"] += len(samples)
            logger.warning("traffic record: cannot write %d samples to %s: %s", len(samples), self.store.dir, exc)

    def stats_dict(self) -> dict[str, object]:
        return {
            "seen": self.stats.seen,
            "queued": self.stats.queued,
            "recorded": self.stats.recorded,
            "not_recorded": dict(self.stats.not_recorded),
            "store": asdict(self.store.stats),
        }


def load_tokenizer(path: Path) -> Tokenize:
    """The target's ``tokenizer.json`` (a model directory or the file) as a :data:`Tokenize`."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no tokenizer.json (give the target model's directory)")
    tk = Tokenizer.from_file(str(file))

    def tokenize(text: str, add_special_tokens: bool) -> list[int]:
        return list(tk.encode(text, add_special_tokens=add_special_tokens).ids)

    return tokenize

