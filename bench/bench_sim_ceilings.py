"""How much of the dynamic oracle a restart-based policy can reach at all, per simulator scenario.

The dynamic oracle (``tuner.sim.run.dynamic_oracle_tokens``) runs the best config in every 10 s window
and switches for free, knowing the future. A real controller restarts (``restart_downtime_s`` of
nothing served) and must see a change before it follows it. This bench prints, from the scenario's
expected goodput (no sampling noise), three figures against the dynamic oracle:

- the best fixed config (the oracle of ``ratio_to_oracle``);
- the best schedule of restarts in hindsight: a dynamic programme over the windows in which a switch
  costs the new config's goodput for the downtime — perfect foresight, but paying for every restart (a K
  change the engine takes live, ``[engine] live_k_max``, is free, as the simulator's actuator takes it;
  on such an engine each draft at K = 0 is a config too, as a K table's K = 0 row reaches it);
- the same schedule with every switch made ``delay`` seconds late: what a policy that follows each
  change ``delay`` s after it happened (detection, confirmation, hysteresis) could reach with perfect
  config choices. With ``--delay`` repeated, one figure per delay.

    .venv/bin/python bench/bench_sim_ceilings.py [--scenario gpu_code_rag ...] [--delay 0 --delay 660]

Writes ``bench/results/sim_ceilings.json`` (and prints a table).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.sim.actuator import live_change  # noqa: E402
from tuner.sim.engine import SimConfig, SimEngine  # noqa: E402
from tuner.sim.run import _grid, dynamic_oracle_tokens, start_config  # noqa: E402
from tuner.sim.scenario import load_scenario  # noqa: E402

SCENARIOS = REPO / "bench" / "scenarios"
RESULTS = REPO / "bench" / "results"
# one 5-minute confirmation + a hysteresis tick; the swap trigger's 600 s + a hysteresis tick
DEFAULT_DELAYS_S = (360.0, 660.0)


def restart_schedule(
    goodput: NDArray[np.float64],
    length: NDArray[np.float64],
    start: int,
    down_windows: int,
    live: NDArray[np.bool_] | None = None,
) -> list[int]:
    """The config index per window of the hindsight-best restart schedule (switching at window i loses what
    the new config would serve in windows i .. i + ``down_windows`` − 1, unless ``live[old, new]``: the
    engine takes that change between steps, for free): Viterbi over configs × windows."""
    m, n = goodput.shape
    live = np.zeros((m, m), dtype=bool) if live is None else live
    tokens = goodput * length
    ahead = np.concatenate([np.zeros((m, 1)), np.cumsum(tokens, axis=1)], axis=1)
    value = np.full(m, -np.inf)
    value[start] = 0.0
    came_from = np.zeros((n, m), dtype=np.int64)
    for i in range(n):
        best_prev = int(np.argmax(value))
        stay = value + tokens[:, i]
        lost = ahead[:, min(i + down_windows, n)] - ahead[:, i]
        switch = value[best_prev] - lost + tokens[:, i]
        free_from = np.where(live, value[:, None], -np.inf)  # [old, new]
        free_prev = np.argmax(free_from, axis=0)
        free = free_from[free_prev, np.arange(m)] + tokens[:, i]
        options = np.stack([stay, switch, free])
        pick = np.argmax(options, axis=0)
        came_from[i] = np.choose(pick, [np.arange(m), np.full(m, best_prev), free_prev])
        value = options.max(axis=0)
    path = [int(np.argmax(value))]
    for i in range(n - 1, 0, -1):
        path.append(int(came_from[i, path[-1]]))
    return path[::-1]


def served_tokens(
    goodput: NDArray[np.float64],
    length: NDArray[np.float64],
    schedule: list[int],
    start: int,
    delay_windows: int,
    down_windows: int,
    live: NDArray[np.bool_] | None = None,
) -> float:
    """Tokens of ``schedule`` with every switch ``delay_windows`` late and ``down_windows`` of downtime after
    each one the engine cannot take live."""
    n = goodput.shape[1]
    wanted = np.array(schedule)
    late = np.concatenate([np.full(delay_windows, start), wanted[: n - delay_windows]]) if delay_windows else wanted
    serving = np.ones(n, dtype=bool)
    for i in np.flatnonzero(np.diff(late)) + 1:
        if live is None or not live[late[i - 1], late[i]]:
            serving[i : i + down_windows] = False
    return float(np.sum(goodput[late, np.arange(n)] * length * serving))


def ceilings(name: str, delays_s: list[float]) -> dict[str, Any]:
    scenario = load_scenario(SCENARIOS / f"{name}.toml")
    engine = SimEngine(scenario)
    configs = [c for c in engine.all_configs() if engine.start_problem(c) is None]
    if scenario.engine.live_k_max:
        # a K = 0 row under a loaded draft: reached live from that draft's K (plain decoding where the plugin
        # skips the draft's pass at K = 0), as a K table reaches it; "off" is a restart away
        configs += [c for d in scenario.drafts if engine.start_problem(c := SimConfig(d.name, 0)) is None]
    mid, length = _grid(scenario)
    goodput = np.stack([engine.expected_goodput(c, mid) for c in configs])
    start_cfg = start_config(scenario)
    start = configs.index(start_cfg) if start_cfg in configs else 0
    downtime_s = scenario.engine.restart_downtime_s
    dt = scenario.controller.collect_interval_s
    dynamic = dynamic_oracle_tokens(engine, configs)
    fixed = float((goodput * length).sum(axis=1).max())
    down = round(downtime_s / dt)
    live = np.array(
        [[i != j and live_change(engine, a, b) for j, b in enumerate(configs)] for i, a in enumerate(configs)]
    )
    schedule = restart_schedule(goodput, length, start, down, live)
    switches = [(a, b) for a, b in pairwise(schedule) if a != b]
    return {
        "scenario": name,
        "dynamic_oracle_goodput": round(dynamic / scenario.duration_s, 3),
        "best_fixed": round(fixed / dynamic, 4),
        "hindsight_schedule": round(served_tokens(goodput, length, schedule, start, 0, down, live) / dynamic, 4),
        "restarts_in_hindsight_schedule": sum(1 for a, b in switches if not live[a, b]),
        "live_changes_in_hindsight_schedule": sum(1 for a, b in switches if live[a, b]),
        "delayed_schedule": {
            f"{d:g}": round(served_tokens(goodput, length, schedule, start, round(d / dt), down, live) / dynamic, 4)
            for d in delays_s
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--scenario", action="append", help="scenario file stem (default: every scenario)")
    ap.add_argument("--delay", action="append", type=float, help="seconds each switch comes late (repeatable)")
    args = ap.parse_args()
    names = args.scenario or sorted(p.stem for p in SCENARIOS.glob("*.toml"))
    delays = args.delay or list(DEFAULT_DELAYS_S)
    rows = [ceilings(n, delays) for n in names]
    print(
        f"{'scenario':24} {'best fixed':>10} {'hindsight':>10} "
        + " ".join(f"{'late ' + f'{d:g}s':>10}" for d in delays)
    )
    for r in rows:
        late = " ".join(f"{r['delayed_schedule'][f'{d:g}']:>10.4f}" for d in delays)
        print(f"{r['scenario']:24} {r['best_fixed']:>10.4f} {r['hindsight_schedule']:>10.4f} {late}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "run": datetime.now(UTC).isoformat(timespec="seconds"),
        "kind": "fractions of the dynamic oracle",
        "rows": rows,
    }
    (RESULTS / "sim_ceilings.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
