"""Benchmark: skipping the draft model's pass in K = 0 steps (``[plugin] skip_draft_pass_at_k0``).

vLLM's model drafts (draft_model, EAGLE, MTP) run the draft's first forward at every step, K = 0
included, to keep the draft's KV cache whole. Under a per-batch-size table whose K = 0 rows cover a
full batch that pass is the whole difference between "the table turns speculation off here" and plain
decoding. The plugin can skip it (``SPECTUNER_SKIP_K0_DRAFT_PASS=1``); the price is a draft cache with
holes for requests that lived through K = 0 steps. Measured side by side in one run, on the lab models
(gpu-like by default), each engine an offline vLLM in a process of its own, visited ``--visits`` times in
rotation (machine drift hits every engine alike):

1. **Throughput at 64 streams** (greedy, ``--tokens`` tokens each, all at once) of the engines
   (``--engines``): ``off`` (no speculation), ``runs`` (the good draft, table K = 3 up to 8 sequences and
   K = 0 above: vLLM's own behaviour), ``skipped`` (the same table, the pass skipped in decode-only steps)
   and ``all`` (``SPECTUNER_SKIP_K0_DRAFT_PASS=all``: steps with a prompt skip it too; only without prefix
   caching, so ``all`` needs ``--no-prefix-caching``, which starts every engine without it). Ratios
   skipped ÷ runs, skipped ÷ off, all ÷ off.
2. **Acceptance of requests that lived through K = 0** on ``runs`` and ``skipped``: 8 long requests
   (``--long-tokens``) among 56 short ones (``--short-tokens``) start together at 64 sequences (K = 0:
   the prompts and first tokens skip the draft), then draft at K = 3 once the short ones are done;
   beside it, 8 fresh requests at K = 3 from their start. Greedy outputs of the long requests are
   compared with the fresh ones' (the target verifies every token: they must be identical).

    .venv/bin/python bench/bench_k0_pass.py [--models-dir .lab/gpu-models] [--visits 2]
    .venv/bin/python bench/bench_k0_pass.py --engines off,runs,skipped,all --no-prefix-caching \
        --out bench/results/k0_pass_all.json

Writes bench/results/k0_pass.json and k0_pass.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from collectors.vllm_plugin import env  # noqa: E402
from tuner.lab.models import GPU_LIKE_MODELS_DIR, load_manifest  # noqa: E402
from tuner.lab.serve import engine_tmp_dir  # noqa: E402

RESULTS = REPO / "bench" / "results"
TABLE = [[1, 8, 3], [9, 64, 0]]
ENGINES = ("off", "runs", "skipped", "all")


def worker(args: dict[str, Any]) -> dict[str, Any]:
    """One engine: throughput at 64 streams, then (with a draft) acceptance through K = 0. Runs in its own
    process (vLLM's engine core is spawned from a ``__main__``)."""
    from vllm import LLM, SamplingParams

    from tuner.lab.corpus import hard_prompts, predictable_prompts

    kw: dict[str, Any] = {
        "model": args["target"], "tokenizer": args["tokenizer"], "dtype": "float32", "max_model_len": 512,
        "max_num_seqs": 64, "enforce_eager": True, "disable_log_stats": False, "seed": 0,
        "enable_prefix_caching": args["prefix_caching"],
    }
    if args["draft"]:
        kw["speculative_config"] = {"method": "draft_model", "model": args["draft"], "num_speculative_tokens": 3,
                                    "num_speculative_tokens_per_batch_size": TABLE}
    llm = LLM(**kw)
    mix = [p for pair in zip(predictable_prompts(n=64), hard_prompts(n=64), strict=True) for p in pair]

    def sampling(n: int) -> Any:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def counters() -> dict[str, float]:
        out: dict[str, float] = {}
        for m in llm.get_metrics():
            value = getattr(m, "value", None)
            if m.name.startswith("vllm:spec_decode_num_") and isinstance(value, int | float):
                out[m.name] = float(value)
        return out

    def rate(a: dict[str, float], b: dict[str, float]) -> dict[str, float | None]:
        drafted = b.get("vllm:spec_decode_num_draft_tokens", 0.0) - a.get("vllm:spec_decode_num_draft_tokens", 0.0)
        accepted = b.get("vllm:spec_decode_num_accepted_tokens", 0.0) - a.get(
            "vllm:spec_decode_num_accepted_tokens", 0.0)
        return {"draft_tokens": drafted, "accepted_tokens": accepted,
                "acceptance": round(accepted / drafted, 4) if drafted else None}

    llm.generate(mix[:2], sampling(8), use_tqdm=False)  # first-call allocations are not a step cost
    out: dict[str, Any] = {"tok_s_64": []}
    for _ in range(args["reps"]):
        t = time.perf_counter()
        outs = llm.generate(mix[:64], sampling(args["tokens"]), use_tqdm=False)
        out["tok_s_64"].append(round(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t), 1))
    if args["draft"]:
        c0 = counters()
        params = [sampling(args["long_tokens"]) if i < 8 else sampling(args["short_tokens"]) for i in range(64)]
        through = llm.generate(mix[:64], params, use_tqdm=False)
        c1 = counters()
        fresh = llm.generate(mix[:8], sampling(args["long_tokens"]), use_tqdm=False)
        c2 = counters()
        out["through_k0"], out["fresh"] = rate(c0, c1), rate(c1, c2)
        pairs = zip(through[:8], fresh, strict=True)
        out["same_text"] = all(list(a.outputs[0].token_ids) == list(b.outputs[0].token_ids) for a, b in pairs)
    return out


def run_engine(name: str, models_dir: Path, work: Path, args: argparse.Namespace, visit: int) -> dict[str, Any]:
    manifest = load_manifest(models_dir)
    run_dir = work / f"{name}-{visit}"
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "target": manifest.target.path, "tokenizer": manifest.tokenizer_path,
        "draft": None if name == "off" else manifest.drafts["good"].path,
        "reps": args.reps, "tokens": args.tokens, "long_tokens": args.long_tokens, "short_tokens": args.short_tokens,
        "prefix_caching": args.prefix_caching,
    }
    tmp, owned = engine_tmp_dir(run_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    environ = {**os.environ, "TMPDIR": str(tmp), "VLLM_CACHE_ROOT": str(run_dir / "vllm-cache"),
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_KVCACHE_SPACE": "4", "PYTHONPATH": str(REPO)}
    environ.pop(env.SKIP_K0_DRAFT_PASS, None)
    if name in ("skipped", "all"):
        environ[env.SKIP_K0_DRAFT_PASS] = "1" if name == "skipped" else "all"
    out = run_dir / "result.json"
    print(f"== {name} (visit {visit + 1})", flush=True)
    try:
        with (run_dir / "engine.log").open("w") as log:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec), str(out)], env=environ,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=900, check=False)
    finally:
        if owned:
            shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{name}: the engine exited with {proc.returncode}; see {run_dir / 'engine.log'}")
    result: dict[str, Any] = json.loads(out.read_text())
    print(f"   64 streams: {result['tok_s_64']} tok/s"
          + (f"; acceptance through K = 0 {result['through_k0']['acceptance']}, fresh {result['fresh']['acceptance']}"
             if "fresh" in result else ""), flush=True)
    return result


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    tok = {name: statistics.median(x for r in rs for x in r["tok_s_64"]) for name, rs in runs.items()}
    drafting = [name for name in runs if name != "off"]

    def pooled(name: str, part: str) -> float | None:
        drafted = sum(r[part]["draft_tokens"] for r in runs[name])
        return round(sum(r[part]["accepted_tokens"] for r in runs[name]) / drafted, 4) if drafted else None

    ratios = {f"{a}_vs_{b}_64": round(tok[a] / tok[b], 3)
              for a, b in (("skipped", "runs"), ("skipped", "off"), ("runs", "off"), ("all", "off"), ("all", "runs"))
              if a in tok and b in tok}
    return {
        "tok_s_64_median": {k: round(v, 1) for k, v in tok.items()},
        **ratios,
        "acceptance": {name: {"through_k0": pooled(name, "through_k0"), "fresh": pooled(name, "fresh")}
                       for name in drafting},
        "greedy_text_identical": all(r["same_text"] for name in drafting for r in runs[name]),
    }


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        Path(sys.argv[3]).write_text(json.dumps(worker(json.loads(sys.argv[2]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", type=Path, default=REPO / GPU_LIKE_MODELS_DIR)
    parser.add_argument("--visits", type=int, default=2, help="times every engine is started, in rotation")
    parser.add_argument("--reps", type=int, default=3, help="64-stream runs per visit")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per request at 64 streams")
    parser.add_argument("--long-tokens", type=int, default=160)
    parser.add_argument("--short-tokens", type=int, default=40)
    parser.add_argument("--engines", type=lambda s: [e for e in s.split(",") if e], default=["off", "runs", "skipped"],
                        help=f"which of {','.join(ENGINES)} to measure")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="every engine with vLLM's prefix caching (the default) or without (needed by 'all')")
    parser.add_argument("--out", type=Path, default=RESULTS / "k0_pass.json")
    args = parser.parse_args()
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown or not args.engines:
        parser.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    if "all" in args.engines and args.prefix_caching:
        parser.error("the engine 'all' skips prompt steps only without prefix caching: add --no-prefix-caching")
    work = args.models_dir.parent / "run" / "bench-k0-pass"
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    engines = tuple(args.engines)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
    for visit in range(args.visits):
        for name in engines if visit % 2 == 0 else tuple(reversed(engines)):
            runs[name].append(run_engine(name, args.models_dir, work, args, visit))
    summary = summarize(runs)
    doc = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "models_dir": str(args.models_dir),
           "table": TABLE, "engines": list(engines), "prefix_caching": args.prefix_caching,
           "visits": args.visits, "reps": args.reps, "tokens": args.tokens,
           "long_tokens": args.long_tokens, "short_tokens": args.short_tokens, "wall_s": round(time.time() - t0, 1),
           "runs": runs, "summary": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    acc = summary["acceptance"]
    md = [
        "# K = 0 without the draft's pass (bench/bench_k0_pass.py)", "",
        f"Run {doc['when']} on {args.models_dir}: table {TABLE}, {args.visits} visits × {args.reps} runs of 64 "
        f"streams × {args.tokens} tokens, prefix caching {'on' if args.prefix_caching else 'off'} in every engine; "
        f"{doc['wall_s']:.0f} s.", "",
        "| engine | tok/s at 64 streams (median) |", "|---|---|",
        *[f"| {name} | {summary['tok_s_64_median'][name]} |" for name in engines], "",
        ", ".join(f"{k.removesuffix('_64').replace('_vs_', ' ÷ ')} **{v}**" for k, v in summary.items()
                  if k.endswith("_64") and k != "tok_s_64_median") + ".", "",
        "| engine | acceptance after K = 0 steps | acceptance, fresh requests |", "|---|---|---|",
        *[f"| {name} | {acc[name]['through_k0']} | {acc[name]['fresh']} |" for name in acc], "",
        f"Greedy text of the requests that lived through K = 0 identical to fresh ones: "
        f"{summary['greedy_text_identical']}.",
    ]
    args.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
