"""The controller's settings, built straight from the config file's typed sections.

Defaults, units and documentation live in one place, the sections of :mod:`tuner.config`. What is
here only groups them for the controller and derives the pure policies' own inputs from them (a
:class:`~policies.memory.MemoryBudget`, a :class:`~policies.draft_choice.DraftTriggerConfig`, a pinned
:class:`~policies.step_cost.StepCostModel`), each in one property, so a new key is added once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from policies.draft_choice import DraftTriggerConfig, TriggerStatistic
from policies.memory import MemoryBudget
from policies.spec_config import method_drafts_at_k0
from policies.step_cost import StepCostModel
from tuner.config import (
    CanarySection,
    ControllerSection,
    GuardrailsSection,
    MemorySection,
    PolicySection,
    SpectunerConfig,
    SwapSection,
)

# A config the controller proposed that did not come up, or regressed, is not proposed again for this
# long (seconds): a day lets a transient cause (a busy node, a bad hour of traffic) pass.
FAILED_RETRY_S = 86400.0


@dataclass(frozen=True)
class PolicySettings:
    """What the policy reads: ``[policy]`` as written, plus the memory budget and the swap trigger (None:
    no budget / never swap)."""

    policy: PolicySection = field(default_factory=PolicySection)
    memory: MemoryBudget | None = None
    swap: DraftTriggerConfig | None = None
    # ``[memory]``: the target's KV bytes per token (with the engine's cache_config_info, the KV pool that
    # caps each config's batch; 0: not known) and the context per sequence when KV usage is not scraped
    target_kv_bytes_per_token: int = 0
    tokens_per_seq: int = 0
    # ``[plugin] skip_draft_pass_at_k0``: the engine's K = 0 steps skip the draft model's pass
    k0_draft_pass_skipped: bool = False
    # ``[plugin] skip_draft_pass_at_k0_prompts``: steps with a prompt skip it too (K = 0 is plain decoding)
    k0_prompt_pass_skipped: bool = False

    @classmethod
    def from_sections(
        cls, policy: PolicySection, memory: MemorySection | None = None, swap: SwapSection | None = None
    ) -> PolicySettings:
        budget = None
        if memory is not None and memory.budget_bytes is not None:
            budget = MemoryBudget(
                budget_bytes=memory.budget_bytes,
                target_kv_bytes_per_token=memory.target_kv_bytes_per_token,
                tokens_per_seq=memory.tokens_per_seq,
            )
        trigger = None
        if swap is not None and swap.enabled:
            trigger = DraftTriggerConfig(
                threshold=swap.threshold,
                duration_s=swap.duration_s,
                min_drafts=swap.min_drafts,
                statistic=TriggerStatistic(swap.statistic),
                segments=swap.segments,
                prior_strength_trials=swap.prior_strength_trials,
                confidence=policy.confidence,
                shadow_error_sd=swap.shadow_error_sd,
            )
        if memory is None:
            return cls(policy, budget, trigger)
        return cls(policy, budget, trigger, memory.target_kv_bytes_per_token, memory.tokens_per_seq)

    def drafts_at_k0(self, method: object) -> bool:
        """Does every K = 0 step under ``method`` run a draft pass on this engine? (vLLM's model drafts
        do, unless the plugin skips it in decode-only steps.)"""
        return method_drafts_at_k0(method) and not self.k0_draft_pass_skipped

    def k0_skip_output_tokens(self, output_tokens_per_request: float | None) -> float:
        """``StepCostModel.k0_skip_output_tokens`` for this engine: under the plugin's skip the requests' mean
        output tokens (a K = 0 step keeps the pass when a prompt enters), else 0. Unknown (no finished
        requests counted): 0, a K = 0 step priced as plain decoding until its measured cells say more. With
        the prompt steps skipped too: 0, every K = 0 step is plain decoding."""
        if not self.k0_draft_pass_skipped or self.k0_prompt_pass_skipped or output_tokens_per_request is None:
            return 0.0
        return max(float(output_tokens_per_request), 1.0)

    def engine_step_cost(
        self, model: StepCostModel, method: object, output_tokens_per_request: float | None
    ) -> StepCostModel:
        """``model`` with this engine's K = 0 under ``method``: one draft pass (vLLM), the share of steps
        a prompt enters (the plugin's skip), or none (a lookup, no draft)."""
        out = model.with_draft_pass_at_k0(self.drafts_at_k0(method))
        skip = self.k0_skip_output_tokens(output_tokens_per_request) if method_drafts_at_k0(method) else 0.0
        return out.with_k0_skip(skip)

    @property
    def pinned_step_cost(self) -> StepCostModel | None:
        """``[policy.step_cost]``: an operator's measured T(B, K), which wins over a fit."""
        sc = self.policy.step_cost
        if sc is None:
            return None
        return StepCostModel(
            sc.fixed_s, sc.per_token_s, sc.draft_fixed_s, sc.draft_per_seq_s, free_tokens=sc.free_tokens
        )


@dataclass(frozen=True)
class ControllerSettings:
    """One controller: which engine series it drives, and the sections that steer it."""

    metrics_url: str  # the engine series' url, as the collector stores it
    model_name: str | None = None
    controller: ControllerSection = field(default_factory=ControllerSection)
    guardrails: GuardrailsSection = field(default_factory=GuardrailsSection)
    policy: PolicySettings = field(default_factory=PolicySettings)
    history_s: float = SwapSection.model_fields["history_s"].default  # how far back a candidate's α counts
    fleet_prior: bool = False  # candidates' prior α from the fleet (tuner.controller.fleet_prior)
    canary: CanarySection = field(default_factory=CanarySection)
    failed_retry_s: float = FAILED_RETRY_S

    @classmethod
    def from_config(cls, config: SpectunerConfig, metrics_url: str) -> ControllerSettings:
        return cls(
            metrics_url=metrics_url,
            model_name=config.engine.model_name,
            controller=config.controller,
            guardrails=config.guardrails,
            policy=replace(
                PolicySettings.from_sections(config.policy, config.memory, config.swap),
                k0_draft_pass_skipped=config.plugin.skip_draft_pass_at_k0,
                k0_prompt_pass_skipped=config.plugin.skip_draft_pass_at_k0_prompts,
            ),
            history_s=config.swap.history_s,
            fleet_prior=config.swap.fleet_prior,
            canary=config.canary,
        )

    @property
    def auto(self) -> bool:
        return self.controller.mode.value == "auto"


__all__ = ["FAILED_RETRY_S", "ControllerSettings", "PolicySettings"]
