"""Shadow evaluation's cost (issue #21): CPU seconds per 1 000 recorded output tokens per candidate, and
the lab engine's throughput with the shadow worker running beside it vs not.

1. The lab engine (``good`` draft, K = 3) serves greedy completions of predictable and hard prompts
   with ``return_token_ids``; every exchange goes through the traffic recorder (sample rate 1).
2. Each lab candidate is replayed on that record in this process (``tuner.shadow.evaluate``, one
   torch thread, after one warm-up pass): CPU seconds (process time, model load included) per 1 000
   output tokens.
3. Engine throughput (generated tokens/s of a fixed closed-loop load) in alternating phases: no
   worker, worker, no worker, worker … The worker is a child process replaying every candidate in a
   loop at the settings ``spectuner shadow run`` uses by default (nice 19, one thread, at most 0.1 of
   a core). The ratio is
   median(with) / median(without); the target is a cost below 3 %.

    .venv/bin/python bench/bench_shadow.py [--rounds 3] [--count 48] [--max-tokens 64]

Writes ``bench/results/shadow.json`` and ``shadow.md``. Needs one engine (~1 min to start on the lab
box) and ~3–5 min in all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from collectors.traffic_record import RecorderSettings, SampleStore, TrafficRecorder  # noqa: E402
from tuner.lab.load import run_load  # noqa: E402
from tuner.lab.models import DEFAULT_MODELS_DIR, load_manifest  # noqa: E402
from tuner.lab.prompts import HARD, PREDICTABLE  # noqa: E402
from tuner.lab.serve import LabServer  # noqa: E402
from tuner.shadow import ShadowCandidate, Throttle, evaluate, limit_resources  # noqa: E402

NGRAM_EXTRA = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}


def candidates(models_dir: Path) -> list[ShadowCandidate]:
    manifest = load_manifest(models_dir)
    return [
        ShadowCandidate(name, info.method, info.path or None, NGRAM_EXTRA if info.method == "ngram" else {})
        for name, info in manifest.drafts.items()
    ]


def record(server: LabServer, directory: Path, prompts: list[str], max_tokens: int) -> SampleStore:
    store = SampleStore(RecorderSettings(directory, sample_rate=1.0))
    recorder = TrafficRecorder(store, None)
    with httpx.Client(timeout=120) as client:
        for p in prompts:
            body = json.dumps({"model": server.model_name, "prompt": p, "max_tokens": max_tokens,
                               "temperature": 0, "return_token_ids": True}).encode()
            resp = client.post(f"{server.base_url}/v1/completions", content=body,
                               headers={"content-type": "application/json"})
            resp.raise_for_status()
            recorder.observe(body, resp.content)
    recorder.drain()
    return store


def worker(models_dir: Path, samples: Path, nice: int, threads: int, cpu_share: float) -> None:
    """The shadow worker as a daemon would run it: every candidate, over and over."""
    limit_resources(threads, nice)
    throttle = Throttle(cpu_share)
    target = Path(load_manifest(models_dir).target.path)
    data = list(SampleStore(RecorderSettings(samples)))
    while True:
        for cand in candidates(models_dir):
            evaluate(cand, data, target=target, k=3, threads=threads, max_model_len=512, throttle=throttle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=REPO / DEFAULT_MODELS_DIR)
    ap.add_argument("--rounds", type=int, default=3, help="pairs of (no worker, worker) load phases")
    ap.add_argument("--count", type=int, default=48, help="requests per load phase")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--nice", type=int, default=19)
    ap.add_argument("--cpu-share", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="shadow")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # internal: run the worker on these samples
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.models_dir, args.worker, args.nice, args.threads, args.cpu_share)
        return

    prompts = list(PREDICTABLE[:24]) + list(HARD[:24])
    target = Path(load_manifest(args.models_dir).target.path)
    with tempfile.TemporaryDirectory(prefix="bench-shadow-") as tmp:
        work = Path(tmp)
        server = LabServer(draft="good", k=3, models_dir=args.models_dir, workdir=work / "engine")
        startup_s = server.start()
        try:
            store = record(server, work / "record", prompts, args.max_tokens)
            samples = list(store)
            out_tokens = sum(len(s.output_ids) for s in samples)
            print(f"recorded {len(samples)} samples, {out_tokens} output tokens (engine up in {startup_s:.0f} s)")

            import torch

            torch.set_num_threads(args.threads)
            cost: dict[str, Any] = {}
            # one warm-up pass: imports and the first model load are paid once per worker, not per token
            evaluate(candidates(args.models_dir)[0], samples[:2], target=target, k=3, threads=args.threads)
            for cand in candidates(args.models_dir):
                t0 = time.perf_counter()
                outcome = evaluate(cand, samples, target=target, k=3, threads=args.threads, max_model_len=512)
                wall = time.perf_counter() - t0
                alpha, _ = outcome.alpha()
                cost[cand.name] = {
                    "method": cand.method,
                    "cpu_s": round(outcome.cpu_s, 3),
                    "wall_s": round(wall, 3),
                    "cpu_s_per_1000_tokens": round(1000 * outcome.cpu_s / max(outcome.replay.output_tokens, 1), 4),
                    "alpha": alpha,
                }
                print(f"  {cand.name:7s} {cost[cand.name]['cpu_s_per_1000_tokens']:.4f} CPU s / 1000 tokens, α̂ {alpha}")

            phases: list[dict[str, Any]] = []
            for r in range(args.rounds):
                for with_worker in (False, True):
                    proc = None
                    if with_worker:
                        proc = subprocess.Popen(
                            [sys.executable, __file__, "--worker", str(work / "record"), "--models-dir",
                             str(args.models_dir), "--nice", str(args.nice), "--threads", str(args.threads),
                             "--cpu-share", str(args.cpu_share)],
                            env={**os.environ, "PYTHONPATH": str(REPO)},
                        )
                        time.sleep(8.0)  # past its imports and first model loads: measure the steady state
                    try:
                        load = run_load(server.base_url, server.model_name, prompts, args.concurrency, args.count,
                                        args.max_tokens)
                    finally:
                        if proc is not None:
                            proc.terminate()
                            proc.wait(30)
                    phases.append({"round": r, "worker": with_worker, "tokens_per_s": round(load.tokens_per_s, 2),
                                   "errors": load.errors})
                    print(f"  round {r} worker={with_worker!s:5s} {load.tokens_per_s:.1f} tokens/s")
        finally:
            server.stop()

    without = statistics.median(p["tokens_per_s"] for p in phases if not p["worker"])
    with_w = statistics.median(p["tokens_per_s"] for p in phases if p["worker"])
    ratio = with_w / without
    result = {
        "when": datetime.now(UTC).isoformat(),
        "machine": f"{os.cpu_count()} CPUs",
        "samples": len(samples),
        "output_tokens": out_tokens,
        "cost_per_candidate": cost,
        "engine": {"phases": phases, "tokens_per_s_without": without, "tokens_per_s_with": with_w,
                   "ratio_with_over_without": round(ratio, 4), "cost_pct": round(100 * (1 - ratio), 2),
                   "target_cost_pct": 3.0, "worker_nice": args.nice, "worker_threads": args.threads,
                   "worker_cpu_share": args.cpu_share},
    }
    out_dir = REPO / "bench" / "results"
    (out_dir / f"{args.out}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Shadow evaluation cost (bench/bench_shadow.py)",
        "",
        f"{len(samples)} recorded lab requests, {out_tokens} output tokens; {os.cpu_count()} CPUs.",
        "",
        "| candidate | method | CPU s / 1 000 tokens | α̂ |",
        "|---|---|---|---|",
        *[
            f"| {n} | {c['method']} | {c['cpu_s_per_1000_tokens']:.4f} | "
            f"{'—' if c['alpha'] is None else format(c['alpha'], '.3f')} |"
            for n, c in cost.items()
        ],
        "",
        f"Engine throughput (median of {args.rounds} phases each): without the worker {without:.1f} tokens/s, "
        f"with it {with_w:.1f} tokens/s: ratio {ratio:.3f} (cost {100 * (1 - ratio):.1f} %, target < 3 %; "
        f"worker nice {args.nice}, {args.threads} thread, CPU share {args.cpu_share:g} of a core).",
        "",
    ]
    (out_dir / f"{args.out}.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
