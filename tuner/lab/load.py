"""A small, bounded load generator for the lab engine: greedy completions at a fixed concurrency."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(frozen=True)
class RequestResult:
    prompt: str
    text: str
    prompt_tokens: int
    output_tokens: int
    latency_s: float
    spec: dict[str, Any] | None  # the response's metrics.speculative_decoding, when present
    status_code: int = 200
    error: str | None = None


@dataclass
class LoadResult:
    requests: list[RequestResult] = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.requests if r.error is None]

    @property
    def errors(self) -> int:
        return len(self.requests) - len(self.ok)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.ok)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def latency_quantile(self, q: float) -> float | None:
        lat = sorted(r.latency_s for r in self.ok)
        if not lat:
            return None
        if len(lat) == 1:
            return lat[0]
        return float(statistics.quantiles(lat, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))])

    def spec_totals(self) -> dict[str, int]:
        """Sum of per-request spec metrics: drafts (spec steps), draft tokens, accepted tokens."""
        tot = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        for r in self.ok:
            if r.spec:
                tot["drafts"] += int(r.spec.get("num_spec_steps", 0))
                tot["draft_tokens"] += int(r.spec.get("num_draft_tokens", 0))
                tot["accepted_tokens"] += int(r.spec.get("num_accepted_draft_tokens", 0))
        return tot

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.requests),
            "errors": self.errors,
            "output_tokens": self.output_tokens,
            "elapsed_s": round(self.elapsed_s, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "p50_latency_s": self.latency_quantile(0.5),
            "p99_latency_s": self.latency_quantile(0.99),
            **self.spec_totals(),
        }


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    try:
        resp = await client.post(url, json=body)
    except httpx.HTTPError as e:
        return RequestResult(prompt, "", 0, 0, time.perf_counter() - t0, None, 0, f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - t0
    if resp.status_code != 200:
        return RequestResult(prompt, "", 0, 0, latency, None, resp.status_code, resp.text[:200])
    data = resp.json()
    usage = data.get("usage") or {}
    metrics = data.get("metrics") or {}
    return RequestResult(
        prompt=prompt,
        text=data["choices"][0].get("text", ""),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=int(usage.get("completion_tokens", 0)),
        latency_s=latency,
        spec=metrics.get("speculative_decoding"),
    )


async def run_load_async(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    concurrency: int = 1,
    count: int = 16,
    max_tokens: int = 64,
    timeout_s: float = 120.0,
) -> LoadResult:
    if concurrency < 1 or count < 0 or max_tokens < 1:
        raise ValueError(f"need concurrency >= 1, count >= 0, max_tokens >= 1; got {concurrency}, {count}, "
                         f"{max_tokens}")
    if not prompts:
        raise ValueError("no prompts given")
    url = base_url.rstrip("/") + "/v1/completions"
    queue = list(itertools.islice(itertools.cycle(prompts), count))
    result = LoadResult()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def worker() -> None:
            while queue:
                prompt = queue.pop(0)
                result.requests.append(await _one(client, url, model, prompt, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, max(count, 1)))))
        result.elapsed_s = time.perf_counter() - t0
    return result


def run_load(
    base_url: str,
    model: str,
    prompts: Sequence[str],
    concurrency: int = 1,
    count: int = 16,
    max_tokens: int = 64,
    timeout_s: float = 120.0,
) -> LoadResult:
    """Send ``count`` greedy completion requests, ``concurrency`` at a time; blocks until done."""
    return asyncio.run(run_load_async(base_url, model, prompts, concurrency, count, max_tokens, timeout_s))
