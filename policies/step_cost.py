"""Step-time model T(B, K) fitted from (batch size, K, step time) observations.

Purely computational. One verify step at batch B with K speculative tokens costs

    T(B, K) = fixed_s + per_token_s·max(B·(K + 1) − free_tokens, 0) + K·(draft_fixed_s + draft_per_seq_s·B)

The target scores B·(K + 1) tokens in one forward pass (a fixed part plus a per-token part); the draft
runs K sequential forward passes over B sequences. ``free_tokens`` is the roofline's knee: a pass bound by
reading the weights costs the same for the first few tokens it scores and only grows once they fill the
compute (the gpu-like lab's CPU engine: flat ~40 ms up to 4-6 tokens, then ~3.6 ms a token; a GPU's knee
lies at tens to hundreds of tokens). A straight line through such an engine's steps underprices verifying K
more tokens once the batch is past the knee — exactly where the choice between K = 2 and K = 0 is made — so
the fit looks for a knee (:func:`fit_step_cost`); 0 is the straight line.

In an engine that loaded a draft model (draft_model, EAGLE, MTP) a step with K = 0 still runs one draft
pass: vLLM's proposer runs its first forward over the verified tokens to keep the draft's KV cache in sync
and only then returns no drafts
(``vllm/v1/spec_decode/llm_base_proposer.py``, "Dynamic SD decided K=0"). Such a model has
``draft_pass_at_k0`` set and counts max(K, 1) draft passes; :meth:`StepCostModel.plain_step_time_s` is
then the step of an engine without a draft (speculation off), the baseline of every speedup. The
spectuner plugin can skip that pass in decode-only steps (``k0_skip_output_tokens`` > 0, the requests'
mean output tokens): a closed loop of B sequences making one token a step starts B / that many requests a
step, so a share 1 − exp(−B / k0_skip_output_tokens) of the K = 0 steps takes a prompt and keeps the pass.

A prompt lookup (ngram, suffix) differs in two ways (``lookup_proposer``). One lookup per sequence drafts
all K tokens (vLLM's n-gram proposer matches once per request per step), so a step at K ≥ 1 costs one
proposer pass, not K. And it drafts only where the lookup finds a match; at the other steps a sequence
verifies its one token alone: with ``proposal_share`` s (the share of a sequence's verify steps that carry
drafts) the target scores B·(1 + s·K) tokens a step on average; s = 1 (a draft model, which always
drafts) is the formula above.

All four parameters are ≥ 0, so the fit is a bounded linear least-squares problem
(``scipy.optimize.nnls``). The draft/target cost ratio at batch B is
c(B) = (draft_fixed_s + draft_per_seq_s·B) / (fixed_s + per_token_s·B), Leviathan's c at B = 1.

The tuner supplies the arrays (from per-step records, from windows as mean step time weighted by the
number of steps, and from a calibration sweep); this module never touches the store.

A linear T(B, K) cannot follow an engine's quirks (the lab's CPU engine decodes 4 sequences without drafts
at 3× the cost of 1). :func:`with_measured_cells` therefore lays this engine's measured mean step times,
per batch-size band and K, over the model: measured where measured, the model elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from statistics import NormalDist
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, stats

from policies.speedup import check_cost_ratio

PARAMETER_NAMES = ("fixed_s", "per_token_s", "draft_fixed_s", "draft_per_seq_s")


@dataclass(frozen=True)
class StepCostModel:
    """T(B, K) in seconds (or in any consistent unit when built from a cost ratio).

    ``covariance`` is the 4×4 parameter covariance of a fit (None for a model given by hand); it
    gives the prediction interval of :meth:`step_time_interval_s`. ``draft_pass_at_k0``: the engine
    loaded a draft model, so its K = 0 steps run one draft pass (see the module docstring).
    """

    fixed_s: float
    per_token_s: float
    draft_fixed_s: float
    draft_per_seq_s: float
    covariance: tuple[tuple[float, ...], ...] | None = None
    residual_std_s: float | None = None
    draft_pass_at_k0: bool = False
    # True: a fit whose steps ran one K at one batch size, which cannot tell the per-token cost of
    # verification from the fixed cost: per_token_s is 0 by assumption. That overrates larger K, so the K
    # policy moves up at most half-way to the K it predicts best (choose_k_over_load's ``per_token_assumed``)
    # and the new K's steps measure it. Leviathan's model from a cost ratio assumes the same by configuration
    # (no steps to measure it: the plugin is not running) and is not flagged.
    per_token_assumed: bool = False
    # Share of a sequence's verify steps that carry drafts (see the module doc); 1 for a draft model.
    proposal_share: float = 1.0
    # The proposer is a lookup (ngram, suffix): one pass a step drafts all K tokens (see the module doc).
    lookup_proposer: bool = False
    # > 0: K = 0 steps skip the draft's pass unless a prompt enters (the plugin's skip; the module doc), the
    # requests making this many output tokens on average. Only without ``draft_pass_at_k0``.
    k0_skip_output_tokens: float = 0.0
    # Tokens a target pass scores at its fixed cost before per_token_s applies (the module doc); 0: linear.
    free_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in PARAMETER_NAMES:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"step-cost parameter {name} must be a finite number ≥ 0 but got {value!r}")
        if self.fixed_s + self.per_token_s <= 0.0:
            raise ValueError("a target step must cost something: fixed_s + per_token_s must be > 0")
        if not (math.isfinite(self.proposal_share) and 0.0 < self.proposal_share <= 1.0):
            raise ValueError(f"proposal_share must be in (0, 1] but got {self.proposal_share!r}")
        if not (math.isfinite(self.k0_skip_output_tokens) and self.k0_skip_output_tokens >= 0.0):
            raise ValueError(f"k0_skip_output_tokens must be finite and ≥ 0 but got {self.k0_skip_output_tokens!r}")
        if not (math.isfinite(self.free_tokens) and self.free_tokens >= 0.0):
            raise ValueError(f"free_tokens must be finite and ≥ 0 but got {self.free_tokens!r}")

    @classmethod
    def from_cost_ratio(cls, cost_ratio: float, target_step_s: float = 1.0, per_token_s: float = 0.0) -> StepCostModel:
        """Leviathan's model: a draft pass costs c × a target pass at every batch size.

        ``per_token_s`` (default 0: memory-bound, verifying K+1 tokens costs as much as 1) makes the
        target's cost grow with the tokens it scores, which is what makes speculation lose at large B.
        """
        check_cost_ratio(cost_ratio)
        if not (math.isfinite(target_step_s) and target_step_s > 0):
            raise ValueError(f"target step time must be > 0 but got {target_step_s!r}")
        if not (math.isfinite(per_token_s) and per_token_s >= 0):
            raise ValueError(f"per-token cost must be ≥ 0 but got {per_token_s!r}")
        return cls(
            fixed_s=target_step_s,
            per_token_s=per_token_s,
            draft_fixed_s=cost_ratio * target_step_s,
            draft_per_seq_s=cost_ratio * per_token_s,
        )

    def with_draft_ratio(self, cost_ratio: float) -> StepCostModel:
        """This target's linear model with another draft beside it: the draft's pass ``cost_ratio`` × the
        target's (a candidate that does not run has no steps of its own)."""
        return StepCostModel(
            fixed_s=self.fixed_s,
            per_token_s=self.per_token_s,
            draft_fixed_s=cost_ratio * self.fixed_s,
            draft_per_seq_s=cost_ratio * self.per_token_s,
            free_tokens=self.free_tokens,
        )

    def with_draft_cost(self, draft_fixed_s: float, draft_per_seq_s: float) -> StepCostModel:
        """This target's linear model with a draft whose pass was measured on its own: ``draft_fixed_s``
        per pass plus ``draft_per_seq_s`` per sequence in the batch (a host-side proposer such as ngram
        costs a fixed amount and almost nothing per sequence, which no ratio of the target's pass says)."""
        return StepCostModel(
            fixed_s=self.fixed_s,
            per_token_s=self.per_token_s,
            draft_fixed_s=draft_fixed_s,
            draft_per_seq_s=draft_per_seq_s,
            free_tokens=self.free_tokens,
        )

    @property
    def parameters(self) -> NDArray[np.float64]:
        return np.array([self.fixed_s, self.per_token_s, self.draft_fixed_s, self.draft_per_seq_s])

    def is_measured(self, batch_size: float, k: int) -> bool:
        """True where T(B, K) is a measured mean, not the model's prediction (see MeasuredStepCost)."""
        return False

    def linear(self) -> StepCostModel:
        """The linear model alone (a MeasuredStepCost's cells belong to one engine and its draft)."""
        return self

    def with_draft_pass_at_k0(self, on: bool) -> StepCostModel:
        """This model for an engine that does (``on``) or does not load a draft model. A
        MeasuredStepCost's cells were measured under one of the two: switching drops them."""
        return self if self.draft_pass_at_k0 == on else replace(self.linear(), draft_pass_at_k0=on)

    def with_k0_skip(self, output_tokens: float) -> StepCostModel:
        """This model for an engine whose plugin skips the draft's pass in decode-only K = 0 steps, requests
        making ``output_tokens`` on average (0: no skip). Keeps measured cells (measured on this engine)."""
        if self.k0_skip_output_tokens == output_tokens:
            return self
        return replace(self, k0_skip_output_tokens=float(output_tokens))

    def draft_passes(self, k: int) -> int:
        """Draft forward passes of one step at K: K, or 1 at K = 0 when a draft model is loaded; a lookup's
        one pass at any K ≥ 1. (K = 0 under the plugin's skip: :meth:`k0_passes`.)"""
        if self.lookup_proposer:
            return 1 if k > 0 else 0
        return 1 if k == 0 and self.draft_pass_at_k0 else k

    def k0_passes(self, batch_size: float) -> float:
        """Draft passes a K = 0 step at B runs on average: 1 with ``draft_pass_at_k0``; under the plugin's
        skip the share of steps a prompt enters, 1 − exp(−B / k0_skip_output_tokens); else 0."""
        if self.lookup_proposer:
            return 0.0
        if self.draft_pass_at_k0:
            return 1.0
        if self.k0_skip_output_tokens > 0.0:
            return -math.expm1(-batch_size / self.k0_skip_output_tokens)
        return 0.0

    def k0_passes_array(self, batch_size: ArrayLike) -> NDArray[np.float64]:
        """:meth:`k0_passes` for every batch size (what :func:`design_matrix` takes)."""
        b = np.asarray(batch_size, dtype=float)
        if self.lookup_proposer or (not self.draft_pass_at_k0 and self.k0_skip_output_tokens <= 0.0):
            return np.zeros_like(b)
        if self.draft_pass_at_k0:
            return np.ones_like(b)
        return -np.expm1(-b / self.k0_skip_output_tokens)

    def step_time_s(self, batch_size: float, k: int) -> float:
        """Predicted T(B, K) in this engine (K = 0 with its draft pass when ``draft_pass_at_k0``)."""
        # plain float arithmetic: this runs K_max × batch sizes times per decision
        passes = self.draft_passes(k) if k > 0 else self.k0_passes(batch_size)
        return (
            self.fixed_s
            + self.per_token_s * max(batch_size * (1.0 + self.proposal_share * k) - self.free_tokens, 0.0)
            + passes * (self.draft_fixed_s + self.draft_per_seq_s * batch_size)
        )

    def plain_step_time_s(self, batch_size: float) -> float:
        """T(B) of the same target without any draft loaded: speculation off, every speedup's baseline."""
        return self.fixed_s + self.per_token_s * max(batch_size - self.free_tokens, 0.0)

    def design_row(self, batch_size: float, k: int) -> NDArray[np.float64]:
        """The row x with T(B, K) = x · (fixed_s, per_token_s, draft_fixed_s, draft_per_seq_s) in this
        engine (what a fit's covariance is read along); K = 0 here is a step of this engine at K = 0."""
        passes = self.draft_passes(k) if k > 0 else self.k0_passes(batch_size)
        scored = max(batch_size * (1.0 + self.proposal_share * k) - self.free_tokens, 0.0)
        return np.array([1.0, scored, passes, passes * batch_size])

    def step_time_interval_s(self, batch_size: float, k: int, confidence: float = 0.95) -> tuple[float, float]:
        """Interval for the mean step time T(B, K) from the fit's covariance (a point without one)."""
        mean = self.step_time_s(batch_size, k)
        if self.covariance is None:
            return (mean, mean)
        x = self.design_row(batch_size, k)
        sd = math.sqrt(max(float(x @ np.array(self.covariance) @ x), 0.0))
        z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
        return (max(mean - z * sd, 0.0), mean + z * sd)

    def cost_ratio(self, batch_size: float = 1.0) -> float:
        """c(B): one draft forward pass over one target forward pass (one token per sequence)."""
        return (self.draft_fixed_s + self.draft_per_seq_s * batch_size) / StepCostModel.plain_step_time_s(
            self, batch_size
        )

    def to_dict(self) -> dict[str, Any]:
        # proposal_share only where it is not 1: a draft model's dict stays as it always was
        share = {"proposal_share": self.proposal_share} if self.proposal_share < 1.0 else {}
        lookup = {"lookup_proposer": True} if self.lookup_proposer else {}
        skip = {"k0_skip_output_tokens": self.k0_skip_output_tokens} if self.k0_skip_output_tokens > 0.0 else {}
        knee = {"free_tokens": self.free_tokens} if self.free_tokens > 0.0 else {}
        return {
            "fixed_s": self.fixed_s,
            "per_token_s": self.per_token_s,
            "draft_fixed_s": self.draft_fixed_s,
            "draft_per_seq_s": self.draft_per_seq_s,
            "covariance": [list(r) for r in self.covariance] if self.covariance is not None else None,
            "residual_std_s": self.residual_std_s,
            "draft_pass_at_k0": self.draft_pass_at_k0,
            "per_token_assumed": self.per_token_assumed,
            **share,
            **lookup,
            **skip,
            **knee,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCostModel:
        """Inverse of :meth:`to_dict`; a missing or non-numeric parameter is a clear ValueError."""
        values: dict[str, float] = {}
        for name in PARAMETER_NAMES:
            if name not in data:
                raise ValueError(f"step-cost model is missing {name!r}; expected keys {list(PARAMETER_NAMES)}")
            try:
                values[name] = float(data[name])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"step-cost parameter {name} must be a number but got {data[name]!r}") from exc
        cov = data.get("covariance")
        covariance = tuple(tuple(float(v) for v in row) for row in cov) if cov is not None else None
        std = data.get("residual_std_s")
        at_k0 = data.get("draft_pass_at_k0", False)
        if not isinstance(at_k0, bool):
            raise ValueError(f"draft_pass_at_k0 must be true or false but got {at_k0!r}")
        assumed = data.get("per_token_assumed", False)
        if not isinstance(assumed, bool):
            raise ValueError(f"per_token_assumed must be true or false but got {assumed!r}")
        share = data.get("proposal_share", 1.0)
        if isinstance(share, bool) or not isinstance(share, int | float):
            raise ValueError(f"proposal_share must be a number in (0, 1] but got {share!r}")
        lookup = data.get("lookup_proposer", False)
        if not isinstance(lookup, bool):
            raise ValueError(f"lookup_proposer must be true or false but got {lookup!r}")
        skip = data.get("k0_skip_output_tokens", 0.0)
        if isinstance(skip, bool) or not isinstance(skip, int | float):
            raise ValueError(f"k0_skip_output_tokens must be a number ≥ 0 but got {skip!r}")
        free = data.get("free_tokens", 0.0)
        if isinstance(free, bool) or not isinstance(free, int | float):
            raise ValueError(f"free_tokens must be a number ≥ 0 but got {free!r}")
        return cls(
            **values,
            covariance=covariance,
            residual_std_s=float(std) if std is not None else None,
            draft_pass_at_k0=at_k0,
            per_token_assumed=assumed,
            proposal_share=float(share),
            lookup_proposer=lookup,
            k0_skip_output_tokens=float(skip),
            free_tokens=float(free),
        )


class StepCostReason(StrEnum):
    OK = "ok"
    TOO_FEW_OBSERVATIONS = "too_few_observations"
    K_NOT_VARIED = "k_not_varied"
    FIXED_COST_RATIO = "fixed_cost_ratio"  # one K seen: the draft's part taken as c × the target's
    BATCH_NOT_VARIED = "batch_not_varied"
    INVALID_INPUT = "invalid_input"


@dataclass(frozen=True)
class StepCostFit:
    """A fitted model, or None with the reason and what to measure next."""

    model: StepCostModel | None
    reason: StepCostReason
    message: str
    n_observations: int
    cost_ratio: float | None = None
    cost_ratio_ci: tuple[float, float] | None = None


def design_matrix(
    batch_size: NDArray[np.float64],
    k: NDArray[np.float64],
    draft_pass_at_k0: ArrayLike = False,
    free_tokens: float = 0.0,
) -> NDArray[np.float64]:
    """Rows [1, max(B·(K+1) − free_tokens, 0), D, D·B]: T(B, K) = row · (fixed_s, per_token_s, draft_fixed_s,
    draft_per_seq_s), with D = K draft passes, or at K = 0 ``draft_pass_at_k0`` passes (per row, or one for
    all: True is one pass; a share in [0, 1] is the average of an engine that skips it in some steps)."""
    d = np.where(k == 0, np.asarray(draft_pass_at_k0, dtype=float), k)
    scored = np.maximum(batch_size * (k + 1.0) - free_tokens, 0.0)
    return np.column_stack([np.ones_like(batch_size), scored, d, d * batch_size])


def fit_step_cost(
    batch_size: ArrayLike,
    k: ArrayLike,
    step_time_s: ArrayLike,
    weight: ArrayLike | None = None,
    confidence: float = 0.95,
    draft_cost_ratio: float | None = None,
    draft_pass_at_k0: ArrayLike = False,
    find_knee: bool = True,
) -> StepCostFit:
    """Fit T(B, K) by bounded least squares. Purely computational.

    ``draft_pass_at_k0`` (per observation, or one for all) marks K = 0 steps of an engine that loaded a
    draft model: they ran one draft pass. What must vary is then the number of draft passes, max(K, 1):
    K = 0 and K = 1 of such an engine cannot tell the draft's cost from the target's.

    ``weight`` is the number of steps an observation averages (a window's mean step time), default 1.
    Both B and K must vary for the full model: with one B the model is flat in B (said in the
    message); with one K the draft cost cannot be told from the target's, so no model is returned —
    run the calibration sweep (K = 0 and K = K_max) — unless ``draft_cost_ratio`` c is given: the draft's
    pass is then taken as c × the target's (Leviathan) and only the target's two parameters are fitted.

    The knee ``free_tokens`` is profiled (:func:`_knee`): a fit for each knee, the best kept when it beats
    the straight line significantly (an F-test at 5 %, over the observations). Its covariance
    is the other four parameters' at that knee. ``find_knee=False`` fits the straight line.
    """
    b = np.asarray(batch_size, dtype=float).ravel()
    kk = np.asarray(k, dtype=float).ravel()
    y = np.asarray(step_time_s, dtype=float).ravel()
    w = np.ones_like(y) if weight is None else np.asarray(weight, dtype=float).ravel()
    n = y.size
    if not (b.size == kk.size == n == w.size):
        return StepCostFit(
            None,
            StepCostReason.INVALID_INPUT,
            f"batch_size, k, step_time_s and weight must have equal lengths but have "
            f"{b.size}, {kk.size}, {n}, {w.size}.",
            n,
        )
    bad = _invalid_rows(b, kk, y, w)
    if bad:
        return StepCostFit(None, StepCostReason.INVALID_INPUT, bad, n)
    loaded = np.asarray(draft_pass_at_k0, dtype=float).ravel()
    if loaded.size == 1:
        loaded = np.full(n, float(loaded[0]))
    if loaded.size != n:
        return StepCostFit(
            None, StepCostReason.INVALID_INPUT, f"draft_pass_at_k0 has {loaded.size} entries for {n} observations.", n
        )
    x = design_matrix(b, kk, loaded)
    passes = x[:, 2]
    both_varied = np.unique(passes).size >= 2 and np.unique(b).size >= 2
    if draft_cost_ratio is not None and (not both_varied or n < 4):
        # too little variety to separate four parameters: fit the target's two, the draft's as c × them
        return _fit_fixed_ratio(b, kk, y, w, n, float(draft_cost_ratio), passes, free_tokens=None if find_knee else 0.0)
    if n < 3:
        return StepCostFit(None, StepCostReason.TOO_FEW_OBSERVATIONS, f"{n} observations; at least 3 are needed.", n)
    if np.unique(passes).size < 2:
        return StepCostFit(
            None,
            StepCostReason.K_NOT_VARIED,
            f"every observation ran {int(passes[0])} draft pass(es) per step (K = "
            f"{', '.join(str(int(v)) for v in np.unique(kk))}), so the draft's cost cannot be separated from the "
            "target's; run the calibration sweep (K = 0 and K = K_max).",
            n,
        )
    batch_varied = np.unique(b).size >= 2
    if not batch_varied:
        # With one B only the intercept and the slope in K are identifiable: keep them as fixed_s
        # and draft_fixed_s so the model is exact at the observed B and flat in B elsewhere.
        x = x.copy()
        x[:, 1] = 0.0
        x[:, 3] = 0.0
    sw = np.sqrt(w)
    # the knee is judged on relative residuals: step times scatter in proportion to their length, and the
    # knee lives where steps are shortest (absolute residuals are the 64-stream steps' alone)
    free = _knee(b * (kk + 1.0), x, y, sw / y) if batch_varied and find_knee else 0.0
    if free > 0.0:
        x = x.copy()
        x[:, 1] = np.maximum(b * (kk + 1.0) - free, 0.0)
    xw, yw = x * sw[:, None], y * sw
    theta = _nnls(xw, yw)
    if not batch_varied:
        theta[1] = theta[3] = 0.0
    if theta[0] + theta[1] <= 0.0:
        theta[0] = float(np.average(y, weights=w))  # degenerate data: keep the model valid
    resid = yw - xw @ theta
    active = [i for i in range(4) if (batch_varied or i in (0, 2))]
    dof = max(n - len(active), 1)
    sigma2 = float(resid @ resid) / dof
    xa = xw[:, active]
    cov_a = sigma2 * np.linalg.pinv(xa.T @ xa)
    cov = np.zeros((4, 4))
    cov[np.ix_(active, active)] = cov_a
    model = StepCostModel(
        fixed_s=float(theta[0]),
        per_token_s=float(theta[1]),
        draft_fixed_s=float(theta[2]),
        draft_per_seq_s=float(theta[3]),
        covariance=tuple(tuple(float(v) for v in row) for row in cov),
        residual_std_s=math.sqrt(sigma2 / float(np.mean(w))),
        per_token_assumed=not batch_varied,
        free_tokens=free,
    )
    c = model.cost_ratio(1.0)
    c_ci = _cost_ratio_interval(model, cov, confidence)
    if batch_varied:
        knee = f", flat up to {free:.1f} scored tokens a pass" if free > 0.0 else ""
        reason, message = (
            StepCostReason.OK,
            f"T(B, K) fitted from {n} observations{knee}; cost ratio c = {c:.3f} at batch 1.",
        )
    else:
        reason, message = (
            StepCostReason.BATCH_NOT_VARIED,
            f"every observation has batch size {b[0]:g}: the model is exact there and assumed flat in "
            f"B elsewhere; c = {c:.3f}. Measure other batch sizes for a per-batch-size table.",
        )
    if draft_cost_ratio is not None and c_ci[1] - c_ci[0] > max(c, 1e-9):
        # K and B varied together (K follows the load), so the draft's cost is confounded with the
        # target's per-token cost: the given c is the better guess than a c known only to ±50%
        fixed = _fit_fixed_ratio(b, kk, y, w, n, float(draft_cost_ratio), passes, free_tokens=free)
        return replace(
            fixed,
            message=f"{fixed.message} (the full fit's c = {c:.3f}, interval {c_ci[0]:.3f}–{c_ci[1]:.3f}, was too "
            "loose to use)",
        )
    return StepCostFit(model, reason, message, n, c, c_ci)


def _nnls(xw: NDArray[np.float64], yw: NDArray[np.float64]) -> NDArray[np.float64]:
    """Weighted least squares with every parameter ≥ 0: non-negative least squares is exact here and fast
    (refitted every few minutes); scaled so that seconds and milliseconds fit alike."""
    scale = max(float(np.abs(yw).max()), 1e-12)
    sol, _ = optimize.nnls(xw / scale, yw / scale)
    return np.maximum(sol, 0.0)


def _knee(
    scored: NDArray[np.float64],
    x: NDArray[np.float64],
    y: NDArray[np.float64],
    sw: NDArray[np.float64],
    offset: NDArray[np.float64] | None = None,
) -> float:
    """The ``free_tokens`` of the best fit, or 0 (a straight line) when a knee does not earn its parameter.

    The residual sum of squares is profiled over knees at and between the distinct token counts scored
    (``scored`` = B·(K + 1)) and refined around the best; a knee needs two counts below it (one alone is
    the line with another intercept, or a free intercept for that count) and two above (the slope). It is
    kept when it explains significantly more than the line: F = (RSS_line − RSS_knee) / (RSS_knee / (n − p − 1))
    above its 95th percentile on (1, n − p − 1) degrees of freedom, n the observations (the groups, however
    many steps each holds: a refit from a few groups must not bend the line to fit one of them), p the
    columns of ``x`` (its column 1 is the per-token one, max(scored − knee, 0) + ``offset``). ``sw``: the
    square roots of the observations' weights."""
    levels = np.unique(scored)
    n = y.size
    dof = n - x.shape[1] - 1
    if levels.size < 4 or dof <= 0:
        return 0.0
    add = np.zeros_like(y) if offset is None else offset

    def rss(free: float) -> float:
        xf = x.copy()
        xf[:, 1] = np.maximum(scored - free, 0.0) + add
        xw = xf * sw[:, None]
        r = y * sw - xw @ _nnls(xw, y * sw)
        return float(r @ r)

    line = rss(0.0)
    if line <= 1e-12 * float((y * sw) @ (y * sw)):
        return 0.0  # the straight line is exact: nothing for a knee to explain
    low, top = float(levels[1]), float(levels[-2])
    mids = (levels[:-1] + levels[1:]) / 2
    grid = sorted({float(v) for v in np.concatenate([levels, mids]) if low < v < top})
    if not grid:
        return 0.0
    errors = [rss(f) for f in grid]
    i = int(np.argmin(errors))
    lo, hi = (grid[i - 1] if i > 0 else low), (grid[i + 1] if i + 1 < len(grid) else top)
    best = optimize.minimize_scalar(rss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-3})
    free, err = (float(best.x), float(best.fun)) if best.fun < errors[i] else (grid[i], errors[i])
    if err <= 0.0:
        return free
    f_ratio = (line - err) / (err / dof)
    return free if f_ratio > stats.f.ppf(0.95, 1, dof) else 0.0


def fit_target_cost(
    batch_size: ArrayLike,
    k: ArrayLike,
    step_time_s: ArrayLike,
    weight: ArrayLike,
    row_cost_ratio: ArrayLike,
    draft_cost_ratio: float,
    draft_pass_at_k0: ArrayLike = False,
    find_knee: bool = True,
) -> StepCostFit:
    """The target's two parameters from steps under several drafts, each observation's draft pass taken
    as its own draft's ``row_cost_ratio`` × the target's (0 for a step without a draft); the model's
    draft part is ``draft_cost_ratio`` × the target's. Purely computational. The knee is profiled as in
    :func:`fit_step_cost` when the steps span enough batch sizes (``find_knee=False``: a straight line).

    The target's cost is the same whatever draft runs beside it, so steps under other drafts measure it
    too: after a swap the new draft's steps alone (one K, one batch size) cannot tell a per-token cost
    from a fixed one, the steps before the swap can."""
    b = np.asarray(batch_size, dtype=float).ravel()
    kk = np.asarray(k, dtype=float).ravel()
    y = np.asarray(step_time_s, dtype=float).ravel()
    w = np.asarray(weight, dtype=float).ravel()
    cr = np.asarray(row_cost_ratio, dtype=float).ravel()
    n = y.size
    if not (b.size == kk.size == w.size == cr.size == n) or n == 0:
        return StepCostFit(None, StepCostReason.INVALID_INPUT, "observations and cost ratios must align.", n)
    bad = _invalid_rows(b, kk, y, w)
    if bad:
        return StepCostFit(None, StepCostReason.INVALID_INPUT, bad, n)
    if not np.all(np.isfinite(cr) & (cr >= 0)):
        return StepCostFit(None, StepCostReason.INVALID_INPUT, "cost ratios must be finite and ≥ 0.", n)
    passes = design_matrix(b, kk, np.broadcast_to(np.asarray(draft_pass_at_k0, dtype=float), (n,)))[:, 2]
    return _fit_fixed_ratio(b, kk, y, w, n, float(draft_cost_ratio), passes, cr, None if find_knee else 0.0)


def _fit_fixed_ratio(
    b: NDArray[np.float64],
    kk: NDArray[np.float64],
    y: NDArray[np.float64],
    w: NDArray[np.float64],
    n: int,
    c: float,
    passes: NDArray[np.float64],
    row_c: NDArray[np.float64] | None = None,
    free_tokens: float | None = 0.0,
) -> StepCostFit:
    """T(B, K) = fixed_s·(1 + D·c) + per_token_s·(max(B·(K + 1) − free_tokens, 0) + D·c·B) with D draft
    passes (K, or 1 at a loaded K = 0): the draft's part is c × the target's (a draft's pass is taken as
    linear in B, whatever the target's knee). ``free_tokens=None``: profiled (:func:`_knee`, relative
    residuals, an F-test at 5 %) when the observations span enough batch sizes — one K at several batch
    sizes shows the knee as well as a sweep does.

    At one batch size B₀ the per-token cost is still identified when D varies: the slope in D is
    c·T(B₀, 0) + per_token_s·B₀, so given c it measures per_token_s (verifying K more tokens per
    sequence is not free at B₀ = 16). Without it the model is Leviathan's there and over-speculates."""
    check_cost_ratio(c)
    cs = np.full_like(y, c) if row_c is None else row_c
    scored, drafted = b * (kk + 1.0), b * passes * cs
    if free_tokens is None:
        line = np.column_stack([1.0 + passes * cs, scored + drafted])
        free_tokens = _knee(scored, line, y, np.sqrt(w) / y, drafted) if np.unique(b).size >= 2 else 0.0
    x = np.column_stack([1.0 + passes * cs, np.maximum(scored - free_tokens, 0.0) + drafted])
    per_token_seen = bool(np.linalg.matrix_rank(x / np.abs(x).max(axis=0).clip(min=1e-300)) >= 2)
    if not per_token_seen:
        x[:, 1] = 0.0
    sw = np.sqrt(w)
    xw, yw = x * sw[:, None], y * sw
    scale = max(float(np.abs(yw).max()), 1e-12)
    sol_x, _ = optimize.nnls(xw / scale, yw / scale)
    a, p = (max(float(v), 0.0) for v in sol_x)
    if not per_token_seen:
        p = 0.0
    if a + p <= 0.0:
        a = float(np.average(y / (1.0 + passes * cs), weights=w))
    resid = yw - xw @ np.array([a, p])
    active = [0, 1] if per_token_seen else [0]
    sigma2 = float(resid @ resid) / max(n - len(active), 1)
    cov2 = np.zeros((2, 2))
    cov2[np.ix_(active, active)] = sigma2 * np.linalg.pinv(xw[:, active].T @ xw[:, active])
    # (fixed_s, per_token_s, draft_fixed_s, draft_per_seq_s) = J · (a, p) with J = [[1,0],[0,1],[c,0],[0,c]]
    jac = np.array([[1.0, 0.0], [0.0, 1.0], [c, 0.0], [0.0, c]])
    cov = jac @ cov2 @ jac.T
    model = StepCostModel(
        fixed_s=a,
        per_token_s=p,
        draft_fixed_s=c * a,
        draft_per_seq_s=c * p,
        covariance=tuple(tuple(float(v) for v in row) for row in cov),
        residual_std_s=math.sqrt(sigma2 / float(np.mean(w))),
        per_token_assumed=not per_token_seen,
        free_tokens=free_tokens if per_token_seen else 0.0,
    )
    where = (
        ""
        if np.unique(b).size >= 2
        else f", per-token cost from the slope in K at B = {b[0]:g}"
        if per_token_seen
        else f", flat in B (every observation at B = {b[0]:g})"
    )
    seen = ", ".join(str(int(v)) for v in np.unique(kk))
    others = "" if row_c is None else " (steps under other drafts too, each at its own cost ratio)"
    if model.free_tokens > 0.0:
        where += f", flat up to {model.free_tokens:.1f} scored tokens a pass"
    return StepCostFit(
        model,
        StepCostReason.FIXED_COST_RATIO,
        f"target cost fitted from {n} observations{others} at K = {seen}{where}, the draft's taken as c = "
        f"{c:.3f} × the target's; steps at other K and batch sizes would measure c.",
        n,
        c,
        (c, c),
    )


def _invalid_rows(
    b: NDArray[np.float64], k: NDArray[np.float64], y: NDArray[np.float64], w: NDArray[np.float64]
) -> str:
    for name, arr, ok in (
        ("batch_size", b, (b >= 1) & np.isfinite(b)),
        ("k", k, (k >= 0) & np.isfinite(k) & (k == np.round(k))),
        ("step_time_s", y, (y > 0) & np.isfinite(y)),
        ("weight", w, (w > 0) & np.isfinite(w)),
    ):
        if not bool(np.all(ok)):
            i = int(np.argmin(ok))
            return f"{name}[{i}] = {arr[i]!r} is invalid (batch ≥ 1, integer K ≥ 0, step time > 0, weight > 0)."
    return ""


def _cost_ratio_interval(model: StepCostModel, cov: NDArray[np.float64], confidence: float) -> tuple[float, float]:
    """Delta-method interval for c(1) = (d + e) / (a + b)."""
    num = model.draft_fixed_s + model.draft_per_seq_s
    den = model.fixed_s + model.per_token_s
    grad = np.array([-num / den**2, -num / den**2, 1.0 / den, 1.0 / den])
    sd = math.sqrt(max(float(grad @ cov @ grad), 0.0))
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    c = num / den
    return (max(c - z * sd, 0.0), c + z * sd)


def step_times_table(model: StepCostModel, batch_sizes: Sequence[int], k_max: int) -> NDArray[np.float64]:
    """T(B, K) for every listed B (rows) and K = 0..k_max (columns)."""
    if isinstance(model, MeasuredStepCost) and model.cells:
        return np.array([[model.step_time_s(b, k) for k in range(k_max + 1)] for b in batch_sizes], float)
    bb, kk = np.meshgrid(np.asarray(batch_sizes, float), np.arange(k_max + 1, dtype=float), indexing="ij")
    k0 = model.k0_passes_array(bb.ravel())
    return (design_matrix(bb.ravel(), kk.ravel(), k0, model.free_tokens) @ model.parameters).reshape(bb.shape)


# Batch-size bands of measured cells: geometric, 25 % wide (policies.choose_k.load_bins uses the same width),
# so that B = 14 and B = 16 share a cell while B = 1, 2 and 4 do not.
CELL_RATIO = 1.25
# How far a measured cell's factor carries to unmeasured batch sizes (MeasuredStepCost.level): a Gaussian of
# this many bands' standard deviation, 1.25³ ≈ 2× in batch size — B = 16's cells speak for B = 8-32, one
# stream's barely (12 bands away).
LEVEL_BANDWIDTH_BANDS = 3.0


def batch_cell(batch_size: float) -> int:
    """The band index of a batch size: floor(log_1.25 B), B < 1 counted as 1."""
    return math.floor(math.log(max(batch_size, 1.0)) / math.log(CELL_RATIO) + 1e-9)


@dataclass(frozen=True)
class MeasuredCell:
    """Measured steps of one (batch-size band, K): their total time over the model's prediction for them."""

    cell: int
    k: int
    factor: float  # Σ measured step time / Σ model T(B, K) over the cell's steps
    steps: int
    mean_batch_size: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch_from": CELL_RATIO**self.cell,
            "batch_to": CELL_RATIO ** (self.cell + 1),
            "k": self.k,
            "factor": self.factor,
            "steps": self.steps,
            "mean_batch_size": self.mean_batch_size,
        }


@dataclass(frozen=True)
class MeasuredStepCost(StepCostModel):
    """A :class:`StepCostModel` corrected by measured cells: in a (band, K) cell with enough steps,
    T(B, K) = the model's T(B, K) × the cell's measured/predicted factor, so that the measured mean is
    reproduced at the cell's batch sizes and the model's slope within the band is kept. Elsewhere
    T(B, K) = the model's × the level of the cells of the same kind — steps without drafts or with drafts —
    or of all cells when that kind has none: their factors averaged with weights of steps × a Gaussian in
    the distance between batch-size bands (:data:`LEVEL_BANDWIDTH_BANDS`), so the cells measured nearest in
    batch size speak for an unmeasured K there. Why local: a model's error moves with the batch size (7 Dec
    live run: × 1.03–1.05 at one stream, × 0.94 at 16; one level over both priced plain decoding at 16
    streams 6 % high and kept K = 1 where K = 0 made 9 % more). ``scale`` and ``scale_no_draft`` are the
    levels over all cells of each kind (what the policy's messages quote).
    A model pinned from another machine so keeps its shape but takes this engine's level, and an
    unmeasured K does not look cheap merely because the model is (which would make the policy try every
    K in turn). The two kinds have their own level because their costs differ in kind: a K = 0 step is the
    target's forward plus, in an engine with a draft model, the draft's catch-up pass (the lab engine:
    11.4 ms at B = 1, K = 0, against 5.8 ms without a draft); a K > 0 step adds the verification of K
    tokens and K draft passes. The model's ``draft_pass_at_k0`` must be the engine's when the cells are
    measured (:func:`with_measured_cells` computes the factors against it)."""

    cells: tuple[MeasuredCell, ...] = ()
    scale: float = 1.0  # over every cell with drafts (K > 0)
    scale_no_draft: float = 1.0  # over every cell without (K = 0)
    _factors: dict[tuple[int, int], float] = field(default_factory=dict, init=False, repr=False, compare=False)
    # (band, drafting?) → the level there; filled as asked (a K table asks every band for every K)
    _levels: dict[tuple[int, bool], float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_factors", {(c.cell, c.k): c.factor for c in self.cells})
        object.__setattr__(self, "_levels", {})

    def level(self, batch_size: float, k: int) -> float:
        """The factor an unmeasured (band, K) takes: the cells of its kind (else all), weighted by steps
        and by closeness in batch size. With no cells, 1 (the model as it stands)."""
        band, drafting = batch_cell(batch_size), k > 0
        cached = self._levels.get((band, drafting))
        if cached is not None:
            return cached
        kind = [c for c in self.cells if (c.k > 0) == drafting] or list(self.cells)
        if not kind:
            value = 1.0
        else:
            nearest = min(abs(c.cell - band) for c in kind)
            # distances taken from the nearest cell's, so that far from every cell the weights do not all
            # underflow to 0: there the nearest cells speak, as one level would
            weights = [
                c.steps * math.exp(-0.5 * ((abs(c.cell - band) - nearest) / LEVEL_BANDWIDTH_BANDS) ** 2) for c in kind
            ]
            value = sum(w * c.factor for w, c in zip(weights, kind, strict=True)) / sum(weights)
        self._levels[(band, drafting)] = value
        return value

    def is_measured(self, batch_size: float, k: int) -> bool:
        return (batch_cell(batch_size), k) in self._factors

    def linear(self) -> StepCostModel:
        return StepCostModel(
            self.fixed_s,
            self.per_token_s,
            self.draft_fixed_s,
            self.draft_per_seq_s,
            self.covariance,
            self.residual_std_s,
            self.draft_pass_at_k0,
            self.per_token_assumed,
            self.proposal_share,
            self.lookup_proposer,
            self.k0_skip_output_tokens,
            self.free_tokens,
        )

    def step_time_s(self, batch_size: float, k: int) -> float:
        base = super().step_time_s(batch_size, k)
        factor = self._factors.get((batch_cell(batch_size), k))
        return base * (factor if factor is not None else self.level(batch_size, k))

    def plain_step_time_s(self, batch_size: float) -> float:
        if not self.draft_pass_at_k0 and self.k0_skip_output_tokens <= 0.0:
            return self.step_time_s(batch_size, 0)  # this engine's K = 0 steps are plain decoding
        # No step of this engine ran without its draft. Its K = 0 steps come closest (the target's
        # one-token forward plus the draft's catch-up pass): the model's plain step at their level.
        factor = self._factors.get((batch_cell(batch_size), 0))
        return super().plain_step_time_s(batch_size) * (factor if factor is not None else self.level(batch_size, 0))

    def step_time_interval_s(self, batch_size: float, k: int, confidence: float = 0.95) -> tuple[float, float]:
        mean = self.step_time_s(batch_size, k)
        if self.is_measured(batch_size, k):
            return (mean, mean)
        _, hi = super().step_time_interval_s(batch_size, k, confidence)
        # the fit's spread at the model's scale, taken to this engine's level like the mean
        half = (hi - mean) * self.level(batch_size, k)
        return (max(mean - half, 0.0), mean + half)

    def to_dict(self) -> dict[str, Any]:
        return {
            **super().to_dict(),
            "scale": self.scale,
            "scale_no_draft": self.scale_no_draft,
            "measured_cells": [c.to_dict() for c in self.cells],
        }


def with_measured_cells(
    model: StepCostModel,
    batch_size: ArrayLike,
    k: ArrayLike,
    step_time_s: ArrayLike,
    steps: ArrayLike,
    min_steps: int,
) -> StepCostModel:
    """``model`` corrected by every (batch-size band, K) cell holding at least ``min_steps`` steps.

    The rows are groups of steps (batch size, K, mean step time in seconds, number of steps), as
    ``Store.step_time_groups`` returns them. ``model`` must be in seconds (fitted or pinned, not a bare
    cost ratio), since a cell's factor is measured seconds over predicted ones. Returns ``model`` itself
    when no cell qualifies.
    """
    if min_steps < 1:
        raise ValueError(f"min_steps must be ≥ 1 but got {min_steps!r}")
    b = np.asarray(batch_size, float).ravel()
    kk = np.asarray(k, float).ravel()
    t = np.asarray(step_time_s, float).ravel()
    n = np.asarray(steps, float).ravel()
    if not (b.size == kk.size == t.size == n.size):
        raise ValueError(
            f"batch_size, k, step_time_s and steps differ in length ({b.size}, {kk.size}, {t.size}, {n.size})"
        )
    keep = np.isfinite(b) & np.isfinite(kk) & np.isfinite(t) & np.isfinite(n) & (b >= 1) & (kk >= 0) & (t > 0) & (n > 0)
    b, kk, t, n = b[keep], np.round(kk[keep]), t[keep], n[keep]
    # the linear model's T(B, K), also under a MeasuredStepCost (whose cells are replaced)
    predicted = design_matrix(b, kk, model.k0_passes_array(b), model.free_tokens) @ model.parameters
    totals: dict[tuple[int, int], list[float]] = {}
    for bi, ki, ti, ni, pi in zip(b, kk, t, n, predicted, strict=True):
        acc = totals.setdefault((batch_cell(float(bi)), int(ki)), [0.0, 0.0, 0.0, 0.0])  # Σ n·t, Σ n·T, Σ n, Σ n·B
        acc[0] += float(ni * ti)
        acc[1] += float(ni * pi)
        acc[2] += float(ni)
        acc[3] += float(ni * bi)
    qualified = [(key, acc) for key, acc in sorted(totals.items()) if acc[2] >= min_steps and acc[1] > 0]
    if not qualified:
        return model
    cells = tuple(
        MeasuredCell(cell, kc, float(acc[0] / acc[1]), int(acc[2]), float(acc[3] / acc[2]))
        for (cell, kc), acc in qualified
    )

    def level(rows: list[tuple[tuple[int, int], list[float]]]) -> float | None:
        return sum(acc[0] for _, acc in rows) / sum(acc[1] for _, acc in rows) if rows else None

    overall = level(qualified) or 1.0
    drafting = level([(key, acc) for key, acc in qualified if key[1] > 0])
    plain_steps = level([(key, acc) for key, acc in qualified if key[1] == 0])
    plain = {name: getattr(model, name) for name in PARAMETER_NAMES}
    return MeasuredStepCost(
        **plain,
        covariance=model.covariance,
        residual_std_s=model.residual_std_s,
        draft_pass_at_k0=model.draft_pass_at_k0,
        per_token_assumed=model.per_token_assumed,
        k0_skip_output_tokens=model.k0_skip_output_tokens,
        free_tokens=model.free_tokens,
        cells=cells,
        scale=float(drafting if drafting is not None else overall),
        scale_no_draft=float(plain_steps if plain_steps is not None else overall),
    )
