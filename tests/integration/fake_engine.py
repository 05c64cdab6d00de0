"""A tiny stand-in for a vLLM server, for actuator and daemon tests (no model, almost no CPU).

A real uvicorn/Starlette process on 127.0.0.1 serving ``/health`` and a vLLM-shaped ``/metrics``
page. It takes the flags the restart actuator passes (``--speculative-config JSON``,
``--shutdown-timeout S``) and:

- exits with code 3 and an error on stderr when the config names a draft ``model`` path that does not
  exist (what vLLM does with a bad draft path), or when the JSON is not an object;
- otherwise serves spec-decode counters that grow as an i.i.d. draft with acceptance ``--alpha``
  would make them at the config's K: per second ``--drafts-per-s`` drafts, a_i = D·α^(i+1), and
  generated tokens at a rate proportional to Leviathan's speedup E(α, K) / (K·c + 1) — so a better K
  really does raise the measured throughput.

Run: ``python tests/integration/fake_engine.py --port P [--speculative-config '{...}'] [--alpha 0.8]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--speculative-config", default=None)
    p.add_argument("--shutdown-timeout", type=float, default=0.0)
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--cost-ratio", type=float, default=0.05)
    p.add_argument("--drafts-per-s", type=float, default=200.0)
    p.add_argument("--base-tokens-per-s", type=float, default=100.0)
    p.add_argument("--running", type=float, default=1.0)
    p.add_argument("--model-name", default="fake-target")
    p.add_argument("--startup-delay-s", type=float, default=0.0)
    p.add_argument("--slow-start-k", type=int, default=None, help="delay the start only for this K")
    return p.parse_args(argv)


def page(config: dict[str, Any] | None, args: argparse.Namespace, elapsed_s: float, created_s: float) -> str:
    labels = f'engine="0",model_name="{args.model_name}"'
    k = int(config.get("num_speculative_tokens", 0)) if config and config.get("method") != "off" else 0
    alpha, c = args.alpha, args.cost_ratio
    e = sum(alpha**i for i in range(k + 1))
    speedup = e / (k * c + 1.0)
    lines: list[str] = []

    def counter(name: str, value: float, extra: str = "") -> None:
        lab = labels + (f",{extra}" if extra else "")
        lines.append(f"# TYPE {name} counter")
        lines.append(f"{name}_total{{{lab}}} {float(value)}")
        lines.append(f"{name}_created{{{lab}}} {created_s}")

    counter("vllm:generation_tokens", int(args.base_tokens_per_s * speedup * elapsed_s))
    counter("vllm:prompt_tokens", int(10 * elapsed_s))
    lines.append("# TYPE vllm:num_requests_running gauge")
    lines.append(f"vllm:num_requests_running{{{labels}}} {args.running}")
    if k > 0:
        d = int(args.drafts_per_s * elapsed_s)
        per_pos = [int(d * alpha ** (i + 1)) for i in range(k)]
        counter("vllm:spec_decode_num_drafts", d)
        counter("vllm:spec_decode_num_draft_tokens", d * k)
        counter("vllm:spec_decode_num_accepted_tokens", sum(per_pos))
        lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter")
        for i, a in enumerate(per_pos):
            lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {float(a)}')
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config: dict[str, Any] | None = None
    if args.speculative_config is not None:
        try:
            config = json.loads(args.speculative_config)
        except ValueError as exc:
            print(f"error: --speculative-config is not JSON: {exc}", file=sys.stderr)
            return 3
        if not isinstance(config, dict):
            print("error: --speculative-config must be a JSON object", file=sys.stderr)
            return 3
        model = config.get("model")
        if model is not None and not Path(str(model)).exists():
            print(f"error: draft model path {model!r} does not exist", file=sys.stderr)
            return 3
    k = int(config.get("num_speculative_tokens", 0)) if config else 0
    if args.startup_delay_s > 0 and args.slow_start_k in (None, k):
        time.sleep(args.startup_delay_s)
    started = time.monotonic()
    created_s = time.time()

    async def health(request: Request) -> PlainTextResponse:
        return PlainTextResponse("")

    async def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(page(config, args, time.monotonic() - started, created_s))

    async def info(request: Request) -> JSONResponse:
        return JSONResponse({"speculative_config": config, "pid": os.getpid()})

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": args.model_name, "object": "model"}]})

    async def completions(request: Request) -> JSONResponse:
        # A deterministic answer that takes a while, so a drain has something in flight to wait for.
        body = await request.json()
        await asyncio.sleep(float(body.get("delay_s", 0.2)))
        text = " ".join(f"t{i}" for i in range(int(body.get("max_tokens", 4))))
        return JSONResponse({"choices": [{"index": 0, "text": text}], "pid": os.getpid()})

    app = Starlette(
        routes=[
            Route("/health", health), Route("/metrics", metrics), Route("/info", info), Route("/v1/models", models),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )
    print(f"fake engine pid {os.getpid()} serving config {config}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
