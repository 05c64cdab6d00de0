"""The controller's settings built from the config file's sections (tuner/controller/settings.py)."""

from __future__ import annotations

from typing import Any

from policies.draft_choice import TriggerStatistic
from policies.memory import MemoryBudget
from policies.step_cost import StepCostModel
from tuner.config import Mode, parse_config
from tuner.controller.settings import FAILED_RETRY_S, ControllerSettings

URL = "http://127.0.0.1:8000/metrics"


def config(**sections: Any) -> Any:
    data: dict[str, Any] = {
        "engine": {"metrics_url": "http://127.0.0.1:8000", "model_name": "target"},
        "speculative": {"method": "draft_model", "model": "/models/d", "num_speculative_tokens": 3},
    }
    data.update(sections)
    return parse_config(data)


def test_sections_are_passed_through_and_the_policies_inputs_derived() -> None:
    cfg = config(
        controller={"mode": "auto", "verify_window_s": 120},
        actuator={"kind": "restart", "restart": {"argv": ["vllm", "serve", "/m"]}},
        guardrails={"min_drafts": 1000, "maintenance_windows": [{"start": "02:00", "end": "04:00", "days": [0]}]},
        policy={"k_max": 6, "confidence": 0.9, "step_cost": {"fixed_s": 0.02, "per_token_s": 0.001, "free_tokens": 8}},
        memory={"budget_bytes": 10**9, "tokens_per_seq": 4096, "target_kv_bytes_per_token": 131072},
        swap={"threshold": 0.35, "duration_s": 300, "statistic": "draft_acceptance_rate", "history_s": 3600},
    )
    s = ControllerSettings.from_config(cfg, URL)
    assert s.metrics_url == URL and s.model_name == "target"
    assert s.controller is cfg.controller and s.guardrails is cfg.guardrails and s.policy.policy is cfg.policy
    assert s.auto and s.controller.mode is Mode.AUTO and s.controller.verify_window_s == 120
    assert s.guardrails.min_drafts == 1000 and len(s.guardrails.maintenance_windows) == 1
    assert s.history_s == 3600 and s.failed_retry_s == FAILED_RETRY_S
    assert s.policy.memory == MemoryBudget(budget_bytes=10**9, target_kv_bytes_per_token=131072, tokens_per_seq=4096)
    trigger = s.policy.swap
    assert trigger is not None and trigger.threshold == 0.35 and trigger.duration_s == 300
    assert trigger.statistic is TriggerStatistic.DRAFT_ACCEPTANCE_RATE
    assert trigger.confidence == 0.9  # the policy's confidence, one setting for every interval
    assert s.policy.pinned_step_cost == StepCostModel(0.02, 0.001, 0.0, 0.0, free_tokens=8.0)


def test_defaults_mean_advisory_no_budget_no_pinned_model_and_swap_off_when_disabled() -> None:
    s = ControllerSettings.from_config(config(swap={"enabled": False}), URL)
    assert not s.auto and s.controller.mode is Mode.ADVISORY
    assert s.policy.memory is None and s.policy.swap is None and s.policy.pinned_step_cost is None
    assert s.policy.policy.step_cost_fit  # fit T(B, K) from the plugin's steps unless told not to
    assert ControllerSettings(URL).policy.swap is None  # built by hand: no swap unless given
