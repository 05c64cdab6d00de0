"""A steady background workload for closed-loop runs: ``concurrency`` greedy requests always in flight.

Unlike :func:`tuner.lab.load.run_load` (a fixed batch of requests), this keeps going until stopped,
so the controller sees a stationary load; the prompts and concurrency can change between phases.
It rides out engine restarts (a refused connection waits and retries) and keeps every completion
with its finish time, so goodput can be cut by phase afterwards.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx


@dataclass(frozen=True)
class Completion:
    finished_at: float  # time.monotonic()
    latency_s: float
    output_tokens: int
    phase: str


@dataclass
class PhaseStats:
    phase: str
    started_at: float
    ended_at: float
    completions: list[Completion] = field(default_factory=list)
    errors: int = 0

    @property
    def duration_s(self) -> float:
        return max(self.ended_at - self.started_at, 1e-9)

    @property
    def tokens(self) -> int:
        return sum(c.output_tokens for c in self.completions)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration_s

    def latency_quantile(self, q: float) -> float | None:
        lat = sorted(c.latency_s for c in self.completions)
        if len(lat) < 2:
            return lat[0] if lat else None
        return float(statistics.quantiles(lat, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))])


class BackgroundLoad:
    """Threads that each keep one request in flight; :meth:`set_phase` changes prompts/concurrency."""

    def __init__(self, base_url: str, model: str, max_tokens: int = 48, timeout_s: float = 120.0) -> None:
        self.url = base_url.rstrip("/") + "/v1/completions"
        self.model = model
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._prompts: Sequence[str] = ()
        self._cycle = itertools.cycle([""])
        self._concurrency = 0
        self._phase = "idle"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.phases: list[PhaseStats] = []

    def set_phase(self, name: str, prompts: Sequence[str], concurrency: int) -> None:
        """Start a new phase now (requests in flight finish and count for the phase they finish in)."""
        if concurrency < 0 or (concurrency and not prompts):
            raise ValueError("need concurrency >= 0 and prompts when concurrency > 0")
        now = time.monotonic()
        with self._lock:
            if self.phases:
                self.phases[-1].ended_at = now
            self.phases.append(PhaseStats(name, now, now))
            self._prompts = tuple(prompts)
            self._cycle = itertools.cycle(self._prompts or ("",))
            self._concurrency = concurrency
            self._phase = name
        while len(self._threads) < concurrency:
            t = threading.Thread(target=self._worker, args=(len(self._threads),), daemon=True, name="lab-load")
            self._threads.append(t)
            t.start()

    def stop(self) -> list[PhaseStats]:
        with self._lock:
            if self.phases:
                self.phases[-1].ended_at = time.monotonic()
            self._concurrency = 0
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s)
        return self.phases


    def _next(self, index: int) -> str | None:
        with self._lock:
            if index >= self._concurrency:
                return None
            return next(self._cycle)

    def _record(self, done: Completion | None) -> None:
        with self._lock:
            if not self.phases:
                return
            current = self.phases[-1]
            if done is None:
                current.errors += 1
            else:
                current.completions.append(Completion(done.finished_at, done.latency_s, done.output_tokens,
                                                      current.phase))

    def _worker(self, index: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                prompt = self._next(index)
                if prompt is None:  # this slot is idle at the current concurrency
                    self._stop.wait(0.1)
                    continue
                body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens,
                        "temperature": 0.0, "ignore_eos": True}
                t0 = time.monotonic()
                try:
                    resp = client.post(self.url, json=body)
                    resp.raise_for_status()
                    tokens = int((resp.json().get("usage") or {}).get("completion_tokens", 0))
                except (httpx.HTTPError, ValueError):
                    self._record(None)
                    self._stop.wait(0.5)  # the engine is restarting: wait, then try again
                    continue
                now = time.monotonic()
                self._record(Completion(now, now - t0, tokens, ""))


__all__ = ["BackgroundLoad", "Completion", "PhaseStats"]
