"""One calibration engine: start vLLM offline on one config, time greedy generation at each stream count.

Run as ``python -m tuner.lab.calibrate_worker ARGS_JSON OUT_JSON`` by ``tuner.lab.calibrate``: vLLM's
engine core is a spawned process, so the offline ``LLM`` must live in a ``__main__`` of its own, and a
process per config means nothing of one engine (threads, caches, memory) skews the next.

Every stream count generates exactly ``max_tokens`` tokens per request (``ignore_eos``), all requests
submitted at once, so the engine runs at that concurrency for the whole measurement.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def run(args: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    from tuner.lab.corpus import hard_prompts, predictable_prompts

    streams = [int(n) for n in args["streams"]]
    kw: dict[str, Any] = {
        "model": args["model"],
        "tokenizer": args["tokenizer"],
        "dtype": "float32",
        "max_model_len": int(args["max_model_len"]),
        "max_num_seqs": max(streams),
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
    }
    if args.get("speculative_config"):
        kw["speculative_config"] = args["speculative_config"]
    t0 = time.monotonic()
    llm = LLM(**kw)
    startup_s = time.monotonic() - t0
    n_max = max(streams)
    # half predictable, half hard text, interleaved: every stream count sees the same mix
    mix = [p for pair in zip(predictable_prompts(n=n_max), hard_prompts(n=n_max), strict=True) for p in pair]
    sampling = SamplingParams(temperature=0.0, max_tokens=int(args["max_tokens"]), ignore_eos=True)
    llm.generate(mix[:2], sampling, use_tqdm=False)  # first-call allocations are not a step cost
    tok_s: dict[str, float] = {}
    # per stream count: wall seconds, tokens made and the engine's speculation counters over that run,
    # from which a lookup's own pass is fitted (``tuner.lab.calibrate.fitted_lookup_pass``)
    rows: dict[str, dict[str, float]] = {}
    for n in streams:
        at_start = _spec_counters(llm)
        t = time.perf_counter()
        outs = llm.generate(mix[:n], sampling, use_tqdm=False)
        took = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        tok_s[str(n)] = round(tokens / took, 2)
        at_end = _spec_counters(llm)
        rows[str(n)] = {
            "seconds": round(took, 4),
            "tokens": float(tokens),
            **{k: at_end.get(k, 0.0) - at_start.get(k, 0.0)
               for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
        }
        print(f"{args['label']}: {n} streams {tok_s[str(n)]} tok/s", file=sys.stderr, flush=True)
    drafts = sum(r["num_drafts"] for r in rows.values())
    draft_tokens = sum(r["num_draft_tokens"] for r in rows.values())
    accepted = sum(r["num_accepted_tokens"] for r in rows.values())
    return {
        "label": args["label"],
        "startup_s": round(startup_s, 1),
        "tok_s": tok_s,
        "rows": rows,
        "acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else None,
        "mean_acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
    }


def _spec_counters(llm: Any) -> dict[str, float]:
    prefix = "vllm:spec_decode_"
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if m.name.startswith(prefix) and isinstance(value, int | float):
            out[m.name[len(prefix):]] = float(value)
    return out


def main() -> None:
    args = json.loads(sys.argv[1])
    result = run(args)
    Path(sys.argv[2]).write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
