"""Measure the lab's physics inside the vLLM engine: draft cost, agreement, throughput against load.

What an operator (and the simulator's calibration) needs to know before trusting the lab as a stand-in
for a GPU deployment: does the target's forward pass dominate a step, what does a draft cost relative
to it (``cost_ratio`` c at batch 1), and where does speculation stop paying as concurrency grows
(``crossover_streams``)? Every figure comes from the vLLM engine itself, one fresh engine per config
(``tuner.lab.calibrate_worker``):

- throughput: greedy tokens/s with no speculation and with ``draft``/K, at each stream count;
- a draft's cost ratio: the target's decode step time over the draft's, each served alone at 1 stream
  (drafts of one shape cost alike, so each distinct shape is timed once);
- agreement: the greedy agreement measured at build time (``manifest.json``) and the acceptance rate the
  speculating engine reported while it was timed.

The result is printed and stored under ``calibration`` in the manifest.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.lab.models import MANIFEST, Manifest, ModelInfo, load_manifest
from tuner.lab.serve import NGRAM_LOOKUP, engine_tmp_dir

log = logging.getLogger(__name__)

_GIB = 1 << 30


class CalibrationError(RuntimeError):
    """An engine could not be started or measured; the message names its log."""


@dataclass(frozen=True)
class CalibrationPlan:
    """What to measure. Stream counts are concurrent greedy requests; tokens are per request."""

    streams: tuple[int, ...] = (1, 4, 16, 32, 64)
    draft: str = "good"
    k: int = 3
    max_tokens: int = 64
    max_model_len: int = 512
    engine_timeout_s: float = 900.0
    lookup: bool = True  # also time the lab's ngram at K (its own pass, fitted: ``fitted_lookup_pass``)


def calibrate(models_dir: Path, plan: CalibrationPlan | None = None, work_dir: Path | None = None) -> dict[str, Any]:
    """Run the measurements, store them in the manifest and return them."""
    plan = plan or CalibrationPlan()
    models_dir = Path(models_dir).resolve()
    manifest = load_manifest(models_dir)
    if plan.draft not in manifest.drafts or manifest.drafts[plan.draft].method == "ngram":
        weighted = [n for n, d in manifest.drafts.items() if d.method != "ngram"]
        raise ValueError(
            f"--draft {plan.draft!r} is not a draft model of this lab; choose one of: {', '.join(weighted)}"
        )
    if not plan.streams or min(plan.streams) < 1:
        raise ValueError("stream counts must be positive integers")
    streams = tuple(sorted(set(plan.streams)))
    own_dir = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="calibrate-", dir=models_dir)) if own_dir else Path(work_dir)  # type: ignore[arg-type]
    work.mkdir(parents=True, exist_ok=True)
    spec_label = f"{plan.draft}/K={plan.k}"
    draft_info = manifest.drafts[plan.draft]
    spec = {"method": "draft_model", "model": draft_info.path, "num_speculative_tokens": plan.k}

    runs: dict[str, dict[str, Any]] = {}
    runs["off"] = _engine(manifest, manifest.target, None, streams, "off", plan, work)
    runs[spec_label] = _engine(manifest, manifest.target, spec, streams, spec_label, plan, work)
    lookups = [n for n, d in manifest.drafts.items() if d.method == "ngram"] if plan.lookup else []
    lookup_name = lookups[0] if lookups else None
    lookup_label = f"{lookup_name}/K={plan.k}" if lookup_name else None
    if lookup_label is not None:
        lookup_spec = {"method": "ngram", "num_speculative_tokens": plan.k, **NGRAM_LOOKUP}
        runs[lookup_label] = _engine(manifest, manifest.target, lookup_spec, streams, lookup_label, plan, work)
    step_cost = fitted_step_cost(
        _throughput(runs, streams, spec_label, None), spec_label, plan.k, runs[spec_label]["mean_acceptance_length"]
    )
    step_ms_target = 1000.0 / runs["off"]["tok_s"]["1"] if "1" in runs["off"]["tok_s"] else None

    # decode step time of each distinct draft shape, served alone at 1 stream
    shape_ms: dict[tuple[int, ...], float] = {_shape(manifest.target): step_ms_target or math.nan}
    drafts: dict[str, dict[str, Any]] = {}
    for name, info in manifest.drafts.items():
        entry: dict[str, Any] = {"method": info.method, "agreement": info.greedy_agreement}
        if info.method != "ngram":
            key = _shape(info)
            if key not in shape_ms:
                alone = _engine(manifest, info, None, (1,), f"{name} alone", plan, work)
                shape_ms[key] = 1000.0 / alone["tok_s"]["1"]
            entry["step_ms"] = round(shape_ms[key], 2)
            entry["cost_ratio"] = round(shape_ms[key] / step_ms_target, 3) if step_ms_target else None
            entry["params"] = info.params
        else:
            entry["cost_ratio"] = None
        timed = spec_label if name == plan.draft else lookup_label if name == lookup_name else None
        if timed is not None:
            entry[f"acceptance_rate_k{plan.k}"] = runs[timed]["acceptance_rate"]
            entry[f"mean_acceptance_length_k{plan.k}"] = runs[timed]["mean_acceptance_length"]
        if timed is not None and timed == lookup_label:
            entry["lookup_pass"] = fitted_lookup_pass(runs[timed].get("rows") or {}, step_cost.get("model"))
        drafts[name] = entry

    throughput = _throughput(runs, streams, spec_label, lookup_label)
    result: dict[str, Any] = {
        "models_dir": str(models_dir),
        "recipe": manifest.recipe.get("name", "tiny"),
        "measured_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]},
        "plan": {"streams": list(streams), "draft": plan.draft, "k": plan.k, "max_tokens": plan.max_tokens},
        "target": {"params": manifest.target.params, "step_ms": round(step_ms_target, 2) if step_ms_target else None},
        "drafts": drafts,
        "throughput": throughput,
        "crossover_streams": crossover(throughput, spec_label),
        "step_cost": step_cost,
        "engine_startup_s": {label: r["startup_s"] for label, r in runs.items()},
    }
    _store(models_dir, result)
    if own_dir:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _throughput(
    runs: dict[str, dict[str, Any]], streams: tuple[int, ...], spec_label: str, lookup_label: str | None
) -> dict[str, dict[str, float | None]]:
    """Tokens/s per stream count: no speculation, ``spec_label`` (and its gain), the lookup when timed."""
    throughput: dict[str, dict[str, float | None]] = {}
    for n in streams:
        off = runs["off"]["tok_s"][str(n)]
        sp = runs[spec_label]["tok_s"][str(n)]
        gain = round(sp / off, 3) if off else None
        row: dict[str, float | None] = {"off": off, spec_label: sp, "speculation_gain": gain}
        if lookup_label is not None:
            row[lookup_label] = runs[lookup_label]["tok_s"][str(n)]
        throughput[str(n)] = row
    return throughput


def crossover(throughput: dict[str, dict[str, float | None]], spec_label: str) -> list[int] | None:
    """The adjacent stream counts between which speculation stops paying: ``[last n it wins, first n it
    loses]``; None when it wins everywhere or loses everywhere measured."""
    ns = sorted(int(n) for n in throughput)
    wins = [(throughput[str(n)][spec_label] or 0.0) > (throughput[str(n)]["off"] or 0.0) for n in ns]
    for i in range(1, len(ns)):
        if wins[i - 1] and not wins[i]:
            return [ns[i - 1], ns[i]]
    return None


def fitted_step_cost(
    throughput: dict[str, dict[str, float | None]], spec_label: str, k: int, mean_acceptance_length: float | None
) -> dict[str, Any]:
    """T(B, K) (``policies.step_cost``) fitted to the measured rows, for the controller's step-cost model.

    A row at n streams runs batch n: without speculation a step makes n tokens, so T = n / tok_s; with
    K it makes n × L (L the mean acceptance length, bonus token included), so T = n·L / tok_s.
    """
    from policies.step_cost import fit_step_cost

    b: list[float] = []
    kk: list[float] = []
    t: list[float] = []
    for n, row in throughput.items():
        off, sp = row.get("off"), row.get(spec_label)
        rows = [(0.0, float(n) / off)] if off else []
        if sp and mean_acceptance_length:
            rows.append((float(k), float(n) * mean_acceptance_length / sp))
        for k_row, step_s in rows:
            b.append(float(n))
            kk.append(k_row)
            t.append(step_s)
    fit = fit_step_cost(b, kk, t)
    if fit.model is None:
        return {"model": None, "reason": str(fit.reason), "message": fit.message}
    m = fit.model
    knee = {"free_tokens": round(m.free_tokens, 3)} if m.free_tokens > 0 else {}
    return {
        "model": {**{name: round(float(getattr(m, name)), 7)
                     for name in ("fixed_s", "per_token_s", "draft_fixed_s", "draft_per_seq_s")}, **knee},
        "reason": str(fit.reason),
        "message": fit.message,
    }


def fitted_lookup_pass(rows: dict[str, dict[str, float]], target: dict[str, float] | None) -> dict[str, Any]:
    """A prompt lookup's own pass, draft_fixed_s + draft_per_seq_s·B, fitted to its timed rows over
    ``target`` — the fixed_s / per_token_s of the step cost the controller is given (``fitted_step_cost``),
    so that the controller's own T(B, K) for the lookup reproduces the step times measured here.

    Why measure it: vLLM's n-gram proposer runs on the host, beside the forward passes; on a GPU it is
    ~free, on this CPU engine it shares the cores with them, so its cost is measured, not assumed (two
    calibrations on 6 Dec: ~0 within the target model's misfit, then 8 ms a step; docs/lab.md).
    A row at n streams runs batch n and makes ``tokens`` in ``tokens − accepted`` sequence steps, so a
    step lasts seconds·n / (tokens − accepted) and the target scores n·(1 + draft tokens / sequence steps)
    tokens in it; what remains of the step is the lookup's. Also returned: the share of sequence steps it drafted at
    (``StepCostModel.proposal_share``), from the engine's own counters.
    """
    if not target:
        return {"model": None, "message": "no target step cost was fitted, so the lookup's pass is not separated"}
    points: list[tuple[float, float]] = []
    shares: dict[str, float] = {}
    drafts = seq_steps_total = 0.0
    for n, r in rows.items():
        b = float(n)
        seq_steps = r["tokens"] - r["num_accepted_tokens"]
        if seq_steps <= 0 or r["seconds"] <= 0:
            continue
        step_s = r["seconds"] * b / seq_steps
        scored = b * (1.0 + r["num_draft_tokens"] / seq_steps)
        beyond_knee = max(scored - float(target.get("free_tokens", 0.0)), 0.0)
        points.append((b, step_s - target["fixed_s"] - target["per_token_s"] * beyond_knee))
        shares[str(int(b))] = round(r["num_drafts"] / seq_steps, 4)
        drafts += r["num_drafts"]
        seq_steps_total += seq_steps
    if not points or drafts <= 0:
        return {"model": None, "message": "the lookup drafted nothing in the timed runs"}
    fixed, per_seq = _nonnegative_line(points)
    return {
        "model": {"draft_fixed_s": round(fixed, 7), "draft_per_seq_s": round(per_seq, 7)},
        "proposal_share": round(drafts / seq_steps_total, 4),
        "proposal_share_by_streams": shares,
        "residual_ms": {str(int(b)): round(1000 * r, 2) for b, r in points},
        "message": f"{1000 * fixed:.2f} ms + {1000 * per_seq:.3f} ms per sequence a step beyond the target's pass",
    }


def _nonnegative_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b·x with a, b ≥ 0 (a cost cannot be negative; noise can make it look so)."""
    import numpy as np
    from scipy import optimize

    x = np.array([[1.0, px] for px, _ in points])
    y = np.array([py for _, py in points])
    (a, b), _ = optimize.nnls(x, y)
    return float(a), float(b)


def _shape(info: ModelInfo) -> tuple[int, ...]:
    cfg = json.loads((Path(info.path) / "config.json").read_text())
    return (int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]))


def _kv_space_gib(manifest: Manifest, streams: int, plan: CalibrationPlan) -> int:
    """KV memory (GiB) for every stream at full length with lookahead, doubled for the draft and slack."""
    per_token = manifest.target.kv_bytes_per_token
    need = 2 * per_token * streams * plan.max_model_len
    return max(1, math.ceil(need / _GIB))


def _engine(
    manifest: Manifest,
    model: ModelInfo,
    spec: dict[str, Any] | None,
    streams: tuple[int, ...],
    label: str,
    plan: CalibrationPlan,
    work: Path,
) -> dict[str, Any]:
    slug = label.replace("/", "_").replace("=", "").replace(" ", "_")
    run_dir = work / slug
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "result.json"
    log_path = run_dir / "engine.log"
    args = {
        "label": label,
        "model": model.path,
        "tokenizer": manifest.tokenizer_path,
        "speculative_config": spec,
        "streams": list(streams),
        "max_tokens": plan.max_tokens,
        "max_model_len": plan.max_model_len,
    }
    tmp, owned = engine_tmp_dir(run_dir)
    tmp.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(run_dir / "vllm-cache"),
        "TORCHINDUCTOR_CACHE_DIR": str(run_dir / "inductor"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(_kv_space_gib(manifest, max(streams), plan)),
    }
    log.info("calibrate: %s at %s streams (engine log %s)", label, ",".join(map(str, streams)), log_path)
    with log_path.open("w") as fh:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "tuner.lab.calibrate_worker", json.dumps(args), str(out)],
                stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=plan.engine_timeout_s, check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise CalibrationError(
                f"{label}: the engine did not finish in {plan.engine_timeout_s:.0f} s; see {log_path}"
            ) from e
        finally:
            if owned:
                shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0 or not out.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        raise CalibrationError(
            f"{label}: the engine exited with {proc.returncode}; see {log_path}. Last lines: " + " | ".join(tail)
        )
    result: dict[str, Any] = json.loads(out.read_text())
    log.info("calibrate: %s: %s tok/s", label, result["tok_s"])
    return result


def _store(models_dir: Path, result: dict[str, Any]) -> None:
    path = models_dir / MANIFEST
    data = json.loads(path.read_text())
    data["calibration"] = result
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
