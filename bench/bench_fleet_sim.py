"""Canary verification against before/after verification on a simulated fleet (issue #23).

``tuner.sim.fleet.run_fleet`` runs N replicas of a scenario's engine behind one router, the fleet's load
and prompt mix drifting, and a trial of changes with known true effects (a third better, a third worse,
a third neutral). Every change is judged three ways on the same simulated minutes: the canary
(``policies.canary.judge_canary`` against the untouched replicas, stopping when decided), the plain
before/after judgement (``tuner.controller.verify.judge``) and the controller's full before/after pipeline
(matched load + prompt-shift correction). Reported per drift level, pooled over the seeds: wrong verdicts
per 100 changes (wrong promotions of worse changes, wrong rollbacks of better or neutral ones) and time
to verdict.

    .venv/bin/python bench/bench_fleet_sim.py [--scenario bench/scenarios/gpu_diurnal.toml] [--seeds 8]
        [--changes 60] [--replica-noise-sd 0.03]

Writes ``bench/results/fleet_sim.json`` and ``fleet_sim.md`` (``--out`` changes the stem).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.sim.fleet import DRIFTS, JUDGES, FleetSettings, run_fleet, summarize  # noqa: E402
from tuner.sim.scenario import load_scenario  # noqa: E402

RESULTS = REPO / "bench" / "results"
LABELS = {"canary": "canary", "before_after": "before/after (judge)", "controller": "before/after (controller)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", type=Path, default=REPO / "bench" / "scenarios" / "gpu_diurnal.toml")
    ap.add_argument("--seeds", type=int, default=8, help="seeds 1..N per drift level")
    ap.add_argument("--changes", type=int, default=60, help="changes per seed")
    ap.add_argument("--replicas", type=int, default=FleetSettings.replicas)
    ap.add_argument("--replica-noise-sd", type=float, default=FleetSettings.replica_noise_sd)
    ap.add_argument("--out", default="fleet_sim")
    args = ap.parse_args()
    scenario = load_scenario(args.scenario)
    settings = replace(
        FleetSettings(), changes=args.changes, replicas=args.replicas, replica_noise_sd=args.replica_noise_sd
    )
    t0, cpu0 = time.perf_counter(), time.process_time()
    levels: dict[str, Any] = {}
    for name, drift in DRIFTS.items():
        outcomes, per_seed = [], {}
        for seed in range(1, args.seeds + 1):
            run = run_fleet(scenario, drift, seed, settings)
            per_seed[seed] = summarize(run, scenario.controller.verify_window_s)
            outcomes += run
        pooled = summarize(outcomes, scenario.controller.verify_window_s)
        for judge in JUDGES:
            rates = [s[judge]["wrong_per_100"] for s in per_seed.values()]
            pooled[judge]["wrong_per_100_seed_range"] = [min(rates), max(rates)]
        levels[name] = {"drift": asdict(drift), "pooled": pooled, "per_seed": per_seed}
        print(_row(name, pooled), flush=True)
    doc = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "command": " ".join(["bench/bench_fleet_sim.py", *sys.argv[1:]]),
        "scenario": str(args.scenario.resolve().relative_to(REPO)) if args.scenario.resolve().is_relative_to(REPO)
        else str(args.scenario),
        "seeds": list(range(1, args.seeds + 1)),
        "settings": {k: v for k, v in asdict(settings).items() if k != "canary"} | {"canary": asdict(settings.canary)},
        "controller": {
            "evidence_window_s": scenario.controller.evidence_window_s,
            "verify_window_s": scenario.controller.verify_window_s,
            "regression_tolerance": scenario.controller.regression_tolerance,
            "collect_interval_s": scenario.controller.collect_interval_s,
        },
        "levels": levels,
        "wall_s": round(time.perf_counter() - t0, 2),
        "cpu_s": round(time.process_time() - cpu0, 2),
    }  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(_markdown(doc))
    print(f"wrote bench/results/{args.out}.json and .md ({doc['wall_s']} s wall, {doc['cpu_s']} s CPU)")
    return 0


def _row(level: str, pooled: dict[str, Any]) -> str:
    parts = [f"{level:9s}"]
    for judge in JUDGES:
        p = pooled[judge]
        parts.append(f"{LABELS[judge]} {p['wrong_per_100']:5.1f}/100 ({p['wrong_promotions']}+{p['wrong_rollbacks']})")
    c = pooled["canary"]
    parts.append(f"canary verdict median {c['verdict_s_median']:.0f} s, p90 {c['verdict_s_p90']:.0f} s")
    return " | ".join(parts)


def _markdown(doc: dict[str, Any]) -> str:
    s = doc["settings"]
    c = doc["controller"]
    n = next(iter(doc["levels"].values()))["pooled"]["changes"]
    lines = [
        "# Canary against before/after verification on a simulated fleet (bench/bench_fleet_sim.py)",
        "",
        f"`{doc['command']}` — {doc['when']}, {doc['wall_s']} s wall, {doc['cpu_s']} s CPU. Engine physics: "
        f"`{doc['scenario']}`; {s['replicas']} replicas at {s['concurrency_per_replica']:g} requests each; "
        f"{n} changes per drift level ({s['changes']} per seed × seeds {doc['seeds'][0]}–{doc['seeds'][-1]}): "
        f"a third better ({', '.join(f'{e:+.0%}' for e in s['better_effects'])}), a third worse "
        f"({', '.join(f'{e:+.0%}' for e in s['worse_effects'])}), a third neutral. Per-replica noise: "
        f"{s['replica_noise_sd']:.0%} step time and {s['replica_alpha_sd']:.2f} α per {c['collect_interval_s']:g} s "
        f"window, {s['router_imbalance_sd']:.0%} router imbalance, {s['replica_bias_sd']:.1%} persistent speed offset.",
        "",
        "Wrong verdicts per 100 changes, pooled over the seeds (wrong promotions of worse changes + wrong "
        "rollbacks of better or neutral ones; the range over seeds in brackets):",
        "",
        "| drift (load ±, α ±, step time ±) | canary | before/after (`verify.judge`) | before/after (controller: "
        "matched load + prompt shift) | ÷ canary (judge, controller) |",
        "|---|---|---|---|---|",
    ]
    for level, data in doc["levels"].items():
        d, p = data["drift"], data["pooled"]
        cells = []
        for judge in JUDGES:
            j = p[judge]
            lo, hi = j["wrong_per_100_seed_range"]
            cells.append(
                f"{j['wrong_per_100']:.1f} ({j['wrong_promotions']}+{j['wrong_rollbacks']}) [{lo:.1f}–{hi:.1f}]"
            )
        wrong_canary = p["canary"]["wrong_per_100"]
        ratios = [
            p[j]["wrong_per_100"] / wrong_canary if wrong_canary else None for j in ("before_after", "controller")
        ]
        cells.append(", ".join("—" if r is None else f"{r:.1f}×" for r in ratios))
        lines.append(
            f"| {level} ({d['load_rel']:.0%}, {d['alpha_abs']:.2f}, {d['step_rel']:.0%}) | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        f"Time to verdict, from the change taking effect: before/after always {c['verify_window_s']:g} s (the "
        f"controller's verify window, against {c['evidence_window_s']:g} s of evidence before the change). The "
        f"canary checks every {s['sample_s']:g} s from {s['canary']['min_samples']} samples on and stops when "
        f"decided; undecided at {s['canary_max_s']:g} s it rolls back:",
        "",
        "| drift | canary median | p90 | mean | median: better / worse / neutral | timed out |",
        "|---|---|---|---|---|---|",
    ]
    for level, data in doc["levels"].items():
        k = data["pooled"]["canary"]
        by = k["verdict_s_median_by_truth"]
        lines.append(
            f"| {level} | {k['verdict_s_median']:.0f} s | {k['verdict_s_p90']:.0f} s | {k['verdict_s_mean']:.0f} s | "
            f"{by.get('better', 0):.0f} / {by.get('worse', 0):.0f} / {by.get('neutral', 0):.0f} s | {k['timed_out']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
