"""Live benchmark on the lab engine: a phased workload under fixed configs and under spectuner (auto).

Workload (the same in every run): predictable prompts, then hard prompts; in each, concurrency
1 → 16 → 4; every phase lasts ``--phase-s`` seconds of closed-loop greedy completions
(``--max-tokens`` each, ``tuner.lab.load``). Runs, each on its own real vLLM engine (``LabServer``):

- every fixed config in ``--configs`` (default: no speculation, medium K = 3 — the usual starting
  point —, medium K = 5, ngram K = 3), one run each;
- spectuner: the real :class:`tuner.daemon.Daemon` in auto mode with the restart actuator
  supervising the engine (short intervals: collect 3 s, decide 10 s, verify 30 s), started at medium K = 3.

The oracle is the best fixed config *per phase* (from the separate runs, no restart counted).
Per phase and in total: goodput (generated tokens/s over the phase's wall time; spectuner's restarts
count), p50/p99 request latency, errors; for spectuner also the changes, restarts, and time to adapt
(phase start → first config change in that phase). Targets (issue #8): spectuner ≥ 0.97 × the oracle
over the whole run, ≥ 1.15 × fixed K = 3, never worse than no speculation by > 3% in any phase.

    .venv/bin/python bench/bench_live.py [--phase-s 45] [--configs none,medium:3,medium:5,ngram:3]
    .venv/bin/python bench/bench_live.py --actuator live --configs '' --fixed-from bench/results/live.json --out live_k

``--actuator live`` runs spectuner with the live actuator: the engine starts at K_max with a table that
drafts 3 tokens at every batch size (the steps of K = 3), the plugin ships steps and takes K tables
through its control channel, and only a change of draft restarts the engine. ``--fixed-from`` reuses
the fixed runs of an earlier result (same workload) instead of running them again.

Needs ~15–25 min of engine time (one engine at a time; each start 30–180 s on a loaded 2-core
machine). Writes ``bench/results/live.json``, ``live.md`` and ``live.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tuner.actuators.restart import RestartActuator  # noqa: E402
from tuner.config import parse_config  # noqa: E402
from tuner.daemon import Daemon  # noqa: E402
from tuner.lab.load import run_load_async  # noqa: E402
from tuner.lab.models import DEFAULT_MODELS_DIR  # noqa: E402
from tuner.lab.prompts import PROMPT_SETS  # noqa: E402
from tuner.lab.serve import LabServer, speculative_config  # noqa: E402
from tuner.store import AppliedBy, Store, upgrade  # noqa: E402

RESULTS = REPO / "bench" / "results"
PHASES = [("predictable", 1), ("predictable", 16), ("predictable", 4), ("hard", 1), ("hard", 16), ("hard", 4)]


@dataclass
class PhaseResult:
    name: str
    prompts: str
    concurrency: int
    start_s: float  # since the run's workload began
    elapsed_s: float = 0.0
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        lat = sorted(self.latencies_s)
        return {
            "prompts": self.prompts,
            "concurrency": self.concurrency,
            "start_s": round(self.start_s, 2),
            "elapsed_s": round(self.elapsed_s, 2),
            "tokens": self.tokens,
            "requests": self.requests,
            "errors": self.errors,
            "goodput": round(self.tokens / self.elapsed_s, 2) if self.elapsed_s > 0 else 0.0,
            "p50_latency_s": _quantile(lat, 0.5),
            "p99_latency_s": _quantile(lat, 0.99),
        }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    if len(sorted_values) == 1:
        return round(sorted_values[0], 4)
    return round(statistics.quantiles(sorted_values, n=100, method="inclusive")[max(0, min(98, round(q * 100) - 1))], 4)


async def _phase(base_url: str, model: str, prompts: str, concurrency: int, phase_s: float, max_tokens: int,
                 result: PhaseResult) -> None:
    """Closed loop: ``concurrency`` workers send one request after another until the phase ends."""
    pool = PROMPT_SETS[prompts]
    deadline = time.perf_counter() + phase_s
    t0 = time.perf_counter()

    async def worker(i: int) -> None:
        n = i
        while time.perf_counter() < deadline:
            prompt = pool[n % len(pool)]
            n += concurrency
            done = await run_load_async(base_url, model, [prompt], concurrency=1, count=1, max_tokens=max_tokens,
                                        timeout_s=300.0)
            for r in done.requests:
                result.requests += 1
                if r.error is None:
                    result.tokens += r.output_tokens
                    result.latencies_s.append(r.latency_s)
                else:
                    result.errors += 1
                    await asyncio.sleep(0.5)  # the engine is restarting: do not spin

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    result.elapsed_s = time.perf_counter() - t0


def run_workload(base_url: str, model: str, phase_s: float, max_tokens: int) -> list[PhaseResult]:
    out: list[PhaseResult] = []
    t0 = time.perf_counter()
    for prompts, conc in PHASES:
        r = PhaseResult(f"{prompts} c={conc}", prompts, conc, time.perf_counter() - t0)
        asyncio.run(_phase(base_url, model, prompts, conc, phase_s, max_tokens, r))
        print(f"    {r.name}: {r.tokens / max(r.elapsed_s, 1e-9):.1f} tok/s, {r.errors} errors", flush=True)
        out.append(r)
    return out


def _parse_configs(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item in ("none", "off"):
            out.append(("none", 0))
        else:
            name, _, k = item.partition(":")
            out.append((name, int(k or 3)))
    return out


def _label(draft: str, k: int) -> str:
    return "off" if draft == "none" or k == 0 else f"{draft}/K={k}"


def run_fixed(draft: str, k: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    server = LabServer(draft=draft, k=k, models_dir=args.models_dir, workdir=workdir / f"fixed-{draft}-{k}")
    print(f"== fixed {_label(draft, k)}: starting the engine", flush=True)
    startup_s = server.start()
    try:
        # A short warm-up so the first phase does not pay for lazy initialisation.
        asyncio.run(_phase(server.base_url, server.model_name, "predictable", 2, 5.0, args.max_tokens,
                           PhaseResult("warm-up", "predictable", 2, 0.0)))
        phases = run_workload(server.base_url, server.model_name, args.phase_s, args.max_tokens)
    finally:
        server.stop()
    return {"config": _label(draft, k), "startup_s": round(startup_s, 1),
            "phases": {p.name: p.to_json() for p in phases}}


def run_spectuner(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """spectuner in auto mode: the Daemon supervises the engine through the restart actuator."""
    run_dir = workdir / "spectuner"
    run_dir.mkdir(parents=True, exist_ok=True)
    base = LabServer(draft="none", k=0, models_dir=args.models_dir, workdir=run_dir / "engine")
    base.tmp_dir.mkdir(parents=True, exist_ok=True)
    start_spec = speculative_config(base.manifest, "medium", 3)
    assert start_spec is not None
    argv = base.argv()
    i = argv.index("--shutdown-timeout")
    argv = argv[:i] + argv[i + 2:]  # the actuator appends its own
    # The candidates an operator would register: the lab drafts (prior α = greedy agreement in the manifest;
    # every lab draft has the target's shape, c ≈ 0.82) and ngram.
    candidates: list[dict[str, Any]] = []
    for name, info in base.manifest.drafts.items():
        if name in ("random", "copy"):
            continue
        if info.method == "ngram":
            candidates.append({"name": name, "method": "ngram", "prior_alpha": 0.5, "cost_ratio": 0.05,
                               "extra": {"prompt_lookup_min": 2, "prompt_lookup_max": 5}})
        else:
            candidates.append({"name": name, "model": info.path, "cost_ratio": args.cost_ratio,
                               "prior_alpha": min(max(info.greedy_agreement or 0.5, 0.01), 0.99)})
    policy: dict[str, Any] = {"k_max": args.k_max, "cost_ratio": args.cost_ratio, "evidence_window_s": 30.0,
                              "load_horizon_s": 60.0,  # the phases are 45 s: judge K on the last minute's load
                              "step_cost_refit_s": 20.0}  # and read the measured step cells every other tick
    if not args.no_step_cost:  # the lab's T(B, K) fitted from its throughput table (docs/lab.md, docs/simulator.md)
        policy["step_cost"] = {"fixed_s": 0.00208, "per_token_s": 0.0000953, "draft_fixed_s": 0.001566,
                               "draft_per_seq_s": 0.000217}
    if not args.no_table:
        policy.update(per_batch_size=True, max_batch_size=16)
    db_url = f"sqlite:///{run_dir / 'spectuner.db'}"
    upgrade(db_url)
    restart = {"argv": argv, "startup_timeout_s": 400.0, "shutdown_timeout_s": 5.0,
               "log_path": str(run_dir / "engine.log"), "env": base.env()}
    speculative: dict[str, Any] = {"method": "draft_model", "model": start_spec["model"], "num_speculative_tokens": 3}
    extra: dict[str, Any] = {}
    live = args.actuator == "live"
    if live:
        # The engine starts at K_max with a table that drafts 3 tokens at every batch size (the same steps as
        # K = 3), so that every later table is set live through the plugin; another draft still restarts.
        speculative = {**speculative, "num_speculative_tokens": args.k_max,
                       "extra": {"num_speculative_tokens_per_batch_size": [[1, 16, 3]]}}
        extra = {
            "actuator": {"kind": "live", "live": {"fallback": "restart", "k_max": args.k_max}, "restart": restart},
            "plugin": {"ingest_listen": f"127.0.0.1:{_free_port()}", "control_address": f"unix:{run_dir / 'ctl.sock'}",
                       "token_file": str(run_dir / "plugin.token")},
        }
    config = parse_config(
        {
            "engine": {"metrics_url": base.base_url},
            "actuator": {"kind": "restart", "restart": restart},
            **extra,
            "speculative": speculative,
            "policy": policy,
            "swap": {"duration_s": 30.0, "min_drafts": 500, "segments": 2},  # phases are short: confirm over 30 s
            "drafts": candidates,
            "guardrails": {"min_drafts": 200, "min_evidence_s": 15.0, "hysteresis_ticks": 2,
                           "max_changes_per_hour": 30, "restart_downtime_s": 75.0, "payback_horizon_s": 3600.0,
                           # a live change costs no downtime: wait out the verification (30 s), not a restart's
                           "cooldown_s": 30.0 if live else 60.0},
            "controller": {"mode": "auto", "collect_interval_s": 3.0, "decide_interval_s": 10.0,
                           "health_interval_s": 10.0, "verify_window_s": 30.0},
            "database": {"url": db_url},
        },
        path="bench_live",
        base_dir=run_dir,
    )
    ticks: list[dict[str, Any]] = []
    with Store(db_url) as store:
        # restart: the actuator built here; live: the daemon builds it from the config (plugin, fallback)
        daemon = Daemon(config, store, **({} if live else {"actuator": RestartActuator(
                            argv, f"{base.base_url}/health", run_dir / "engine.log", startup_timeout_s=400.0,
                            shutdown_timeout_s=5.0, env=base.env())}),
                        on_tick=lambda r: ticks.append({"at": time.time(), "action": r.action, "reason": r.reason,
                                                        "message": r.message}))
        actuator = daemon.actuator
        print(f"== spectuner (auto, {args.actuator} actuator): starting the daemon and its engine (medium K=3)",
              flush=True)
        thread = threading.Thread(target=daemon.run, kwargs={"install_signals": False}, daemon=True)
        t_start = time.time()
        thread.start()
        try:
            _wait_healthy(base.base_url, 420.0)
            startup_s = time.time() - t_start
            t_workload = time.time()
            phases = run_workload(base.base_url, base.model_name, args.phase_s, args.max_tokens)
        finally:
            daemon.request_stop()  # an apply in progress completes first (the daemon's contract)
            thread.join(timeout=900.0)
            if thread.is_alive():  # never leave an engine behind
                actuator.stop()
        keys = [e.key for e in store.engines()]
        configs = [c for key in keys[:1] for c in store.configs(key)]
        decisions = store.decisions()
        # a rollback restarts the engine only when its actuator had to (a live table is rolled back live)
        rollback_downtime_s = {
            e.data.get("decision_id"): float(e.data.get("downtime_s") or 0.0)
            for e in store.events(kind="regression_rolled_back")
            if isinstance(e.data, dict)
        }
    if args.keep_db is not None:  # the daemon's database (windows, per-step records, decisions) for a post-mortem
        args.keep_db.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / "spectuner.db", args.keep_db)
    decided = {d.id: d.decision.created_at.timestamp() for d in decisions}
    changes = [
        {
            "decided_at_s": round(decided[c.config.decision_id] - t_workload, 1)
            if c.config.decision_id in decided
            else None,
            "serving_at_s": round(c.config.started_at.timestamp() - t_workload, 1),
            "applied_by": c.config.applied_by,
            "decision_id": c.config.decision_id,
            "config": _spec_label(c.config.spec_config or {}),
        }
        for c in configs
        if c.config.applied_by != AppliedBy.STARTUP
    ]
    applied = [c for c in changes if c["applied_by"] in ("restart", "rollback", "live")]
    rollbacks = [c for c in changes if c["applied_by"] == "rollback"]
    restarts = [
        c for c in changes
        if c["applied_by"] == "restart"
        or (c["applied_by"] == "rollback" and rollback_downtime_s.get(c["decision_id"], 1.0) > 0.0)
    ]
    phase_json = {p.name: p.to_json() for p in phases}
    for p in phases:  # time to adapt: phase start → the first change decided in the phase
        first = next(
            (c["decided_at_s"] for c in applied
             if c["decided_at_s"] is not None and p.start_s <= c["decided_at_s"] < p.start_s + p.elapsed_s),
            None,
        )
        phase_json[p.name]["time_to_adapt_s"] = round(first - p.start_s, 1) if first is not None else None
    return {
        "config": f"spectuner auto (start medium/K=3, {args.actuator} actuator)",
        "startup_s": round(startup_s, 1),
        "phases": phase_json,
        "changes": sum(1 for c in applied if c["applied_by"] in ("restart", "live")),
        "restarts": len(restarts),  # engine starts: restarts, and rollbacks that restarted (not live ones)
        "rollbacks": len(rollbacks),
        "config_timeline": changes,
        "decisions": [{"status": d.status, "reason": d.decision.reason, "message": d.decision.message[:300]}
                      for d in decisions],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _spec_label(spec: dict[str, Any]) -> str:
    if spec.get("method") in (None, "off") or not spec.get("num_speculative_tokens"):
        return "off"
    name = Path(str(spec.get("model", spec.get("method")))).name.removeprefix("draft-")
    table = spec.get("num_speculative_tokens_per_batch_size")
    if table:
        return f"{name}/table[" + ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in table) + "]"
    return f"{name}/K={spec['num_speculative_tokens']}"


def _wait_healthy(base_url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the engine at {base_url} did not become healthy within {timeout_s:.0f} s")


def summarize(runs: dict[str, dict[str, Any]], phase_s: float) -> dict[str, Any]:
    names = [f"{p} c={c}" for p, c in PHASES]
    fixed = {k: v for k, v in runs.items() if k != "spectuner"}

    def total(run: dict[str, Any]) -> float:
        ph = run["phases"].values()
        return sum(p["tokens"] for p in ph) / sum(p["elapsed_s"] for p in ph)

    if not fixed:
        return {"totals": {k: round(total(v), 2) for k, v in runs.items()}}
    oracle_phase = {n: max(fixed.values(), key=lambda r: r["phases"][n]["goodput"]) for n in names}
    oracle_tokens = sum(oracle_phase[n]["phases"][n]["tokens"] for n in names)
    oracle_time = sum(oracle_phase[n]["phases"][n]["elapsed_s"] for n in names)
    oracle = oracle_tokens / oracle_time
    out: dict[str, Any] = {
        "oracle": {"goodput": round(oracle, 2), "per_phase": {n: oracle_phase[n]["config"] for n in names}},
        "totals": {k: round(total(v), 2) for k, v in runs.items()},
    }
    if "spectuner" in runs:
        sp = runs["spectuner"]
        sp_total = total(sp)
        k3 = runs.get("medium/K=3")
        off = runs.get("off")
        worst = None
        if off is not None:
            worst = min(sp["phases"][n]["goodput"] / off["phases"][n]["goodput"] for n in names)
        out["targets"] = {
            "spectuner_vs_oracle": {"measured": round(sp_total / oracle, 4), "target": 0.97},
            "spectuner_vs_fixed_k3": {"measured": round(sp_total / total(k3), 4) if k3 else None, "target": 1.15},
            "worst_phase_vs_no_speculation": {"measured": round(worst, 4) if worst else None, "target": 0.97},
        }
    return out


def markdown(doc: dict[str, Any]) -> str:
    names = [f"{p} c={c}" for p, c in PHASES]
    lines = ["# Live benchmark (lab engine)", "", f"Run {doc['when']}; {doc['phase_s']} s per phase, "
             f"{doc['max_tokens']} tokens per request; load average {doc['load_average_before']} → "
             f"{doc['load_average_after']} (a shared 2-core machine: figures are noisy).", ""]
    lines += ["## Goodput (tokens/s) per phase", "",
              "| run | " + " | ".join(names) + " | total |", "|---|" + "---|" * (len(names) + 1)]
    for name, run in doc["runs"].items():
        cells = [f"{run['phases'][n]['goodput']:.0f}" for n in names]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {doc['summary']['totals'][name]:.0f} |")
    if "oracle" in doc["summary"]:
        oracle = doc["summary"]["oracle"]
        lines.append("| oracle (best fixed per phase) | " + " | ".join(oracle["per_phase"][n] for n in names)
                     + f" | {oracle['goodput']:.0f} |")
    lines += ["", "## p50 / p99 request latency (s)", "", "| run | " + " | ".join(names) + " |",
              "|---|" + "---|" * len(names)]
    for name, run in doc["runs"].items():
        cells = [f"{_fmt(run['phases'][n]['p50_latency_s'])} / {_fmt(run['phases'][n]['p99_latency_s'])}"
                 for n in names]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    sp = doc["runs"].get("spectuner")
    if sp:
        lines += ["", f"spectuner: {sp['changes']} changes, {sp['restarts']} restarts, "
                  f"{sp.get('rollbacks', 0)} rollbacks; time to adapt per phase: "
                  + ", ".join(f"{n}: {_fmt(sp['phases'][n].get('time_to_adapt_s'))} s" for n in names), ""]
        lines += ["| decided at (s) | serving from (s) | by | config |", "|---|---|---|---|"]
        lines += [f"| {_fmt(c['decided_at_s'])} | {c['serving_at_s']} | {c['applied_by']} | {c['config']} |"
                  for c in sp["config_timeline"]]
    if "targets" in doc["summary"]:
        lines += ["", "## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        for name, t in doc["summary"]["targets"].items():
            met = t["measured"] is not None and t["measured"] >= t["target"]
            lines.append(f"| {name} | {_fmt(t['measured'])} | ≥ {t['target']} | {'yes' if met else '**no**'} |")
    return "\n".join(lines) + "\n"


def _fmt(x: Any) -> str:
    return "—" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [f"{p} c={c}" for p, c in PHASES]
    runs = doc["runs"]
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / max(len(runs), 1)
    for i, (name, run) in enumerate(runs.items()):
        ax.bar([j + i * width for j in range(len(names))], [run["phases"][n]["goodput"] for n in names],
               width=width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=15)
    ax.set_ylabel("goodput (generated tokens/s)")
    ax.set_title("Lab engine: goodput per phase")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phase-s", type=float, default=45.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--configs", default="none,medium:3,medium:5,ngram:3",
                        help="fixed runs: draft:K,... ('none' = no speculation; '' = none at all)")
    parser.add_argument("--out", default="live", help="result file stem under bench/results/")
    parser.add_argument("--no-spectuner", action="store_true", help="only the fixed runs")
    parser.add_argument("--k-max", type=int, default=5)
    parser.add_argument("--cost-ratio", type=float, default=0.82, help="policy.cost_ratio (lab fit: 0.82)")
    parser.add_argument("--no-step-cost", action="store_true", help="Leviathan's c, not the lab's T(B,K)")
    parser.add_argument("--no-table", action="store_true", help="one K instead of the per-batch-size table")
    parser.add_argument("--models-dir", type=Path, default=DEFAULT_MODELS_DIR)
    parser.add_argument("--actuator", choices=("restart", "live"), default="restart",
                        help="how spectuner applies changes: restart the engine, or set K tables live (plugin)")
    parser.add_argument("--fixed-from", type=Path, default=None,
                        help="reuse the fixed runs of an earlier result JSON (same machine, same workload)")
    parser.add_argument("--keep-db", type=Path, default=None, help="copy spectuner's database here at the end")
    args = parser.parse_args()
    load_before = [round(x, 2) for x in os.getloadavg()]
    runs: dict[str, dict[str, Any]] = {}
    if args.fixed_from is not None:
        earlier = json.loads(args.fixed_from.read_text())
        if earlier.get("phase_s") != args.phase_s or earlier.get("max_tokens") != args.max_tokens:
            parser.error(f"{args.fixed_from} ran another workload (phase_s, max_tokens); run the fixed configs again")
        runs.update({k: v for k, v in earlier["runs"].items() if not k.startswith("spectuner")})
    with tempfile.TemporaryDirectory(prefix="bench-live-", dir=REPO / ".lab") as tmp:
        workdir = Path(tmp)
        for draft, k in _parse_configs(args.configs):
            result = run_fixed(draft, k, args, workdir)
            runs[result["config"]] = result
        if not args.no_spectuner:
            runs["spectuner"] = run_spectuner(args, workdir)
    doc = {
        "when": datetime.now(UTC).isoformat(timespec="seconds"),
        "phase_s": args.phase_s,
        "max_tokens": args.max_tokens,
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "summary": summarize(runs, args.phase_s),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (RESULTS / f"{args.out}.md").write_text(markdown(doc))
    plot(doc, RESULTS / f"{args.out}.png")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
