"""Fleet mode: canary verification against before/after verification on a simulated fleet under drift.

N replicas of one engine (the scenario's physics: capacity, step cost T(B, K), acceptance survival, from
:class:`tuner.sim.engine.SimEngine`) sit behind one router that spreads the fleet's load evenly, each with
its own noise. The fleet's load and prompt mix drift over time, alike for every replica. A sequence of
changes with known true effects (better, worse, neutral: a factor on the goodput, through the step time)
is applied, each to one replica, and each is judged two ways on the same simulated minutes:

- **canary** (:func:`policies.canary.judge_canary`): the changed replica's per-minute goodput per
  engine-second and time per output token against the untouched replicas' over the same minutes, checked
  every minute; it stops as soon as it promotes or rolls back, and rolls back an undecided canary at
  ``canary_max_s``;
- **before/after**, on the same replica, as the controller does on a single engine
  (:mod:`tuner.controller.verify`): the collect windows of ``evidence_window_s`` before the change against
  those of ``verify_window_s`` after it, both with the plain :func:`judge` and with the controller's full
  pipeline (:func:`judge_at_matched_load` on rates divided by :func:`prompt_shift`).

A verdict is wrong when it promotes (keeps) a worse change or rolls back a better or neutral one. Each
change is an independent trial from the same start config (a verdict does not carry into the next change).

Window model, per replica r and collect window at time t: concurrency c(t)/N × (1 + imbalance), the batch
capped by memory; α = the draft's α + the prompt drift + a per-replica, per-window jitter (the prompts that
replica got); step time T(B, K) × the prompt-length drift (longer prompts: more prefill interleaved into
decode steps) × a persistent per-replica speed offset × per-window noise ÷ (1 + the change's effect).
Counters are expected values at that α (the per-window α jitter dominates the binomial noise of thousands
of drafts). The scenario's load section and its restart downtime are not used: every replica runs the
fleet's load, and time is counted from the change taking effect, for both judgements alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from numpy.typing import NDArray

from policies.canary import GOODPUT, CanaryDecision, CanarySettings, Direction, MetricSamples, MetricSpec, judge_canary
from policies.counters import SpecCounters
from tuner.controller.verify import judge, judge_at_matched_load, prompt_shift
from tuner.sim.engine import SimConfig, SimEngine
from tuner.sim.scenario import Scenario

# The sim has no TTFT or error rate; its latency proxy is the mean time per output token of a sequence.
TPOT_MEAN = MetricSpec("tpot_mean_s", Direction.LOWER_IS_BETTER, tolerance_rel=0.10)
FLEET_METRICS = (GOODPUT, TPOT_MEAN)

_MAX_ALPHA = 0.999


@dataclass(frozen=True)
class Drift:
    """How far the fleet's load and prompt mix wander (each a smooth curve in [−1, 1] × its amplitude)."""

    name: str
    load_rel: float  # concurrency × (1 ± load_rel)
    alpha_abs: float  # α ± alpha_abs (prompts turning easy or hard)
    step_rel: float  # step time × (1 ± step_rel) (prompt length: prefill interleaved into decode steps)


DRIFTS = {
    "none": Drift("none", 0.0, 0.0, 0.0),
    "moderate": Drift("moderate", 0.25, 0.04, 0.05),
    "strong": Drift("strong", 0.5, 0.08, 0.10),
}


@dataclass(frozen=True)
class FleetSettings:
    """The fleet and the trial of changes. Effects are relative goodput changes (+0.10: 10 % more)."""

    replicas: int = 4
    concurrency_per_replica: float = 48.0  # mean requests running per replica
    router_imbalance_sd: float = 0.05  # per-window spread of the router's share per replica
    replica_noise_sd: float = 0.03  # per-window step-time noise per replica (request mix, batching)
    replica_alpha_sd: float = 0.02  # per-window α jitter per replica (the prompts that replica got)
    replica_bias_sd: float = 0.005  # persistent per-replica speed offset (hardware, placement)
    drift_periods_s: tuple[float, ...] = (1800.0, 3600.0, 7200.0)  # the drift curves' sinusoids
    changes: int = 60  # a third better, a third worse, a third neutral
    better_effects: tuple[float, ...] = (0.05, 0.08, 0.10, 0.15)
    worse_effects: tuple[float, ...] = (-0.10, -0.12, -0.15, -0.20)
    change_spacing_s: float = 2400.0  # between two changes' start times (≥ the evidence + canary spans)
    canary_max_s: float = 1800.0  # an undecided canary rolls back then
    sample_s: float = 60.0  # one canary sample per replica per minute
    canary: CanarySettings = field(default_factory=CanarySettings)

    def __post_init__(self) -> None:
        checks = (
            ("replicas", self.replicas >= 3),  # the same-time levelling needs two untouched replicas
            ("concurrency_per_replica", self.concurrency_per_replica > 0),
            ("changes", self.changes >= 3),
            ("canary_max_s", self.canary_max_s >= self.sample_s * self.canary.min_samples),
            ("sample_s", self.sample_s > 0),
            ("better_effects", all(e > 0 for e in self.better_effects) and bool(self.better_effects)),
            ("worse_effects", all(-1 < e < 0 for e in self.worse_effects) and bool(self.worse_effects)),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"fleet setting {name} = {getattr(self, name)!r} is out of range")
        for name in ("router_imbalance_sd", "replica_noise_sd", "replica_alpha_sd", "replica_bias_sd"):
            value = getattr(self, name)
            if not (0.0 <= value < 0.5):
                raise ValueError(f"fleet setting {name} must lie in [0, 0.5) but got {value!r}")


class Truth(StrEnum):
    BETTER = "better"
    WORSE = "worse"
    NEUTRAL = "neutral"


@dataclass(frozen=True)
class ChangeOutcome:
    index: int
    start_s: float
    replica: int
    effect: float  # the true relative goodput change
    truth: Truth
    canary: CanaryDecision  # PROMOTE or ROLLBACK
    canary_s: float  # time to the canary's verdict, from the change
    canary_reason: str
    before_after: CanaryDecision  # plain verify.judge
    controller: CanaryDecision  # verify.judge_at_matched_load on prompt-shift-corrected rates
    controller_reason: str

    def wrong(self, decision: CanaryDecision) -> bool:
        if self.truth is Truth.WORSE:
            return decision is CanaryDecision.PROMOTE
        return decision is CanaryDecision.ROLLBACK


@dataclass(frozen=True)
class _Windows:
    """One replica's collect windows over a change's span."""

    start_s: NDArray[np.float64]
    tokens: NDArray[np.float64]
    batch: NDArray[np.float64]
    tpot_s: NDArray[np.float64]
    spec: list[SpecCounters]


class FleetWorld:
    """The fleet's drift curves and per-replica noise, drawn once from the seed."""

    def __init__(self, scenario: Scenario, settings: FleetSettings, drift: Drift, seed: int) -> None:
        self.engine = SimEngine(scenario)
        self.scenario = scenario
        self.settings = settings
        self.drift = drift
        self.seed = seed
        draft = scenario.start.draft
        if draft is None:
            raise ValueError("fleet mode needs a scenario whose start config speculates ([start] draft)")
        self.config = SimConfig(draft, scenario.start.k)
        self.interval_s = scenario.controller.collect_interval_s
        rng = np.random.default_rng([seed, 101])
        # Three independent smooth curves (load, α, step time): random phases per period, scaled to [−1, 1].
        self._phases = rng.uniform(0.0, 2.0 * math.pi, (3, len(settings.drift_periods_s)))
        self._weights = rng.uniform(0.5, 1.0, (3, len(settings.drift_periods_s)))
        self._bias = 1.0 + settings.replica_bias_sd * rng.standard_normal(settings.replicas)

    def curve(self, which: int, t: NDArray[np.float64]) -> NDArray[np.float64]:
        periods = np.asarray(self.settings.drift_periods_s)
        waves = self._weights[which][:, None] * np.sin(
            2.0 * math.pi * t[None, :] / periods[:, None] + self._phases[which][:, None]
        )
        return waves.sum(axis=0) / self._weights[which].sum()

    def windows(self, replica: int, start_s: float, end_s: float, change_at_s: float, effect: float,
                rng: np.random.Generator) -> _Windows:  # fmt: skip
        """The replica's collect windows over [start_s, end_s); ``effect`` applies from ``change_at_s``."""
        s, d, e = self.settings, self.drift, self.engine
        starts: NDArray[np.float64] = np.arange(start_s, end_s, self.interval_s, dtype=np.float64)
        t: NDArray[np.float64] = starts + self.interval_s / 2.0
        n = len(t)
        conc = s.concurrency_per_replica * (1.0 + d.load_rel * self.curve(0, t))
        conc = np.maximum(conc * (1.0 + s.router_imbalance_sd * rng.standard_normal(n)), 1.0)
        cfg = self.config
        batch = np.minimum(conc, float(e.max_batch(cfg)))
        alpha = (
            e.alpha(str(cfg.draft), t) + d.alpha_abs * self.curve(1, t) + s.replica_alpha_sd * rng.standard_normal(n)
        )
        alpha = np.clip(alpha, 0.0, _MAX_ALPHA)
        ks = cfg.k_at(batch)
        surv = e.survival(cfg, alpha, ks)  # P(accepted ≥ j), j = 0..K
        per_step = surv.sum(axis=1)  # tokens per sequence per step
        factor = np.where(t >= change_at_s, 1.0 + effect, 1.0)
        noise = np.maximum(1.0 + s.replica_noise_sd * rng.standard_normal(n), 0.2)
        step = e.step_time_s(cfg, batch) * (1.0 + d.step_rel * self.curve(2, t)) * self._bias[replica] * noise / factor
        drafts = self.interval_s / step * batch
        tokens = drafts * per_step
        spec = [
            SpecCounters(
                round(drafts[i]), round(drafts[i]) * int(ks[i]), round(drafts[i] * (per_step[i] - 1.0)),
                tuple(round(drafts[i] * surv[i, j]) for j in range(1, int(ks[i]) + 1)), int(ks[i]),
                generated_tokens=round(tokens[i]),
            )
            for i in range(n)
        ]  # fmt: skip
        return _Windows(starts, tokens, batch, step / per_step, spec)


def _minute_samples(
    w: _Windows, from_s: float, to_s: float, sample_s: float, interval_s: float
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(goodput per engine-second, mean TPOT) samples, one per whole ``sample_s`` in [from_s, to_s)."""
    goodput, tpot = [], []
    for m in range(int((to_s - from_s) // sample_s)):
        lo = from_s + m * sample_s
        sel = (w.start_s >= lo) & (w.start_s < lo + sample_s)
        if sel.any():
            goodput.append((lo, float(w.tokens[sel].sum()) / (float(sel.sum()) * interval_s)))
            tpot.append((lo, float(w.tpot_s[sel].mean())))
    return goodput, tpot


def _canary(
    world: FleetWorld, fleet: Sequence[_Windows], replica: int, change_at_s: float
) -> tuple[CanaryDecision, float, str]:
    """Judge every ``sample_s`` until decided; rolled back at ``canary_max_s`` if still undecided."""
    s = world.settings
    samples = [
        _minute_samples(w, change_at_s, change_at_s + s.canary_max_s, s.sample_s, world.interval_s) for w in fleet
    ]
    last = len(samples[replica][0])
    for m in range(s.canary.min_samples, last + 1):
        metric_samples = {}
        for i, spec in enumerate(FLEET_METRICS):
            canary = samples[replica][i][:m]
            baseline = [x for r, rs in enumerate(samples) if r != replica for x in rs[i][:m]]
            metric_samples[spec.name] = MetricSamples(canary, baseline)
        verdict = judge_canary(metric_samples, FLEET_METRICS, s.canary, final=m == last)
        if verdict.decision is not CanaryDecision.UNDECIDED:
            return verdict.decision, m * s.sample_s, verdict.reason
    raise AssertionError("a final canary judgement is always decided")  # pragma: no cover


def _before_after(world: FleetWorld, w: _Windows, change_at_s: float) -> tuple[CanaryDecision, CanaryDecision, str]:
    """(plain judge, the controller's pipeline) on the replica's windows before and after the change."""
    c = world.scenario.controller
    before = (w.start_s >= change_at_s - c.evidence_window_s) & (w.start_s < change_at_s)
    after = (w.start_s >= change_at_s) & (w.start_s < change_at_s + c.verify_window_s)
    rate_b = list(w.tokens[before] / world.interval_s)
    rate_a = list(w.tokens[after] / world.interval_s)
    plain = judge(rate_b, rate_a, tolerance=c.regression_tolerance)
    spec_b = [x for x, keep in zip(w.spec, before, strict=True) if keep]
    spec_a = [x for x, keep in zip(w.spec, after, strict=True) if keep]
    config = world.engine.to_spec(world.config)
    shift, note = prompt_shift(
        config, sum(x.drafts for x in spec_b), float(sum(x.accepted_per_pos[0] for x in spec_b)), config, spec_a
    )
    full = judge_at_matched_load(
        rate_b, list(w.batch[before]), [r / shift for r in rate_a], list(w.batch[after]),
        tolerance=c.regression_tolerance,
    )  # fmt: skip
    as_decision = {True: CanaryDecision.ROLLBACK, False: CanaryDecision.PROMOTE}
    return as_decision[plain.rollback], as_decision[full.rollback], f"{full.message} {note}".strip()


def _effects(settings: FleetSettings, rng: np.random.Generator) -> list[tuple[float, Truth]]:
    """A third better, a third worse, the rest neutral, in a seeded random order."""
    third = settings.changes // 3
    out = [(float(rng.choice(settings.better_effects)), Truth.BETTER) for _ in range(third)]
    out += [(float(rng.choice(settings.worse_effects)), Truth.WORSE) for _ in range(third)]
    out += [(0.0, Truth.NEUTRAL)] * (settings.changes - 2 * third)
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def run_fleet(
    scenario: Scenario, drift: Drift, seed: int, settings: FleetSettings | None = None
) -> list[ChangeOutcome]:
    """Every change of the trial, judged by the canary and by before/after on the same simulated minutes."""
    settings = settings or FleetSettings()
    world = FleetWorld(scenario, settings, drift, seed)
    rng = np.random.default_rng([seed, 102])
    lead_s = scenario.controller.evidence_window_s
    span_s = max(settings.canary_max_s, scenario.controller.verify_window_s)
    outcomes = []
    for i, (effect, truth) in enumerate(_effects(settings, rng)):
        change_at = lead_s + i * settings.change_spacing_s
        replica = int(rng.integers(settings.replicas))
        fleet = [
            world.windows(r, change_at - lead_s, change_at + span_s, change_at, effect if r == replica else 0.0, rng)
            for r in range(settings.replicas)
        ]
        canary, canary_s, canary_reason = _canary(world, fleet, replica, change_at)
        plain, full, full_reason = _before_after(world, fleet[replica], change_at)
        outcomes.append(
            ChangeOutcome(
                i, change_at, replica, effect, truth, canary, canary_s, canary_reason, plain, full, full_reason
            )
        )
    return outcomes


JUDGES = ("canary", "before_after", "controller")
_TIMED_OUT = "time is up"  # policies.canary's reason for a canary still undecided when its time ran out


def summarize(outcomes: Sequence[ChangeOutcome], verify_window_s: float) -> dict[str, Any]:
    """Wrong verdicts per 100 changes (split into wrong promotions and wrong rollbacks) and time to verdict."""
    n = len(outcomes)
    out: dict[str, Any] = {"changes": n}
    for name in JUDGES:
        decisions = [getattr(o, name) for o in outcomes]
        wrong_promote = sum(
            o.truth is Truth.WORSE and d is CanaryDecision.PROMOTE for o, d in zip(outcomes, decisions, strict=True)
        )
        wrong_rollback = sum(o.truth is not Truth.WORSE and d is CanaryDecision.ROLLBACK
                             for o, d in zip(outcomes, decisions, strict=True))  # fmt: skip
        out[name] = {
            "wrong_per_100": 100.0 * (wrong_promote + wrong_rollback) / n if n else 0.0,
            "wrong_promotions": wrong_promote,
            "wrong_rollbacks": wrong_rollback,
        }
    times = [o.canary_s for o in outcomes]
    out["canary"]["verdict_s_mean"] = statistics.fmean(times) if times else None
    out["canary"]["verdict_s_median"] = statistics.median(times) if times else None
    out["canary"]["verdict_s_p90"] = float(np.percentile(times, 90)) if times else None
    out["canary"]["verdict_s_median_by_truth"] = {
        truth.value: statistics.median([o.canary_s for o in outcomes if o.truth is truth])
        for truth in Truth
        if any(o.truth is truth for o in outcomes)
    }
    out["canary"]["timed_out"] = sum(_TIMED_OUT in o.canary_reason for o in outcomes)
    for name in ("before_after", "controller"):  # the controller judges once, when the verify window ends
        out[name].update(
            verdict_s_mean=verify_window_s, verdict_s_median=verify_window_s, verdict_s_p90=verify_window_s
        )
    return out
