"""The simulator against the live benchmark: the same phase plan, per phase and per policy.

Reads a live result (``bench/results/live.json``, ``bench/bench_live.py``) and runs the scenario
calibrated from it (``bench/scenarios/lab_phases.toml``: the gpu-like lab, the live benchmark's six
phases) in the simulator. For every phase it prints the rate of no speculation, fixed configs, the
per-phase oracle (the best fixed config of the phase, switching for free) and spectuner, live and
simulated, and spectuner's ratio to the oracle in both; the gap in that ratio is what the issue
bounds (≤ 0.05 over the run).

    .venv/bin/python bench/bench_sim_live.py [--live bench/results/live.json] [--scenario lab_phases]

Writes ``bench/results/sim_live.json`` and ``sim_live.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.sim.engine import SimConfig, SimEngine  # noqa: E402
from tuner.sim.run import _phase_goodput, run_scenario, simulate  # noqa: E402
from tuner.sim.scenario import Scenario, ShadowSection, load_scenario  # noqa: E402

RESULTS = REPO / "bench" / "results"
SHOWN = ("off", "good/K=1", "good/K=3", "good/K=5", "medium/K=3", "weak/K=3", "ngram/K=3")


def _sim_config(label: str) -> SimConfig:
    if label == "off":
        return SimConfig(None, 0)
    draft, _, k = label.partition("/K=")
    return SimConfig(draft, int(k))


def shadow_as_run(scenario: Scenario, live: dict[str, Any]) -> Scenario:
    """The scenario with the ``[shadow]`` schedule the live run's sidecar had (``shadow_settings``): a run made
    before a setting existed ran without it — no ``interval_max_s``: a replay every ``interval_s``; no
    ``max_machine_share``: no CPU budget — and a setting left unset ran the daemon's default."""
    settings = live.get("spectuner", {}).get("shadow_settings")
    if scenario.shadow is None or settings is None:
        return scenario if settings is not None else scenario.model_copy(update={"shadow": None})
    interval_s = float(settings["interval_s"])
    update: dict[str, Any] = {
        "interval_s": interval_s,
        "interval_max_s": settings.get("interval_max_s", interval_s),  # absent: before the backoff
        "max_machine_share": (
            0.0 if "max_machine_share" not in settings
            else ShadowSection.model_fields["max_machine_share"].default if settings["max_machine_share"] is None
            else float(settings["max_machine_share"])
        ),
    }
    return scenario.model_copy(update={"shadow": scenario.shadow.model_copy(update=update)})


def compare(live: dict[str, Any], scenario_path: Path, seed: int | None = None) -> dict[str, Any]:
    scenario = shadow_as_run(load_scenario(scenario_path), live)
    phases = live["phases"]
    sim_phases = [p.name for p in scenario.load.phases]
    if sim_phases != phases:
        raise SystemExit(f"{scenario_path.name} runs phases {sim_phases}, the live result {phases}: "
                         "give the scenario the live benchmark's phase plan")
    live_fixed: dict[str, dict[str, float]] = live["summary"]["fixed_mean_rate"]
    engine = SimEngine(scenario)
    labels = sorted({c for p in live_fixed.values() for c in p if "/K=" in c or c == "off"})
    sim_fixed: dict[str, dict[str, float]] = {p: {} for p in phases}
    for label in labels:
        cfg = _sim_config(label)
        if engine.start_problem(cfg) is not None:
            continue
        run = simulate(scenario, engine, f"fixed:{label}", cfg, seed=seed)
        for p, rate in _phase_goodput(run, scenario).items():
            sim_fixed[p][label] = rate
    sim = run_scenario(scenario, ["spectuner"], seed=seed)
    sim_sp = sim["policies"]["spectuner"]["phases"]
    live_sp = {p: v["rate"] for p, v in live["spectuner"]["phases"].items()}
    rows = []
    for p in phases:
        common = [c for c in labels if c in live_fixed[p] and c in sim_fixed[p]]
        live_oracle = max(live_fixed[p][c] for c in common)
        sim_oracle = max(sim_fixed[p][c] for c in common)
        rows.append({
            "phase": p,
            "live": {**{c: live_fixed[p][c] for c in common}, "oracle": live_oracle, "spectuner": live_sp[p],
                     "oracle_config": max(common, key=lambda c: live_fixed[p][c])},
            "sim": {**{c: sim_fixed[p][c] for c in common}, "oracle": sim_oracle, "spectuner": sim_sp[p],
                    "oracle_config": max(common, key=lambda c: sim_fixed[p][c])},
            "spectuner_vs_oracle": {"live": round(live_sp[p] / live_oracle, 3),
                                    "sim": round(sim_sp[p] / sim_oracle, 3)},
        })
    live_total = sum(r["live"]["spectuner"] for r in rows) / sum(r["live"]["oracle"] for r in rows)
    sim_total = sum(r["sim"]["spectuner"] for r in rows) / sum(r["sim"]["oracle"] for r in rows)
    return {
        "live_result": live.get("when"), "scenario": scenario_path.name, "rows": rows,
        "spectuner_vs_oracle": {"live": round(live_total, 3), "sim": round(sim_total, 3),
                                "gap": round(sim_total - live_total, 3), "target_gap": 0.05},
        "sim_spectuner": {k: sim["policies"]["spectuner"][k] for k in ("changes", "restarts", "final_config")},
        # the replay schedule simulated: the live run's (shadow_as_run)
        "sim_shadow": None if scenario.shadow is None else scenario.shadow.model_dump(
            include={"interval_s", "interval_max_s", "max_machine_share", "run_s", "cpu_share"}),
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = ["# Simulator against the live benchmark (same phase plan)", "",
             f"Live result {doc['live_result']}; scenario `{doc['scenario']}`. Rates in tokens/s, live / simulated.",
             "",
             "| phase | " + " | ".join(SHOWN) + " | oracle (live / sim) | spectuner | spectuner ÷ oracle |",
             "|---|" + "---|" * (len(SHOWN) + 3)]
    for r in doc["rows"]:
        cells = [f"{r['live'][c]:.0f} / {r['sim'][c]:.0f}" if c in r["live"] else "—" for c in SHOWN]
        lines.append(f"| {r['phase']} | " + " | ".join(cells)
                     + f" | {r['live']['oracle']:.0f} ({r['live']['oracle_config']}) / {r['sim']['oracle']:.0f} "
                     f"({r['sim']['oracle_config']}) | {r['live']['spectuner']:.0f} / {r['sim']['spectuner']:.0f} | "
                     f"{r['spectuner_vs_oracle']['live']:.3f} / {r['spectuner_vs_oracle']['sim']:.3f} |")
    t = doc["spectuner_vs_oracle"]
    lines += ["", f"Over the run: spectuner ÷ oracle live **{t['live']:.3f}**, simulated **{t['sim']:.3f}**, gap "
              f"{t['gap']:+.3f} (target |gap| ≤ {t['target_gap']}). Simulated spectuner: {doc['sim_spectuner']}; "
              f"its shadow replays as the live run's: {doc.get('sim_shadow')}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live", type=Path, default=RESULTS / "live.json")
    parser.add_argument("--scenario", default="lab_phases")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default="sim_live")
    args = parser.parse_args()
    live = json.loads(args.live.read_text())
    if not live.get("spectuner") or not live.get("cells"):
        parser.error(f"{args.live} has no spectuner run or no fixed cells: run bench/bench_live.py in full")
    doc = compare(live, REPO / "bench" / "scenarios" / f"{args.scenario}.toml", args.seed)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
