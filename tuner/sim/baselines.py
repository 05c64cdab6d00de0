"""Comparison policies, as the systems they imitate run them (no guardrails, by design).

Each reads the same :class:`~tuner.controller.context.DecisionContext` the controller reads (its
measured part, built from the same store by ``tuner.controller.context.measure``) and returns the
config it wants, or None to keep the current one.
They are driven by :class:`tuner.sim.run.ThinDriver`, which applies through the same actuator and
records configs in the same store, but skips spectuner's guardrails (evidence, gain interval,
hysteresis, cooldown, switching cost) — those rails are what is being compared.

- ``sglang_ma``: a moving average of the accepted tokens per draft with a dead band (as SGLang's
  adaptive speculation does): K + 1 when the average is above ``ma_up``·K, K − 1 below ``ma_down``·K.
  It only moves K of the current draft and never switches speculation off.
- ``trtllm_cutoff``: TensorRT-LLM's acceptance cut-off: once the mean acceptance length (1 + A/D) over
  ``cutoff_window_s`` is below ``cutoff_accept_length``, speculation is switched off for good.
- ``ucb``: a UCB1 bandit over configurations (every draft at ``ucb_k`` plus off): each pull holds a
  config for ``ucb_epoch_s``; the reward is its measured generated tokens/s (normalised by the best
  seen); a config that fails to start scores 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from tuner.controller.context import DecisionContext
from tuner.sim.engine import OFF, SimConfig, SimEngine


class Baseline(Protocol):
    name: str

    @property
    def evidence_window_s(self) -> float: ...

    def decide(self, evidence: DecisionContext, current: SimConfig, now: datetime) -> SimConfig | None: ...

    def applied(self, target: SimConfig, ok: bool, now: datetime) -> None: ...


@dataclass
class MovingAverageDeadBand:
    """SGLang-style: EMA of accepted tokens per draft, K ± 1 outside a dead band."""

    k_max: int
    smoothing: float
    up: float
    down: float
    evidence_window_s: float  # the newest windows only (one decide interval)
    name: str = "sglang_ma"
    ema: float | None = None

    def decide(self, evidence: DecisionContext, current: SimConfig, now: datetime) -> SimConfig | None:
        if current.off or evidence.spec.drafts == 0:
            return None
        x = evidence.spec.accepted_tokens / evidence.spec.drafts
        self.ema = x if self.ema is None else self.smoothing * x + (1.0 - self.smoothing) * self.ema
        ratio = self.ema / current.k
        if ratio > self.up and current.k < self.k_max:
            return SimConfig(current.draft, current.k + 1)
        if ratio < self.down and current.k > 1:
            return SimConfig(current.draft, current.k - 1)
        return None

    def applied(self, target: SimConfig, ok: bool, now: datetime) -> None:
        self.ema = None  # a new K: the average starts again


@dataclass
class AcceptanceCutoff:
    """TensorRT-LLM-style: speculation off for good once the mean acceptance length is too low."""

    threshold: float
    evidence_window_s: float
    name: str = "trtllm_cutoff"
    disabled: bool = False

    def decide(self, evidence: DecisionContext, current: SimConfig, now: datetime) -> SimConfig | None:
        if self.disabled or current.off or evidence.spec.drafts == 0:
            return None
        if evidence.duration_s < 0.9 * self.evidence_window_s:
            return None  # the window is not full yet
        length = 1.0 + evidence.spec.accepted_tokens / evidence.spec.drafts
        if length < self.threshold:
            self.disabled = True
            return OFF
        return None

    def applied(self, target: SimConfig, ok: bool, now: datetime) -> None:
        return None


@dataclass
class UcbBandit:
    """UCB1 over configurations; rewards are measured tokens/s normalised by the best seen."""

    arms: list[SimConfig]
    epoch_s: float
    exploration: float
    name: str = "ucb"
    pulls: dict[SimConfig, int] = field(default_factory=dict)
    rewards: dict[SimConfig, float] = field(default_factory=dict)  # sum of raw tokens/s
    pull_started: datetime | None = None
    best_rate: float = 0.0

    @property
    def evidence_window_s(self) -> float:
        return self.epoch_s

    def decide(self, evidence: DecisionContext, current: SimConfig, now: datetime) -> SimConfig | None:
        if self.pull_started is None:
            self.pull_started = now
        if (now - self.pull_started).total_seconds() < self.epoch_s:
            return None
        rate = evidence.goodput_tokens_per_s or 0.0
        self._reward(current, rate)
        self.pull_started = now
        return self._choose(current)

    def _reward(self, arm: SimConfig, rate: float) -> None:
        self.pulls[arm] = self.pulls.get(arm, 0) + 1
        self.rewards[arm] = self.rewards.get(arm, 0.0) + rate
        self.best_rate = max(self.best_rate, rate)

    def _choose(self, current: SimConfig) -> SimConfig | None:
        for arm in self.arms:
            if arm not in self.pulls:
                return arm if arm != current else None
        total = sum(self.pulls.values())
        scale = self.best_rate or 1.0

        def ucb(arm: SimConfig) -> float:
            n = self.pulls[arm]
            return self.rewards[arm] / n / scale + self.exploration * math.sqrt(2.0 * math.log(total) / n)

        best = max(self.arms, key=lambda a: (ucb(a), a == current))
        return None if best == current else best

    def applied(self, target: SimConfig, ok: bool, now: datetime) -> None:
        if not ok:
            self._reward(target, 0.0)  # it did not start: the pull earned nothing
        self.pull_started = now


def make_baseline(name: str, engine: SimEngine) -> Baseline:
    s = engine.scenario
    b = s.baselines
    if name == "sglang_ma":
        return MovingAverageDeadBand(
            s.controller.k_max, b.ma_smoothing, b.ma_up, b.ma_down, s.controller.decide_interval_s
        )
    if name == "trtllm_cutoff":
        return AcceptanceCutoff(b.cutoff_accept_length, b.cutoff_window_s)
    if name == "ucb":
        arms = [SimConfig(d.name, k) for d in s.drafts for k in b.ucb_k if k <= s.controller.k_max]
        return UcbBandit([*arms, OFF], b.ucb_epoch_s, b.ucb_exploration)
    raise ValueError(f"unknown baseline {name!r}")
