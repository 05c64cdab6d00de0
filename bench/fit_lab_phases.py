"""Fit a phase scenario's engine cost to a live benchmark's fixed cells (the sim-to-live calibration).

The simulator's step cost is ``T(B, K) = target_step_s + per_token_s·max(B·(K+1) − free_tokens, 0) +
passes·(draft_fixed_s + draft_per_seq_s·B)`` (``tuner/sim/engine.py``). This fits those numbers — the
target's three, and the two of each draft method (the lab's model drafts share one shape, so one pair for
them, one for ngram) — by least squares on the log of every fixed cell's measured rate (``bench/results/live.json``:
``summary.fixed_mean_rate``, each phase at its concurrency), with the scenario's α, position decay and
phase scales held as they are (those come from the cells' accepted tokens per draft step). It prints
the fitted values, each cell's residual, and the TOML lines to paste; it changes no file.

    .venv/bin/python bench/fit_lab_phases.py [--live bench/results/live.json] [--scenario lab_phases]

Why a fit and not the lab recipe's own T(B, K): on the CPU engine the measured cells are not linear in
the scored tokens (plain decoding runs 40 ms a step at 1 and at 4 streams, 70 ms at 16, ~240 ms at 64),
and the simulator should reproduce what the live engine did, while the controller keeps the cost
model it is given (``[controller.daemon] policy.step_cost``), as it does live.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import least_squares

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.sim.engine import SimConfig, SimEngine  # noqa: E402
from tuner.sim.scenario import Scenario, load_scenario  # noqa: E402

PARAMS = (
    "target_step_s",
    "per_token_s",
    "free_tokens",
    "model_draft_fixed_s",
    "model_draft_per_seq_s",
    "ngram_draft_fixed_s",
    "ngram_draft_per_seq_s",
)


def _config(label: str) -> SimConfig:
    if label == "off":
        return SimConfig(None, 0)
    draft, _, k = label.partition("/K=")
    return SimConfig(draft, int(k))


def _with(scenario: Scenario, theta: np.ndarray) -> Scenario:
    v = dict(zip(PARAMS, (float(x) for x in theta), strict=True))
    engine = scenario.engine.model_copy(update={k: v[k] for k in ("target_step_s", "per_token_s", "free_tokens")})
    drafts = []
    for d in scenario.drafts:
        kind = "ngram" if d.method in ("ngram", "ngram_gpu") else "model"
        drafts.append(
            d.model_copy(
                update={"draft_fixed_s": v[f"{kind}_draft_fixed_s"], "draft_per_seq_s": v[f"{kind}_draft_per_seq_s"]}
            )
        )
    return scenario.model_copy(update={"engine": engine, "drafts": drafts})


def _cells(live: dict[str, Any], scenario: Scenario) -> list[tuple[str, str, float, float]]:
    """(phase, config, phase midpoint s, live rate) for every fixed single-K cell the scenario can run."""
    names = {d.name for d in scenario.drafts}
    mid, t = {}, 0.0
    for i, p in enumerate(scenario.load.phases):
        mid.setdefault(p.name or f"phase {i + 1}", t + p.duration_s / 2)
        t += p.duration_s
    out = []
    for phase, rates in live["summary"]["fixed_mean_rate"].items():
        if phase not in mid:
            raise SystemExit(f"the live phase {phase!r} is not in the scenario: give it the live phase plan")
        for label, rate in rates.items():
            if (label == "off" or ("/K=" in label and label.split("/")[0] in names)) and rate > 0:
                out.append((phase, label, mid[phase], float(rate)))
    return out


def _predict(scenario: Scenario, cells: list[tuple[str, str, float, float]], theta: np.ndarray) -> np.ndarray:
    engine = SimEngine(_with(scenario, theta))
    return np.array([float(engine.expected_goodput(_config(c), np.array([t]))[0]) for _, c, t, _ in cells])


def fit(live: dict[str, Any], scenario: Scenario) -> dict[str, Any]:
    cells = _cells(live, scenario)
    measured = np.log([r for *_, r in cells])
    model_draft = next(d for d in scenario.drafts if d.method not in ("ngram", "ngram_gpu"))
    ngram = next((d for d in scenario.drafts if d.method in ("ngram", "ngram_gpu")), model_draft)
    start = np.array(
        [
            scenario.engine.target_step_s,
            scenario.engine.per_token_s,
            scenario.engine.free_tokens,
            model_draft.draft_fixed_s or 0.0,
            model_draft.draft_per_seq_s or 0.0,
            ngram.draft_fixed_s or 0.0,
            ngram.draft_per_seq_s or 0.0,
        ]
    )

    def residual(theta: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(_predict(scenario, cells, theta), 1e-9)) - measured

    # Plain decoding is a few cells against dozens of draft cells that share the target's numbers, and it
    # is the oracle wherever speculation loses: weigh its cells so that they count as much as all the others.
    off = np.array([c == "off" for _, c, _, _ in cells])
    weight = np.where(off, math.sqrt(max((~off).sum(), 1) / max(off.sum(), 1)), 1.0)
    before = residual(start)
    lower = np.full(len(PARAMS), 1e-6)
    fits = []
    # max(·, 0) leaves no gradient on free_tokens where no cell is past it: start it at several heights
    for free in sorted({float(start[2]), 0.0, 4.0, 8.0, 16.0}):
        x0 = np.maximum(start, 1e-5)
        x0[2] = max(free, 1e-5)
        fits.append(least_squares(lambda x: weight * residual(x), x0, bounds=(lower, np.inf), x_scale="jac"))
    res_x = min(fits, key=lambda r: float(r.cost)).x
    after = residual(res_x)
    rms = lambda r: math.sqrt(float(np.mean(r**2)))  # noqa: E731
    return {
        "cells": len(cells),
        "fitted": {p: round(float(x), 6) for p, x in zip(PARAMS, res_x, strict=True)},
        "rms_log_error": {
            "before": round(rms(before), 4),
            "after": round(rms(after), 4),
            "off_after": round(rms(after[off]), 4),
            "drafts_after": round(rms(after[~off]), 4),
        },
        "residuals": [
            {"phase": p, "config": c, "live": round(r, 1), "fitted": round(r * math.exp(e), 1)}
            for (p, c, _, r), e in zip(cells, after, strict=True)
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=Path, default=REPO / "bench" / "results" / "live.json")
    parser.add_argument("--scenario", default="lab_phases")
    parser.add_argument("--json", action="store_true", help="the whole fit as JSON")
    args = parser.parse_args()
    live = json.loads(args.live.read_text())
    if not live.get("summary", {}).get("fixed_mean_rate"):
        parser.error(f"{args.live} has no fixed cells: run bench/bench_live.py in full")
    doc = fit(live, load_scenario(REPO / "bench" / "scenarios" / f"{args.scenario}.toml"))
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    for r in doc["residuals"]:
        print(f"{r['phase']:<18} {r['config']:<11} live {r['live']:7.1f}  fitted {r['fitted']:7.1f}")
    e = doc["rms_log_error"]
    print(
        f"{doc['cells']} cells; rms log error {e['before']} → {e['after']} (plain decoding {e['off_after']}, "
        f"drafts {e['drafts_after']})"
    )
    f = doc["fitted"]
    print(
        f"\n[engine]\ntarget_step_s = {f['target_step_s']}\nper_token_s = {f['per_token_s']}\n"
        f"free_tokens = {f['free_tokens']}\n"
        f"# model drafts: draft_fixed_s = {f['model_draft_fixed_s']}, draft_per_seq_s = {f['model_draft_per_seq_s']}\n"
        f"# ngram:        draft_fixed_s = {f['ngram_draft_fixed_s']}, draft_per_seq_s = {f['ngram_draft_per_seq_s']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
