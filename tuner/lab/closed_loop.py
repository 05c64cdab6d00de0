"""A ``spectuner.toml`` for the lab engine: the daemon supervises a real vLLM server on the lab models.

Used by the closed-loop demo and the live controller tests. Intervals are short (seconds, not
minutes) so a whole loop — weak draft, swap, K tuning — fits a few minutes on 2 cores; the guardrail
logic is the production one, only the numbers differ.

The step-cost model is the lab's (``lab_cost_model``). For the tiny models it is derived from the
throughput docs/lab.md records (no speculation 459 / 4428 tok/s at 1 / 16 streams; a target-sized
draft at K = 3: 512 / 2743 tok/s):
T(B, K) = 2.08 ms + 0.095 ms·B·(K+1) + K·(1.56 ms + 0.217 ms·B). A draft pass costs about 0.8 of a
target pass (c ≈ 0.8: the lab's drafts are target-shaped), so speculation pays only with a very good
draft at low load, and loses at 16 streams — the regime the per-batch-size table is for. The gpu-like
models use their calibration (``spectuner lab calibrate``): c ≈ 0.26, speculation wins up to ~16 streams.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.step_cost import StepCostModel
from tuner.lab.apply_load import side_by_side_cpu_env
from tuner.lab.models import Manifest
from tuner.lab.serve import NGRAM_LOOKUP, LabServer

LAB_STEP_COST: dict[str, float] = {
    "fixed_s": 2.08e-3,
    "per_token_s": 9.5e-5,
    "draft_fixed_s": 1.56e-3,
    "draft_per_seq_s": 2.17e-4,
}
LAB_DRAFT_COST_RATIO = 0.8
# The gpu-like lab (docs/lab.md), fitted by `spectuner lab calibrate` on the 2-core machine from tokens/s
# without speculation and with good/K = 3 at 1-64 streams (7 Dec 2026): the target's pass is flat at
# 39.5 ms up to 5.5 tokens scored, then grows 3.7 ms a token (plain decoding: 43 ms at 1 and 39 ms at 4
# streams, 77 ms at 16, 258 ms at 64); a draft step costs ~0.15 of a target step at batch 1 (drafting's
# own engine overhead included). A lab with its own calibration in manifest.json uses that instead.
GPU_LIKE_STEP_COST: dict[str, float] = {
    "fixed_s": 0.0394937,
    "per_token_s": 0.0037059,
    "draft_fixed_s": 0.0051688,
    "draft_per_seq_s": 0.0008634,
    "free_tokens": 5.524,
}
# The gpu-like lab's ngram (2-5-gram lookup) pass beyond the target's, fitted by `spectuner lab calibrate`
# on the 2-core machine, 6 Dec 2026 (ngram/K = 3 at 1-64 streams): no cost the linear target model can
# separate — the steps' residuals scatter -36..+15 ms around it (docs/lab.md), so ~free, as on a GPU.
GPU_LIKE_LOOKUP_PASS: dict[str, float] = {"draft_fixed_s": 0.0, "draft_per_seq_s": 0.0}
_PASS_KEYS = ("draft_fixed_s", "draft_per_seq_s")
PRIOR_ALPHA = {"good": 0.9, "medium": 0.7, "weak": 0.3, "copy": 0.95, "random": 0.05}


@dataclass(frozen=True)
class LoopSettings:
    start_draft: str = "weak"
    start_k: int = 3
    candidates: tuple[str, ...] = ("good", "medium")
    broken_candidate: str | None = None  # a path that does not hold a loadable draft (prior α 0.97)
    per_batch_size: bool = False
    k_max: int = 4
    max_batch_size: int = 16
    mode: str = "auto"
    collect_interval_s: float = 2.0
    decide_interval_s: float = 5.0
    evidence_window_s: float = 60.0
    swap_duration_s: float = 40.0
    swap_min_drafts: int = 150
    min_drafts: int = 100
    min_evidence_s: float = 15.0
    hysteresis_ticks: int = 2
    cooldown_s: float = 30.0
    verify_window_s: float = 40.0
    restart_downtime_s: float = 90.0
    startup_timeout_s: float = 300.0  # an engine start slower than this fails (and is rolled back)
    argv_prefix: tuple[str, ...] = ()  # e.g. ("taskset", "-c", "0"): one core per replica, all its processes
    # The front door (docs/controller.md "Changes without an outage"): a tap inside the daemon on this
    # port, which clients and the collector use; None: clients talk to the engine (plain restarts).
    front_door_port: int | None = None
    blue_green_port: int | None = None  # with the front door: auto picks blue/green (CPU: it fits)
    strategy: str = "auto"
    # Or a separate tap shared by several replicas (one sidecar each): its control URL and token file.
    control_url: str | None = None
    control_token_file: str | None = None
    canary: Mapping[str, Any] | None = None  # the [canary] table (docs/fleet.md), None: left out


def lab_cost_model(manifest: Manifest) -> tuple[dict[str, float], float]:
    """The step-cost model and draft cost ratio the controller is given for these lab models.

    The lab's own calibration when `spectuner lab calibrate` stored one, else the figures measured for
    its recipe on the 2-core machine (tiny: c ≈ 0.8, gpu-like: c ≈ 0.26).
    """
    fitted = (manifest.calibration or {}).get("step_cost") or {}
    model = fitted.get("model")
    if not model:
        if manifest.recipe.get("name") != "gpu-like":
            return dict(LAB_STEP_COST), LAB_DRAFT_COST_RATIO
        model = GPU_LIKE_STEP_COST
    c = StepCostModel.from_dict(dict(model)).cost_ratio(1.0)
    return dict(model), round(c, 3)


def lab_draft_cost_ratio(manifest: Manifest, name: str, default: float) -> float:
    """The cost ratio a lab draft is registered with: its own calibrated figure when `spectuner lab
    calibrate` stored one, else ``default`` (the lab's model-draft ratio). ngram gets ``default`` too, for
    the step-cost fits that split a step between target and draft; where its pass is known in seconds
    (``lab_lookup_pass``) predictions use that. Not the free default that suits a GPU engine: on the CPU
    engine its proposer shares the two cores with the forward passes."""
    measured = ((manifest.calibration or {}).get("drafts") or {}).get(name) or {}
    ratio = measured.get("cost_ratio")
    return float(ratio) if isinstance(ratio, int | float) and ratio > 0 else default


def lab_lookup_pass(manifest: Manifest) -> dict[str, float] | None:
    """The lab's prompt lookup's own pass in seconds (draft_fixed_s, draft_per_seq_s) the ngram candidate
    is registered with: the one `spectuner lab calibrate` fitted when stored, else the gpu-like recipe's
    measured figures; None for a tiny lab without calibration (it keeps the model-draft ratio).

    Why seconds, not a ratio: the proposer runs on the host and costs the same at any batch, where a
    ratio of the target's pass grows with the batch — priced by ratio, the 64-stream ngram step read ~55-70 ms
    of drafting where calibration measured 0–8 ms, and the controller ranked ngram below no speculation where it
    was the best config."""
    stored = ((((manifest.calibration or {}).get("drafts") or {}).get("ngram") or {}).get("lookup_pass") or {})
    model = stored.get("model")
    if isinstance(model, Mapping) and all(isinstance(model.get(k), int | float) for k in _PASS_KEYS):
        return {k: float(model[k]) for k in _PASS_KEYS}
    if manifest.recipe.get("name") == "gpu-like":
        return dict(GPU_LIKE_LOOKUP_PASS)
    return None


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Sequence):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _table(name: str, values: Mapping[str, Any], array: bool = False) -> str:
    head = f"[[{name}]]" if array else f"[{name}]"
    return "\n".join([head, *(f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None)]) + "\n"


def lab_daemon_config(
    server: LabServer, db_url: str, settings: LoopSettings = LoopSettings(), log_path: Path | None = None
) -> str:
    """The TOML text of a daemon config that supervises ``server``'s command line (not started here)."""
    manifest = server.manifest
    start = manifest.drafts[settings.start_draft]
    step_cost, cost_ratio = lab_cost_model(manifest)
    # The lab server's argv without speculation; the restart actuator appends --speculative-config.
    bare = LabServer(
        draft="none", k=0, port=server.port, models_dir=server.models_dir, workdir=server.workdir,
        max_num_seqs=settings.max_batch_size, extra_args=server.extra_args,
    )
    door_url = f"http://127.0.0.1:{settings.front_door_port}" if settings.front_door_port else None
    parts = [
        _table("engine", {"metrics_url": door_url or server.base_url}),
        _table(
            "speculative",
            {"method": start.method, "model": start.path if start.method != "ngram" else None,
             "num_speculative_tokens": settings.start_k,
             "extra": dict(NGRAM_LOOKUP) if start.method == "ngram" else None},
        ),
        _table("actuator", {"kind": "restart", "strategy": settings.strategy}),
        _table(
            "actuator.restart",
            {"argv": [*settings.argv_prefix, *bare.argv()], "startup_timeout_s": settings.startup_timeout_s,
             "shutdown_timeout_s": 5.0, "log_path": str(log_path or server.log_path), "pass_shutdown_timeout": False,
             "env": server.env()},
        ),
        _table(
            "policy",
            {"k_max": settings.k_max, "cost_ratio": cost_ratio,
             "evidence_window_s": settings.evidence_window_s, "per_batch_size": settings.per_batch_size,
             "max_batch_size": settings.max_batch_size},
        ),
        _table("policy.step_cost", step_cost),
        _table(
            "swap",
            {"threshold": 0.4, "duration_s": settings.swap_duration_s, "min_drafts": settings.swap_min_drafts,
             "segments": 2},
        ),
        _table(
            "guardrails",
            {"min_drafts": settings.min_drafts, "min_evidence_s": settings.min_evidence_s, "min_gain": 0.03,
             "hysteresis_ticks": settings.hysteresis_ticks, "cooldown_s": settings.cooldown_s,
             "max_changes_per_hour": 20, "restart_downtime_s": settings.restart_downtime_s,
             "payback_horizon_s": 3600.0},
        ),
        _table(
            "controller",
            {"mode": settings.mode, "collect_interval_s": settings.collect_interval_s,
             "decide_interval_s": settings.decide_interval_s, "health_interval_s": 5.0,
             "retention_interval_s": 300.0, "verify_window_s": settings.verify_window_s,
             "regression_tolerance": 0.1},
        ),
        _table("database", {"url": db_url}),
    ]
    if settings.front_door_port is not None:
        parts.append(
            _table(
                "actuator.front_door",
                {"engine_url": server.base_url, "listen": f"127.0.0.1:{settings.front_door_port}",
                 "blue_green_port": settings.blue_green_port, "device": "cpu", "max_hold_s": 300.0,
                 "drain_timeout_s": 60.0,
                 "env_by_port": {
                     str(p): e for p, e in side_by_side_cpu_env((server.port, settings.blue_green_port)).items()
                 } if settings.blue_green_port and server.port else None},
            )
        )
    if settings.control_url is not None:
        parts.append(
            _table(
                "actuator.front_door",
                {"engine_url": server.base_url, "control_url": settings.control_url,
                 "control_token_file": settings.control_token_file, "drain_timeout_s": 60.0},
            )
        )
    if settings.canary is not None:
        parts.append(_table("canary", settings.canary))
    for name in settings.candidates:
        info = manifest.drafts[name]
        parts.append(
            _table(
                "drafts",
                {"name": name, "method": info.method, "model": info.path if info.method != "ngram" else None,
                 "extra": dict(NGRAM_LOOKUP) if info.method == "ngram" else None,
                 "prior_alpha": PRIOR_ALPHA.get(name, 0.5),
                 "cost_ratio": lab_draft_cost_ratio(manifest, name, cost_ratio),
                 **((lab_lookup_pass(manifest) or {}) if info.method == "ngram" else {})},
                array=True,
            )
        )
    if settings.broken_candidate is not None:
        parts.append(
            _table(
                "drafts",
                {"name": "broken", "method": "draft_model", "model": settings.broken_candidate,
                 "prior_alpha": 0.97, "cost_ratio": cost_ratio},
                array=True,
            )
        )
    return "\n".join(parts)


__all__ = ["GPU_LIKE_LOOKUP_PASS", "GPU_LIKE_STEP_COST", "LAB_DRAFT_COST_RATIO", "LAB_STEP_COST", "LoopSettings",
           "lab_cost_model", "lab_daemon_config", "lab_draft_cost_ratio", "lab_lookup_pass"]
