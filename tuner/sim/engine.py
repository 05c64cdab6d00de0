"""The simulated speculative-decoding engine: what a scenario's engine would emit per collect window.

The model, per window of length Δ at time t (its midpoint):

- batch B = min(concurrency(t), max_num_seqs, the sequences that fit memory with this config);
- step time T(B, K) = a + b·B·(K+1) + K·c·(a + b·B) (``StepCostModel.from_cost_ratio`` with the draft's c)
  + r·L·B (the KV read of B sequences of L context tokens, ``kv_read_s_per_token``), times (1 + cv·z) with z a
  per-window standard normal;
- requests beyond the batch wait (``waiting`` = concurrency − B, what ``vllm:num_requests_waiting`` shows);
- with ``[engine.memory]``: the KV pool holds (pool − draft weights) / (target + draft KV bytes per token)
  tokens (``vllm:cache_config_info`` num_gpu_blocks × block_size, as vLLM sizes it after loading the
  draft; refreshed on every restart), and ``vllm:kv_cache_usage_perc`` = B·(tokens_per_seq + K) / that;
- steps Δ / T; drafts D = round(steps · B) (vLLM counts one draft per sequence per step);
- accepted length per draft n ∈ 0..K with P(n ≥ j) = Π_{i<j} c_i, c_i = α(t)·(1 − decay)^i, drawn as one
  multinomial over the D drafts; a_i = #drafts with n > i; A = Σ a_i; generated tokens G = D + A;
- K = 0: G = steps · B and no spec counters (vLLM has no spec-decode series then).

α(t) is the draft's schedule (or constant α) times the load phase's ``alpha_scale`` plus a per-window
jitter (the prompt mix: ``alpha_jitter_sd``, and ``alpha_request_sd`` over √(requests the window saw)).
Load, jitter and step noise are functions of time drawn once from the scenario's seed, so every policy
sees the same world; only the acceptance draws depend on the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from numpy.typing import ArrayLike, NDArray

from policies.counters import SpecCounters
from policies.memory import FREE_METHODS
from policies.spec_config import OFF as OFF_SPEC
from policies.spec_config import SpecConfig, method_drafts_at_k0
from policies.step_cost import StepCostModel
from tuner.sim.scenario import DraftSection, Scenario

_MAX_ALPHA = 0.999


@dataclass(frozen=True, order=True)
class SimConfig:
    """One speculative config: a draft and K (K_max when a per-batch-size table is given), or
    speculation off (``draft`` None or K = 0). ``table`` rows are vLLM's inclusive [lo, hi, K]."""

    draft: str | None
    k: int
    table: tuple[tuple[int, int, int], ...] | None = None

    @property
    def off(self) -> bool:
        return self.draft is None or self.k == 0

    @property
    def label(self) -> str:
        if self.off:
            return "off"
        if self.table:
            rows = ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in self.table)
            return f"{self.draft}/table[{rows}]"
        return f"{self.draft}/K={self.k}"

    def k_at(self, batch: NDArray[np.float64]) -> NDArray[np.int64]:
        """K in force at each batch size (the table's row for round(B); K beyond the last row: its K)."""
        b = np.maximum(np.rint(batch), 1).astype(np.int64)
        if self.off:
            return np.zeros(b.shape, dtype=np.int64)
        if not self.table:
            return np.full(b.shape, self.k, dtype=np.int64)
        out = np.full(b.shape, self.table[-1][2], dtype=np.int64)
        for lo, hi, k in self.table:
            out[(b >= lo) & (b <= hi)] = k
        return out


OFF = SimConfig(None, 0)


class SimEngine:
    """Closed forms (expected goodput) and seeded window draws for one scenario."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.drafts = {d.name: d for d in scenario.drafts}
        e = scenario.engine
        self.cost = {d.name: _draft_cost(d, e.target_step_s, e.per_token_s, e.free_tokens) for d in scenario.drafts}
        self.target_cost = replace(
            StepCostModel.from_cost_ratio(0.0, e.target_step_s, e.per_token_s), free_tokens=e.free_tokens
        )
        slot = scenario.controller.collect_interval_s
        n_slots = math.ceil(scenario.duration_s / slot) + 2
        self._slot_s = slot
        # Common random numbers: the same prompt-mix jitter and step-time noise for every policy.
        self._jitter = np.random.default_rng([scenario.seed, 2]).standard_normal(n_slots)
        self._step_noise = np.random.default_rng([scenario.seed, 3]).standard_normal(n_slots)
        self._bursts = self._burst_starts()
        phases = scenario.load.phases
        self._phase_ends = np.cumsum([p.duration_s for p in phases]) if phases else np.array([np.inf])
        self._phase_concurrency = np.array([p.concurrency for p in phases] or [0.0])
        self._phase_scale = {d.name: np.array([p.scale_for(d.name) for p in phases] or [1.0]) for d in scenario.drafts}

    # -- configs -------------------------------------------------------------------------------
    def to_spec(self, cfg: SimConfig) -> SpecConfig:
        """The speculative config the controller and store see for ``cfg``."""
        if cfg.off:
            return OFF_SPEC
        d = self.drafts[str(cfg.draft)]
        spec = SpecConfig(d.method, d.path, cfg.k)
        return spec.with_table(cfg.table, cfg.k) if cfg.table else spec

    def from_spec(self, spec: SpecConfig) -> SimConfig | None:
        """The config a speculative config means, or None if no draft of the scenario matches."""
        k = spec.k
        if spec.is_off or k == 0:
            return OFF
        if k is None or k < 0:
            return None
        table = spec.k_table
        if table is not None and any(kk > k for _, _, kk in table):
            return None  # vLLM refuses a table above K
        for d in self.scenario.drafts:
            if d.method == spec.method and d.path == spec.model:
                return SimConfig(d.name, k, table)
        return None

    def all_configs(self, k_max: int | None = None) -> list[SimConfig]:
        """Speculation off plus every draft at K = 1..k_max (the "best fixed in hindsight" search space)."""
        k_max = k_max or self.scenario.controller.k_max
        return [OFF, *(SimConfig(d.name, k) for d in self.scenario.drafts for k in range(1, k_max + 1))]

    # -- load ----------------------------------------------------------------------------------
    def _burst_starts(self) -> NDArray[np.float64]:
        load = self.scenario.load
        if load.kind != "bursty":
            return np.zeros(0)
        rng = np.random.default_rng([self.scenario.seed, 1])
        starts, t = [], 0.0
        while t < self.scenario.duration_s:
            t += float(rng.exponential(load.burst_every_s))
            starts.append(t)
        return np.asarray(starts)

    def _phase(self, t: ArrayLike) -> NDArray[np.int64]:
        idx = np.searchsorted(self._phase_ends, np.asarray(t, dtype=float), side="right")
        return np.minimum(idx, len(self._phase_ends) - 1)

    def concurrency(self, t: ArrayLike) -> NDArray[np.float64]:
        """Requests in the engine at time(s) t (closed-loop load)."""
        tt = np.asarray(t, dtype=float)
        load = self.scenario.load
        if load.kind == "constant":
            return np.full(tt.shape, load.concurrency)
        if load.kind == "diurnal":
            mid = (load.peak_concurrency + load.trough_concurrency) / 2.0
            amp = (load.peak_concurrency - load.trough_concurrency) / 2.0
            return mid + amp * np.cos(2.0 * np.pi * (tt - load.peak_at_s) / load.period_s)
        if load.kind == "bursty":
            i = np.searchsorted(self._bursts, tt, side="right") - 1
            last = np.where(i >= 0, self._bursts[np.maximum(i, 0)], -np.inf) if self._bursts.size else -np.inf
            in_burst = (i >= 0) & (tt < last + load.burst_duration_s)
            return np.where(in_burst, load.burst_concurrency, load.concurrency)
        return self._phase_concurrency[self._phase(tt)]

    def alpha_scale(self, draft: str, t: ArrayLike) -> NDArray[np.float64]:
        tt = np.asarray(t, dtype=float)
        if self.scenario.load.kind != "phases":
            return np.ones(tt.shape)
        return self._phase_scale[draft][self._phase(tt)]

    # -- acceptance ----------------------------------------------------------------------------
    def alpha(
        self, draft: str, t: ArrayLike, jitter: bool = False, requests: NDArray[np.float64] | None = None
    ) -> NDArray[np.float64]:
        """α of ``draft`` at time(s) t: schedule × the load's difficulty (+ the window's jitter, and the
        spread between requests averaged over the ``requests`` each window saw)."""
        d = self.drafts[draft]
        tt = np.asarray(t, dtype=float)
        if d.alpha_schedule is None:
            base = np.full(tt.shape, d.alpha)
        else:
            base = np.interp(tt, [p[0] for p in d.alpha_schedule], [p[1] for p in d.alpha_schedule])
        a = base * self.alpha_scale(draft, tt)
        sd = np.full(tt.shape, d.alpha_jitter_sd)
        if requests is not None and d.alpha_request_sd > 0:
            sd = np.sqrt(sd**2 + d.alpha_request_sd**2 / np.maximum(requests, 1.0))
        if jitter and np.any(sd > 0):
            a = a + sd * self._jitter[self._slot(tt)]
        return np.clip(a, 0.0, _MAX_ALPHA)

    def survival(self, cfg: SimConfig, alpha: NDArray[np.float64], k: NDArray[np.int64]) -> NDArray[np.float64]:
        """P(accepted ≥ j), j = 0..K_max, per window (α, K): 1, c_0, c_0·c_1, ... up to its K, then 0
        (c_i = α·(1 − decay)^i)."""
        d = self.drafts[str(cfg.draft)]
        decay = (1.0 - d.position_decay) ** np.arange(cfg.k)
        cond = alpha[..., None] * decay
        surv = np.concatenate([np.ones((*alpha.shape, 1)), np.cumprod(cond, axis=-1)], axis=-1)
        return np.where(np.arange(cfg.k + 1) <= k[..., None], surv, 0.0)

    def expected_tokens(self, cfg: SimConfig, t: ArrayLike) -> NDArray[np.float64]:
        """E: tokens per sequence per step (1 without speculation) = Σ_j P(accepted ≥ j) at the steps that
        draft; a lookup drafts at ``proposal_share`` of them: 1 + share·(E − 1)."""
        tt = np.asarray(t, dtype=float)
        if cfg.off:
            return np.ones(tt.shape)
        k = cfg.k_at(self.batch(cfg, tt))
        e = self.survival(cfg, self.alpha(str(cfg.draft), tt), k).sum(axis=-1)
        return 1.0 + self.share(cfg) * (e - 1.0)

    def share(self, cfg: SimConfig) -> float:
        """Share of a sequence's steps that carry drafts (``DraftSection.proposal_share``; 1 off)."""
        return 1.0 if cfg.off else self.drafts[str(cfg.draft)].proposal_share

    # -- capacity and cost ---------------------------------------------------------------------
    def max_batch(self, cfg: SimConfig) -> int:
        """Sequences that fit: memory (KV of every sequence plus the draft's weights, KV and K slots)."""
        e = self.scenario.engine
        if e.memory is None:
            return e.max_num_seqs
        m = e.memory
        pool, per_token, slots = m.kv_pool_bytes, m.target_kv_bytes_per_token, m.tokens_per_seq
        if not cfg.off:
            d = self.drafts[str(cfg.draft)]
            pool -= d.weights_bytes
            per_token += d.kv_bytes_per_token
            slots += cfg.k
        return max(0, min(e.max_num_seqs, int(pool // (per_token * slots)) if pool > 0 else 0))

    def kv_tokens(self, cfg: SimConfig) -> float | None:
        """Tokens the KV pool holds with ``cfg`` loaded (None: the scenario models no memory)."""
        m = self.scenario.engine.memory
        if m is None:
            return None
        pool, per_token = m.kv_pool_bytes, m.target_kv_bytes_per_token
        if not cfg.off:
            d = self.drafts[str(cfg.draft)]
            pool -= d.weights_bytes
            per_token += d.kv_bytes_per_token
        return max(pool, 0.0) / per_token

    def cache_config(self, cfg: SimConfig) -> dict[str, str] | None:
        """``vllm:cache_config_info`` labels the engine shows with ``cfg`` loaded (None: no memory model)."""
        tokens = self.kv_tokens(cfg)
        if tokens is None:
            return None
        return {"block_size": str(KV_BLOCK_SIZE), "num_gpu_blocks": str(int(tokens // KV_BLOCK_SIZE))}

    def start_problem(self, cfg: SimConfig) -> str | None:
        """Why ``cfg`` would not start, or None."""
        if cfg.off:
            return None
        for f in self.scenario.engine.failing_configs:
            if (f.draft is None or f.draft == cfg.draft) and (f.k is None or cfg.k in f.k):
                return f"{cfg.label}: the engine failed to start (scenario: failing config)"
        if self.max_batch(cfg) < 1:
            return f"{cfg.label}: out of memory at start (the draft's weights and KV do not fit)"
        return None

    def k0_passes(self, method: str | None, batch: NDArray[np.float64]) -> NDArray[np.float64]:
        """Draft passes a K = 0 step runs on average: 1 for a draft model (vLLM keeps its KV cache whole), 0
        for a lookup or no draft. With the plugin's skip (``skip_draft_pass_at_k0``) only steps with a prompt
        in them keep the pass: a closed loop of B sequences making one token a step each starts B /
        output_tokens requests a step, so a share 1 − exp(−B / output_tokens) of the steps holds one. With
        ``skip_draft_pass_at_k0_prompts`` none does."""
        e = self.scenario.engine
        if not method_drafts_at_k0(method) or e.skip_draft_pass_at_k0_prompts:
            return np.zeros_like(batch)
        if not e.skip_draft_pass_at_k0:
            return np.ones_like(batch)
        # the share the controller prices (policies.step_cost), at the scenario's true answer length
        shares = StepCostModel(1.0, 0.0, 0.0, 0.0, k0_skip_output_tokens=float(self.scenario.load.output_tokens))
        return shares.k0_passes_array(batch)

    def step_time_s(self, cfg: SimConfig, batch: ArrayLike) -> NDArray[np.float64]:
        model = self.target_cost if cfg.off else self.cost[str(cfg.draft)]
        b = np.asarray(batch, dtype=float)
        k = cfg.k_at(b)
        # T(B, K) = fixed + per_token·max(B·(1 + s·K) − free, 0) + D·(draft_fixed + draft_per_seq·B), as
        # StepCostModel (vectorised here): s the proposal share (1 but for a lookup); D = K draft passes, or 1 for
        # a table's K = 0 with a draft model (vLLM keeps the draft's KV cache in sync), or one pass at any
        # K ≥ 1 for a lookup (ngram, suffix: StepCostModel.lookup_proposer)
        method = None if cfg.off else self.drafts[str(cfg.draft)].method
        passes: NDArray[np.float64] = (
            np.where(k > 0, 1.0, 0.0) if method in FREE_METHODS else np.where(k == 0, self.k0_passes(method, b), k)
        )
        return (
            model.fixed_s
            + model.per_token_s * np.maximum(b * (1 + self.share(cfg) * k) - model.free_tokens, 0.0)
            + passes * (model.draft_fixed_s + model.draft_per_seq_s * b)
            + self.kv_read_s_per_seq * b
        )

    @property
    def kv_read_s_per_seq(self) -> float:
        """Attention's KV read per running sequence per target pass: long contexts at high concurrency
        make a step memory-bound in the batch (0 unless the scenario sets ``kv_read_s_per_token``)."""
        e = self.scenario.engine
        return e.kv_read_s_per_token * e.memory.tokens_per_seq if e.memory is not None else 0.0

    def batch(self, cfg: SimConfig, t: ArrayLike) -> NDArray[np.float64]:
        return np.minimum(self.concurrency(t), float(self.max_batch(cfg)))

    def expected_goodput(self, cfg: SimConfig, t: ArrayLike) -> NDArray[np.float64]:
        """Expected generated tokens/s of ``cfg`` at time(s) t (0 if it does not start)."""
        tt = np.asarray(t, dtype=float)
        if self.start_problem(cfg) is not None:
            return np.zeros(tt.shape)
        b = self.batch(cfg, tt)
        return b * self.expected_tokens(cfg, tt) / self.step_time_s(cfg, np.maximum(b, 1e-9))

    # -- windows -------------------------------------------------------------------------------
    def _slot(self, t: NDArray[np.float64]) -> NDArray[np.int64]:
        return np.minimum((t // self._slot_s).astype(np.int64), len(self._jitter) - 1)

    def windows(
        self,
        cfg: SimConfig,
        starts_s: NDArray[np.float64],
        ends_s: NDArray[np.float64],
        rng: np.random.Generator,
        cpu_taken: NDArray[np.float64] | None = None,
    ) -> list[SimWindow]:
        """Draw consecutive collect windows under one config (the deltas the collector would store).
        ``cpu_taken``: per window, the share of the machine's CPU other processes took from a CPU-bound
        engine (the sidecar beside it, ``[engine] sidecar_cpu_share``): its steps take 1 / (1 − share) as long."""
        t = (starts_s + ends_s) / 2.0
        duration = ends_s - starts_s
        conc = self.concurrency(t)
        b = self.batch(cfg, t)
        waiting = np.maximum(conc - b, 0.0)
        kv_tokens, mem = self.kv_tokens(cfg), self.scenario.engine.memory
        slots = 0 if cfg.off else cfg.k
        usage = (
            np.minimum(b * (mem.tokens_per_seq + slots) / kv_tokens, 1.0)
            if kv_tokens and mem is not None
            else np.full(len(t), np.nan)
        )
        cv = self.scenario.engine.step_time_cv
        noise = np.maximum(1.0 + cv * self._step_noise[self._slot(t)], 0.2)
        step_s = self.step_time_s(cfg, np.maximum(b, 1e-9)) * noise
        if cpu_taken is not None:
            step_s = step_s / (1.0 - np.clip(cpu_taken, 0.0, 0.9))
        steps = np.where(b > 0, duration / step_s, 0.0)
        seq_steps = np.rint(steps * b).astype(np.int64)
        if cfg.off:
            return [
                SimWindow(float(s0), float(s1), float(n), None, float(bb), float(w), float(st), 0, _usage(u))
                for s0, s1, n, bb, w, st, u in zip(starts_s, ends_s, seq_steps, b, waiting, step_s, usage, strict=True)
            ]
        # a lookup drafts at a share of the sequences' steps; the others emit their one token undrafted
        share = self.share(cfg)
        drafts = seq_steps if share >= 1.0 else rng.binomial(seq_steps, share).astype(np.int64)
        ks = cfg.k_at(b)
        # the requests a window saw: those running, plus those that finished (at the expected rate); only
        # a draft with a spread between requests needs them (this is the simulator's hot path)
        requests = (
            b + duration * b * self.expected_tokens(cfg, t) / step_s / self.scenario.load.output_tokens
            if self.drafts[str(cfg.draft)].alpha_request_sd > 0
            else None
        )
        survive = self.survival(cfg, self.alpha(str(cfg.draft), t, jitter=True, requests=requests), ks)
        p = np.clip(survive - np.concatenate([survive[:, 1:], np.zeros((len(t), 1))], axis=1), 0.0, 1.0)
        counts = rng.multinomial(drafts, p / p.sum(axis=1, keepdims=True))  # drafts accepting exactly 0..K
        at_least = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1]  # drafts accepting ≥ j, j = 0..K
        out = []
        for i in range(len(t)):
            k = int(ks[i])
            n = int(drafts[i])
            plain = int(seq_steps[i]) - n
            if k == 0:  # a table row with K = 0: plain decoding steps, no drafts
                spec = SpecCounters(0, 0, 0, (), None)
                out.append(
                    SimWindow(
                        float(starts_s[i]),
                        float(ends_s[i]),
                        float(n + plain),
                        spec,
                        float(b[i]),
                        float(waiting[i]),
                        float(step_s[i]),
                        0,
                        _usage(usage[i]),
                    )
                )
                continue
            # Counters at the window's K (as per-step records report it; /metrics alone would show K_max
            # positions and could not tell a short draft from a rejection).
            per_pos = tuple(int(x) for x in at_least[i, 1 : k + 1])
            accepted = sum(per_pos)
            spec = SpecCounters(n, n * k, accepted, per_pos, k, generated_tokens=n + plain + accepted)
            out.append(
                SimWindow(
                    float(starts_s[i]),
                    float(ends_s[i]),
                    float(n + plain + accepted),
                    spec,
                    float(b[i]),
                    float(waiting[i]),
                    float(step_s[i]),
                    k,
                    _usage(usage[i]),
                )
            )
        return out


@dataclass(frozen=True)
class SimWindow:
    start_s: float
    end_s: float
    generation_tokens: float
    spec: SpecCounters | None
    batch: float
    waiting: float
    step_s: float  # the window's step time T(B, K) × noise (what the plugin's per-step records measure)
    k: int  # tokens drafted per sequence per step
    kv_usage: float | None = None  # vllm:kv_cache_usage_perc (0..1); None without a memory model


KV_BLOCK_SIZE = 16  # vLLM's default block size on GPUs (tokens per KV block)


def _usage(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def _draft_cost(d: DraftSection, target_step_s: float, per_token_s: float, free_tokens: float) -> StepCostModel:
    """T(B, K) with this draft: the fitted draft costs when given, else c × the target's pass (at batch 1:
    a ratio of the target's pass at B taken linear in B, as ``from_cost_ratio``)."""
    base = StepCostModel.from_cost_ratio(d.cost_ratio, target_step_s, per_token_s)
    return StepCostModel(
        fixed_s=target_step_s,
        per_token_s=per_token_s,
        draft_fixed_s=base.draft_fixed_s if d.draft_fixed_s is None else d.draft_fixed_s,
        draft_per_seq_s=base.draft_per_seq_s if d.draft_per_seq_s is None else d.draft_per_seq_s,
        free_tokens=free_tokens,
    )
