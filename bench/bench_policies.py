"""Benchmark of the policies' statistics: interval coverage, estimator error, change detection, cost.

    .venv/bin/python bench/bench_policies.py [--quick]

Everything is simulated with fixed seeds, so the figures are reproducible. Side by side in one run:

- coverage of the nominal 95% interval for α: Jeffreys/Beta (default) vs profile likelihood vs Wald;
- estimator error after 5 000 drafts: α̂ (the MLE) vs vLLM's draft acceptance rate A/T taken as α;
- per-position model: coverage of the interval predicted for K' from data at K (interpolation and
  extrapolation) for several decay shapes;
- change detector (two-sided CUSUM): measured false alarms per day vs the configured rate, and the
  detection delay for drops and rises of α, against a fixed-window test tuned to the same rate;
- wall time of choose_k and of a 256-row K table.

Writes bench/results/policies.json.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.research.simulate import accepted_per_draft, counters_from_accepted, simulate_evidence  # noqa: E402
from policies.acceptance import AcceptanceEvidence, IntervalMethod, alpha_interval  # noqa: E402
from policies.acceptance_model import ConstantAlphaModel  # noqa: E402
from policies.change import ChangeDetectorConfig, ChangeDetectorState, update_change_detector  # noqa: E402
from policies.choose_k import KChoiceSnapshot, choose_k  # noqa: E402
from policies.k_table import KTableSnapshot, k_table  # noqa: E402
from policies.positional import PositionalModel, PositionData  # noqa: E402
from policies.step_cost import StepCostModel  # noqa: E402

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def coverage(runs: int) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(101)
    for alpha, k, drafts in [
        (0.3, 1, 5000),
        (0.6, 3, 5000),
        (0.85, 5, 5000),
        (0.7, 4, 300),
        (0.5, 2, 50),
        (0.95, 8, 200),
    ]:
        s, f = simulate_evidence(rng, alpha, k, drafts, runs)
        beta_lo = stats.beta.ppf(0.025, s + 0.5, f + 0.5)
        beta_hi = np.where(f == 0, 1.0, stats.beta.ppf(0.975, s + 0.5, f + 0.5))
        beta_lo = np.where(s == 0, 0.0, beta_lo)
        prof = [
            alpha_interval(AcceptanceEvidence(a, b), 0.95, IntervalMethod.PROFILE) for a, b in zip(s, f, strict=True)
        ]
        p_lo, p_hi = np.array([x[0] for x in prof]), np.array([x[1] for x in prof])
        n = s + f
        a_hat = s / n
        half = 1.959964 * np.sqrt(a_hat * (1 - a_hat) / n)
        rows.append({
            "alpha": alpha, "k": k, "drafts": drafts, "runs": runs,
            "coverage_beta": float(np.mean((beta_lo <= alpha) & (alpha <= beta_hi))),
            "coverage_profile": float(np.mean((p_lo <= alpha) & (alpha <= p_hi))),
            "coverage_wald": float(np.mean((a_hat - half <= alpha) & (alpha <= a_hat + half))),
            "mean_width_beta": float(np.mean(beta_hi - beta_lo)),
        })  # fmt: skip
    return rows


def estimator_error(runs: int) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(202)
    for alpha in (0.3, 0.5, 0.7, 0.9):
        for k in (1, 3, 5, 8):
            n = accepted_per_draft(rng, alpha, k, 5000, runs)
            s = n.sum(axis=1)
            f = (n < k).sum(axis=1)
            err = s / (s + f) - alpha
            naive = s / (k * 5000) - alpha  # vLLM's draft acceptance rate, wrongly read as α
            rows.append({
                "alpha": alpha, "k": k, "drafts": 5000, "runs": runs,
                "mle_bias": float(err.mean()), "mle_mean_abs_error": float(np.abs(err).mean()),
                "mle_p99_abs_error": float(np.quantile(np.abs(err), 0.99)),
                "rate_as_alpha_mean_abs_error": float(np.abs(naive).mean()),
            })  # fmt: skip
    return rows


def positional(runs: int) -> list[dict[str, Any]]:
    shapes = {
        "constant_0.7": [0.7] * 8,
        "linear_decay": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2],
        "rising": [0.5, 0.6, 0.7, 0.75, 0.8, 0.8, 0.8, 0.8],
        "steep_then_flat": [0.95, 0.6, 0.55, 0.55, 0.55, 0.55, 0.55, 0.55],
    }
    rows = []
    rng = np.random.default_rng(303)
    for name, c in shapes.items():
        for k_src, k_dst in [(4, 2), (2, 4), (3, 6), (4, 8)]:
            hits = 0
            widths = []
            for _ in range(runs):
                src = PositionData.from_counters(
                    counters_from_accepted(accepted_per_draft(rng, c, k_src, 2000)[0], k_src)
                )
                model = PositionalModel.fit(src, max_k=8)
                pred = model.predict(k_dst, drafts=2000)
                measured = accepted_per_draft(rng, c, k_dst, 2000)[0].mean() / k_dst
                lo, hi = pred.draft_acceptance_rate_ci
                hits += lo <= measured <= hi
                widths.append(hi - lo)
            rows.append({
                "shape": name, "k_observed": k_src, "k_predicted": k_dst, "runs": runs,
                "prediction_interval_coverage": hits / runs, "mean_width": float(np.mean(widths)),
                "extrapolated": k_dst > k_src,
            })  # fmt: skip
    return rows


def _cusum_run(config: ChangeDetectorConfig, s: np.ndarray, f: np.ndarray) -> list[int]:
    state = ChangeDetectorState()
    alarms = []
    for i in range(s.size):
        decision, state = update_change_detector(
            state,
            AcceptanceEvidence(float(s[i]), float(f[i])),
            T0 + timedelta(seconds=config.window_s * i),
            config,
        )
        if decision.changed:
            alarms.append(i)
    return alarms


def _window_test_run(s: np.ndarray, f: np.ndarray, window: int, p_per_check: float, warmup: int) -> list[int]:
    """Baseline: every window, a two-sample z-test of the last ``window`` windows against all windows
    before them since the last alarm, at a per-check false-alarm probability ``p_per_check``."""
    z_crit = stats.norm.isf(p_per_check / 2)
    cs, cf = np.concatenate([[0.0], np.cumsum(s)]), np.concatenate([[0.0], np.cumsum(f)])
    alarms = []
    start = 0
    for i in range(s.size):
        if i + 1 - start < warmup + window:
            continue
        split = i + 1 - window
        ref_s, ref_f = cs[split] - cs[start], cf[split] - cf[start]
        new_s, new_f = cs[i + 1] - cs[split], cf[i + 1] - cf[split]
        a0, a1 = ref_s / (ref_s + ref_f), new_s / (new_s + new_f)
        pooled = (ref_s + new_s) / (ref_s + ref_f + new_s + new_f)
        se = math.sqrt(pooled * (1 - pooled) * (1 / (ref_s + ref_f) + 1 / (new_s + new_f)))
        if se > 0 and abs(a1 - a0) / se > z_crit:
            alarms.append(i)
            start = i + 1
    return alarms


def change_detection(quick: bool) -> dict[str, Any]:
    window_s = 10.0
    per_day = 24.0
    config = ChangeDetectorConfig(window_s=window_s, false_alarms_per_day=per_day, shift=0.1, min_reference_trials=2000)
    drafts_per_window = 100
    rng = np.random.default_rng(404)
    # false alarms: a long stationary stream
    n_windows = 20_000 if quick else 100_000
    s, f = simulate_evidence(rng, 0.6, 3, drafts_per_window, n_windows)
    t = time.perf_counter()
    alarms = _cusum_run(config, s, f)
    per_update_us = (time.perf_counter() - t) / n_windows * 1e6
    days = n_windows * window_s / 86400
    p_check = 1.0 / config.in_control_run_length_windows
    base_alarms = _window_test_run(s, f, window=6, p_per_check=p_check, warmup=20)
    out: dict[str, Any] = {
        "window_s": window_s, "drafts_per_window": drafts_per_window, "k": 3, "shift": config.shift,
        "configured_false_alarms_per_day": per_day, "stationary_days": days,
        "cusum_false_alarms_per_day": len(alarms) / days,
        "window_test_false_alarms_per_day": len(base_alarms) / days,
        "cusum_update_us": per_update_us, "delays": [],
    }  # fmt: skip
    trials = 100 if quick else 300
    for before, after in [(0.6, 0.5), (0.6, 0.4), (0.6, 0.7), (0.4, 0.3)]:
        cusum_delay, base_delay = [], []
        early = 0
        for _ in range(trials):
            s1, f1 = simulate_evidence(rng, before, 3, drafts_per_window, 60)
            s2, f2 = simulate_evidence(rng, after, 3, drafts_per_window, 200)
            ss, ff = np.concatenate([s1, s2]), np.concatenate([f1, f2])
            a = _cusum_run(config, ss, ff)
            b = _window_test_run(ss, ff, window=6, p_per_check=p_check, warmup=20)
            early += any(i < 60 for i in a)
            post = [i - 60 + 1 for i in a if i >= 60]
            cusum_delay.append(post[0] if post else math.inf)
            post_b = [i - 60 + 1 for i in b if i >= 60]
            base_delay.append(post_b[0] if post_b else math.inf)
        cd, bd = np.array(cusum_delay), np.array(base_delay)
        out["delays"].append({
            "alpha_before": before, "alpha_after": after, "trials": trials,
            "cusum_median_delay_windows": float(np.median(cd)),
            "cusum_p90_delay_windows": float(np.quantile(cd, 0.9)),
            "cusum_detected_share": float(np.mean(np.isfinite(cd))),
            "cusum_alarm_before_change_share": early / trials,
            "window_test_median_delay_windows": float(np.median(bd)),
            "delay_ratio_window_test_over_cusum": float(np.median(bd) / np.median(cd)),
        })  # fmt: skip
    return out


def timing() -> dict[str, Any]:
    now = T0
    acceptance = ConstantAlphaModel(0.7, 0.65, 0.75)
    cost = StepCostModel.from_cost_ratio(0.1, per_token_s=0.01)
    reps = 200
    t = time.perf_counter()
    for _ in range(reps):
        choose_k(KChoiceSnapshot(now, acceptance, cost, 8, 16))
    choose_ms = (time.perf_counter() - t) / reps * 1e3
    t = time.perf_counter()
    table = k_table(KTableSnapshot(now, acceptance, cost, 256, 16))
    table_ms = (time.perf_counter() - t) * 1e3
    return {
        "choose_k_ms_k_max_16": choose_ms,
        "k_table_ms_256_batch_sizes_k_max_16": table_ms,
        "k_table_rows": table.as_vllm(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs (a smoke test, not the reported figures)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "policies.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "benchmark": "policies",
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "quick": args.quick,
    }
    results["coverage_95"] = coverage(300 if args.quick else 1000)
    results["estimator_error_5000_drafts"] = estimator_error(300 if args.quick else 1000)
    results["positional_prediction"] = positional(40 if args.quick else 200)
    results["change_detector"] = change_detection(args.quick)
    results["timing"] = timing()
    results["elapsed_s"] = time.perf_counter() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    report(results)
    print(f"\nwrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


def report(r: dict[str, Any]) -> None:
    print("95% interval coverage for α (nominal 0.95), Beta vs profile vs Wald")
    print(f"{'alpha':>6} {'K':>3} {'drafts':>7} {'beta':>7} {'profile':>8} {'wald':>7} {'width':>7}")
    for x in r["coverage_95"]:
        cov = f"{x['coverage_beta']:>7.3f} {x['coverage_profile']:>8.3f} {x['coverage_wald']:>7.3f}"
        print(f"{x['alpha']:>6} {x['k']:>3} {x['drafts']:>7} {cov} {x['mean_width_beta']:>7.4f}")
    print("\nerror after 5 000 drafts: α̂ (MLE) vs the draft acceptance rate read as α")
    print(f"{'alpha':>6} {'K':>3} {'bias':>9} {'mean|e|':>8} {'p99|e|':>7} {'A/T mean|e|':>12} {'ratio':>7}")
    for x in r["estimator_error_5000_drafts"]:
        ratio = x["rate_as_alpha_mean_abs_error"] / x["mle_mean_abs_error"]
        mle = f"{x['mle_bias']:>9.5f} {x['mle_mean_abs_error']:>8.4f} {x['mle_p99_abs_error']:>7.4f}"
        print(f"{x['alpha']:>6} {x['k']:>3} {mle} {x['rate_as_alpha_mean_abs_error']:>12.4f} {ratio:>7.1f}×")
    print("\nper-position model: 95% prediction interval for the rate measured at K' (2 000 drafts each run)")
    for x in r["positional_prediction"]:
        kind = "extrapolate" if x["extrapolated"] else "interpolate"
        cov = f"coverage {x['prediction_interval_coverage']:.3f}, width {x['mean_width']:.3f}"
        print(f"{x['shape']:>16} K={x['k_observed']}→{x['k_predicted']} ({kind}): {cov}")
    c = r["change_detector"]
    setup = f"{c['window_s']:.0f} s windows of {c['drafts_per_window']} drafts at K=3"
    print(f"\nchange detector: {setup}, configured {c['configured_false_alarms_per_day']:.0f} false alarms/day")
    ratio = c["cusum_false_alarms_per_day"] / c["configured_false_alarms_per_day"]
    print(
        f"  measured false alarms/day over {c['stationary_days']:.1f} simulated days: CUSUM "
        f"{c['cusum_false_alarms_per_day']:.2f} ({ratio:.2f}× configured), window test "
        f"{c['window_test_false_alarms_per_day']:.2f}"
    )
    for d in c["delays"]:
        cusum = (
            f"CUSUM median delay {d['cusum_median_delay_windows']:.0f} windows "
            f"(p90 {d['cusum_p90_delay_windows']:.0f}, detected {d['cusum_detected_share']:.0%})"
        )
        ratio_d = d["delay_ratio_window_test_over_cusum"]
        base = f"window test {d['window_test_median_delay_windows']:.0f} ({ratio_d:.2f}×)"
        print(f"  α {d['alpha_before']}→{d['alpha_after']}: {cusum}; {base}")
    print(f"  CUSUM update: {c['cusum_update_us']:.1f} µs")
    t = r["timing"]
    print(
        f"\nchoose_k (K_max 16): {t['choose_k_ms_k_max_16']:.2f} ms; K table for 256 batch sizes: "
        f"{t['k_table_ms_256_batch_sizes_k_max_16']:.0f} ms → {t['k_table_rows']}"
    )
    print(f"total {r['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
