"""The fleet: many engines (replicas behind one router) read together. Pure: no I/O.

- :func:`group_fleet` groups engines by (target model, draft, config fingerprint) and gives each group
  its pooled α̂. The point estimate is :func:`policies.acceptance.alpha_of_windows` over every window of
  the group (THE α̂ every surface reports). Its interval is honest about the fleet: engines behind one
  router still see different prompts, so acceptance varies more between engines than binomial
  sampling allows; the quasi-binomial dispersion φ (:func:`policies.dispersion.estimate_dispersion`,
  one cell of (S + F trials, S successes) per engine) divides the pooled counts before the Jeffreys
  interval is taken, which widens it by √φ. A one-engine group takes φ across its own windows instead.
- Outliers: an engine whose α̂ is far from the rest of its group (different traffic, or a broken
  draft). The test, per engine e of a group of m ≥ ``min_engines_for_outliers`` engines: the
  quasi-binomial two-proportion z-test of e against the *other* engines pooled,
  z = (α̂_e − α̂_rest) / √(φ_rest · p(1 − p) · (1/n_e + 1/n_rest)), with p the group's pooled α̂ and
  φ_rest the dispersion among the other engines (leave-one-out, so the outlier cannot hide itself by
  inflating φ). Flagged when the two-sided p-value is below ``outlier_significance / m`` (Bonferroni
  over the group) AND |α̂_e − α̂_rest| ≥ ``outlier_min_effect`` (token counts are so large that a
  statistically certain 0.005 difference is still the same draft).
- :func:`fleet_prior`: a hierarchical (beta-binomial, empirical Bayes) prior for a new engine, or for a
  candidate never served on this engine, from the engines of its (target, draft) group. α does not
  depend on K under the model, so every config with that draft counts. Engine α's are taken as draws
  from a population with mean μ and between-engine variance τ², each measured with binomial variance
  v_e = p(1 − p)/n_e. τ² is the DerSimonian–Laird moment estimate, μ the random-effects weighted mean;
  a new engine's α has predictive variance τ² + SE(μ)², matched to a Beta(a, b) by moments. Its
  strength a + b (pseudo-trials) is capped: τ² = 0 ("no heterogeneity detected") must not make a prior
  that outweighs a new engine's own evidence forever. :func:`shrink` updates that prior with an
  engine's own evidence: the shrunken estimate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from scipy import stats

from policies.acceptance import (
    AcceptanceEvidence,
    AlphaEstimate,
    alpha_interval,
    alpha_of_windows,
    effective_counters,
)
from policies.counters import SpecCounters
from policies.dispersion import DispersionEstimate, estimate_dispersion
from policies.positional import PositionData
from policies.spec_config import SpecConfig


@dataclass(frozen=True)
class FleetSettings:
    """How the fleet view judges groups and outliers. Defaults are documented in docs/fleet.md."""

    confidence: float = 0.95
    outlier_significance: float = 0.01  # family-wise, per group (Bonferroni over its engines)
    outlier_min_effect: float = 0.05  # |α̂_e − α̂_rest| below this is never an outlier
    min_engines_for_outliers: int = 3  # with two engines nobody can tell which one is off
    min_engine_trials: float = 100.0  # an engine with fewer checked draft tokens is not judged

    def __post_init__(self) -> None:
        checks = (
            ("confidence", 0.0 < self.confidence < 1.0),
            ("outlier_significance", 0.0 < self.outlier_significance < 1.0),
            ("outlier_min_effect", 0.0 <= self.outlier_min_effect < 1.0),
            ("min_engines_for_outliers", self.min_engines_for_outliers >= 3),
            ("min_engine_trials", self.min_engine_trials >= 0.0 and math.isfinite(self.min_engine_trials)),
        )
        for name, ok in checks:
            if not ok:
                raise ValueError(f"fleet setting {name} = {getattr(self, name)!r} is out of range")


@dataclass(frozen=True)
class EngineWindows:
    """One engine's windows under the config in force: the fleet view's input per engine."""

    engine: str  # the engine's identity (its /metrics URL and engine label, as the store names it)
    target: str  # the target model the engine serves
    config: SpecConfig
    windows: tuple[SpecCounters, ...] = ()


@dataclass(frozen=True)
class GroupKey:
    """(target model, draft, config fingerprint): engines that should accept alike."""

    target: str
    method: str
    draft_model: str | None
    fingerprint: str

    @classmethod
    def of(cls, engine: EngineWindows) -> GroupKey:
        method, model = engine.config.draft
        return cls(engine.target, method, model, engine.config.fingerprint)


@dataclass(frozen=True)
class EngineAlpha:
    """One engine's own α̂ (binomial interval: its windows alone)."""

    engine: str
    estimate: AlphaEstimate

    @property
    def evidence(self) -> AcceptanceEvidence:
        return self.estimate.evidence or AcceptanceEvidence()


class OutlierVerdict(StrEnum):
    OUTLIER = "outlier"
    IN_LINE = "in_line"
    NOT_JUDGED = "not_judged"  # too few engines in the group, or too little evidence


@dataclass(frozen=True)
class OutlierCheck:
    """The outlier test of one engine against the rest of its group."""

    engine: str
    verdict: OutlierVerdict
    alpha: float | None
    rest_alpha: float | None
    z: float | None
    p_value: float | None
    threshold: float | None  # the Bonferroni-corrected significance the p-value is held to
    reason: str


@dataclass(frozen=True)
class FleetGroup:
    """A group's pooled α̂, its honest interval, its engines and their outlier checks."""

    key: GroupKey
    config: SpecConfig
    engines: tuple[EngineAlpha, ...]
    pooled: AlphaEstimate
    alpha_ci: tuple[float, float] | None  # widened by √φ (pooled.alpha_ci is the binomial one)
    dispersion: DispersionEstimate
    checks: tuple[OutlierCheck, ...]
    message: str

    @property
    def alpha(self) -> float | None:
        return self.pooled.alpha

    @property
    def outliers(self) -> tuple[OutlierCheck, ...]:
        return tuple(c for c in self.checks if c.verdict is OutlierVerdict.OUTLIER)


def _position_data(windows: Sequence[SpecCounters]) -> PositionData:
    """Per-position trials of an engine's windows, each read at the K it drafted (as α̂ is)."""
    return PositionData.from_windows(e for e in (effective_counters(w) for w in windows) if e is not None)


def _alpha_cell(evidence: AcceptanceEvidence) -> PositionData:
    """One engine as one quasi-binomial cell: S + F trials, S successes."""
    return PositionData((evidence.trials,), (evidence.successes,))


def _widened(evidence: AcceptanceEvidence | None, phi: float, confidence: float) -> tuple[float, float] | None:
    if evidence is None or evidence.trials <= 0:
        return None
    return alpha_interval(evidence.scaled(1.0 / phi), confidence)


def group_fleet(engines: Sequence[EngineWindows], settings: FleetSettings | None = None) -> tuple[FleetGroup, ...]:
    """The fleet's groups, largest first (then by target, draft, fingerprint for a stable order)."""
    settings = settings or FleetSettings()
    by_key: dict[GroupKey, list[EngineWindows]] = {}
    for e in engines:
        by_key.setdefault(GroupKey.of(e), []).append(e)
    groups = [_group(key, members, settings) for key, members in by_key.items()]
    groups.sort(key=lambda g: (-len(g.engines), g.key.target, g.key.method, g.key.draft_model or "", g.key.fingerprint))
    return tuple(groups)


def _group(key: GroupKey, members: list[EngineWindows], settings: FleetSettings) -> FleetGroup:
    confidence = settings.confidence
    alphas = tuple(EngineAlpha(m.engine, alpha_of_windows(m.windows, confidence)) for m in members)
    pooled = alpha_of_windows([w for m in members for w in m.windows], confidence)
    with_evidence = [a for a in alphas if a.evidence.trials > 0]
    if len(with_evidence) >= 2:
        dispersion = estimate_dispersion([_alpha_cell(a.evidence) for a in with_evidence])
        across = f"between its {len(with_evidence)} engines"
    else:
        # one engine: the variation between its own windows is the only over-dispersion to see
        windows = [w for m, a in zip(members, alphas, strict=True) if a.evidence.trials > 0 for w in m.windows]
        dispersion = estimate_dispersion([_position_data([w]) for w in windows])
        across = "between the windows of its one engine"
    ci = _widened(pooled.evidence, dispersion.dispersion, confidence)
    checks = tuple(_outlier_check(a, alphas, pooled, settings) for a in alphas)
    if pooled.alpha is None or ci is None:
        message = f"{len(members)} engine(s), no acceptance evidence yet ({pooled.reason.value})."
    else:
        flagged = sum(c.verdict is OutlierVerdict.OUTLIER for c in checks)
        message = (
            f"pooled α̂ = {pooled.alpha:.3f} ({confidence:.0%} interval {ci[0]:.3f}–{ci[1]:.3f}, widened by "
            f"√φ = {math.sqrt(dispersion.dispersion):.2f} for the variation {across}) from {len(members)} "
            f"engine(s); {flagged} outlier(s)."
        )
    return FleetGroup(key, members[0].config, alphas, pooled, ci, dispersion, checks, message)


def _outlier_check(
    engine: EngineAlpha, alphas: Sequence[EngineAlpha], pooled: AlphaEstimate, settings: FleetSettings
) -> OutlierCheck:
    own = engine.evidence
    rest_engines = [a for a in alphas if a is not engine and a.evidence.trials > 0]
    judged = [a for a in alphas if a.evidence.trials > 0]
    alpha = own.successes / own.trials if own.trials > 0 else None

    def not_judged(reason: str, rest_alpha: float | None = None) -> OutlierCheck:
        return OutlierCheck(engine.engine, OutlierVerdict.NOT_JUDGED, alpha, rest_alpha, None, None, None, reason)

    if len(judged) < settings.min_engines_for_outliers:
        return not_judged(
            f"{len(judged)} engine(s) with evidence in the group; outliers need "
            f"{settings.min_engines_for_outliers} (with two, nobody can tell which one is off)."
        )
    if own.trials < settings.min_engine_trials:
        return not_judged(f"{own.trials:.0f} checked draft tokens, fewer than {settings.min_engine_trials:.0f}.")
    rest = AcceptanceEvidence()
    for a in rest_engines:
        rest = rest + a.evidence
    rest_alpha = rest.successes / rest.trials
    p = pooled.alpha if pooled.alpha is not None else rest_alpha
    phi_rest = estimate_dispersion([_alpha_cell(a.evidence) for a in rest_engines]).dispersion
    assert alpha is not None  # own.trials ≥ min_engine_trials ≥ 0 and > 0 by `judged`
    variance = phi_rest * p * (1.0 - p) * (1.0 / own.trials + 1.0 / rest.trials)
    effect = alpha - rest_alpha
    # variance 0: every engine accepts all or nothing, so any difference is total
    total = 0.0 if effect == 0 else math.copysign(math.inf, effect)
    z = effect / math.sqrt(variance) if variance > 0 else total
    p_value = float(2.0 * stats.norm.sf(abs(z)))
    threshold = settings.outlier_significance / len(judged)
    far = abs(effect) >= settings.outlier_min_effect
    significant = p_value < threshold
    verdict = OutlierVerdict.OUTLIER if far and significant else OutlierVerdict.IN_LINE
    how = "above" if effect > 0 else "below"
    if verdict is OutlierVerdict.OUTLIER:
        reason = (
            f"α̂ = {alpha:.3f} is {abs(effect):.3f} {how} the other {len(rest_engines)} engines' {rest_alpha:.3f} "
            f"(z = {z:.1f}, p = {p_value:.2g} < {threshold:.2g}, φ = {phi_rest:.2f}): different traffic or a "
            "broken draft."
        )
    elif not significant:
        reason = f"α̂ = {alpha:.3f} vs the others' {rest_alpha:.3f}: p = {p_value:.2g} ≥ {threshold:.2g}."
    else:
        reason = (
            f"α̂ = {alpha:.3f} vs the others' {rest_alpha:.3f}: a real but small difference "
            f"(< {settings.outlier_min_effect:.2f})."
        )
    return OutlierCheck(engine.engine, verdict, alpha, rest_alpha, z, p_value, threshold, reason)


# -- hierarchical prior ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PriorSettings:
    """How strongly the fleet may speak for an engine that has not spoken yet."""

    max_strength_trials: float = 200.0  # cap on a + b: a new engine's own ~200 tokens outweigh the fleet
    min_strength_trials: float = 2.0  # floor on a + b (Beta(μ·2, (1−μ)·2) is nearly flat)
    single_engine_strength_trials: float = 10.0  # one engine says nothing about τ²: a weak prior


class PriorReason(StrEnum):
    POOLED = "pooled"  # ≥ 2 engines: mean and between-engine variance estimated
    SINGLE_ENGINE = "single_engine"  # one engine: its α̂ with a weak, fixed strength
    NO_EVIDENCE = "no_evidence"  # nothing in the fleet: the caller keeps its own prior


@dataclass(frozen=True)
class FleetPrior:
    """Beta(a, b) for α of a new engine or unseen candidate of (target, method, draft model)."""

    target: str
    method: str
    draft_model: str | None
    reason: PriorReason
    message: str
    a: float | None = None
    b: float | None = None
    engines: int = 0
    between_engine_sd: float | None = None  # τ
    engine_names: tuple[str, ...] = field(default=(), compare=False)

    @property
    def mean(self) -> float | None:
        return None if self.a is None or self.b is None else self.a / (self.a + self.b)

    @property
    def strength_trials(self) -> float | None:
        """a + b: how many checked draft tokens the prior is worth."""
        return None if self.a is None or self.b is None else self.a + self.b

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "method": self.method,
            "draft_model": self.draft_model,
            "reason": self.reason.value,
            "message": self.message,
            "alpha": self.mean,
            "a": self.a,
            "b": self.b,
            "strength_trials": self.strength_trials,
            "engines": self.engines,
            "between_engine_sd": self.between_engine_sd,
        }


def fleet_prior(
    engines: Sequence[EngineWindows],
    target: str,
    draft: tuple[str, str | None],
    settings: PriorSettings | None = None,
    exclude: str | None = None,
) -> FleetPrior:
    """The hierarchical prior for α of ``draft`` on ``target`` (``exclude``: the engine asking, whose
    own evidence must not be counted twice)."""
    method, model = draft
    evidence: dict[str, AcceptanceEvidence] = {}
    for e in engines:
        if e.target == target and e.config.draft == (method, model) and e.engine != exclude:
            ev = alpha_of_windows(e.windows).evidence
            if ev is not None:
                evidence[e.engine] = evidence[e.engine] + ev if e.engine in evidence else ev
    return prior_from_evidence(target, draft, evidence, settings)


def prior_from_evidence(
    target: str,
    draft: tuple[str, str | None],
    evidence: Mapping[str, AcceptanceEvidence],
    settings: PriorSettings | None = None,
) -> FleetPrior:
    """:func:`fleet_prior` from each engine's summed α evidence of that draft (engine name → evidence)."""
    settings = settings or PriorSettings()
    method, model = draft
    used = [(name, ev) for name, ev in evidence.items() if ev.trials > 0]
    what = f"{method}" + (f" {model}" if model else "") + f" on {target}"
    if not used:
        return FleetPrior(target, method, model, PriorReason.NO_EVIDENCE, f"no engine in the fleet serves {what} yet.")
    names = tuple(name for name, _ in used)
    if len(used) == 1:
        ev = used[0][1]
        mu = _clip(ev.successes / ev.trials)
        strength = settings.single_engine_strength_trials
        return FleetPrior(
            target,
            method,
            model,
            PriorReason.SINGLE_ENGINE,
            f"one engine serves {what}: its α̂ = {mu:.3f} as the prior mean, worth only {strength:g} tokens "
            "(one engine cannot show how much engines differ).",
            a=mu * strength,
            b=(1.0 - mu) * strength,
            engines=1,
            engine_names=names,
        )
    mu, tau2, se2 = _random_effects([ev for _, ev in used])
    mu = _clip(mu)
    predictive = tau2 + se2
    raw = mu * (1.0 - mu) / predictive - 1.0 if predictive > 0 else math.inf
    strength = min(settings.max_strength_trials, max(settings.min_strength_trials, raw))
    capped = " (capped)" if raw > settings.max_strength_trials else ""
    return FleetPrior(
        target,
        method,
        model,
        PriorReason.POOLED,
        f"{len(used)} engines serve {what}: α ~ Beta(mean {mu:.3f}, worth {strength:.0f} tokens{capped}); "
        f"engines differ by τ = {math.sqrt(tau2):.3f} around the fleet mean.",
        a=mu * strength,
        b=(1.0 - mu) * strength,
        engines=len(used),
        between_engine_sd=math.sqrt(tau2),
        engine_names=names,
    )


def _clip(mu: float) -> float:
    """Keep the prior mean inside (0, 1): a Beta with a or b = 0 is improper."""
    eps = 1e-3
    return min(1.0 - eps, max(eps, mu))


def _random_effects(evidence: Sequence[AcceptanceEvidence]) -> tuple[float, float, float]:
    """(μ, τ², SE(μ)²) by DerSimonian–Laird on the α scale, binomial within-engine variances."""
    n = [ev.trials for ev in evidence]
    x = [ev.successes / ev.trials for ev in evidence]
    p = sum(ev.successes for ev in evidence) / sum(n)
    pq = max(p * (1.0 - p), 1e-9)  # all-or-nothing acceptance everywhere still has a finite variance
    v = [pq / ni for ni in n]
    w = [1.0 / vi for vi in v]
    sw = sum(w)
    fixed = sum(wi * xi for wi, xi in zip(w, x, strict=True)) / sw
    q = sum(wi * (xi - fixed) ** 2 for wi, xi in zip(w, x, strict=True))
    denom = sw - sum(wi * wi for wi in w) / sw
    tau2 = max(0.0, (q - (len(x) - 1)) / denom) if denom > 0 else 0.0
    w_star = [1.0 / (vi + tau2) for vi in v]
    mu = sum(wi * xi for wi, xi in zip(w_star, x, strict=True)) / sum(w_star)
    return mu, tau2, 1.0 / sum(w_star)


@dataclass(frozen=True)
class ShrunkAlpha:
    """An engine's α after its own evidence updated the fleet prior."""

    alpha: float
    alpha_ci: tuple[float, float]
    prior_weight: float  # share of the estimate that is the fleet's: (a + b) / (a + b + n)


def shrink(prior: FleetPrior, evidence: AcceptanceEvidence, confidence: float = 0.95) -> ShrunkAlpha | None:
    """Beta(a + S, b + F): the engine's α shrunk toward its group (None when the prior has no Beta)."""
    if prior.a is None or prior.b is None:
        return None
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1 but got {confidence!r}")
    a, b = prior.a + evidence.successes, prior.b + evidence.failures
    tail = (1.0 - confidence) / 2.0
    ci = (float(stats.beta.ppf(tail, a, b)), float(stats.beta.ppf(1.0 - tail, a, b)))
    return ShrunkAlpha(a / (a + b), ci, (prior.a + prior.b) / (a + b))
