"""A simulator scenario: the TOML file format under ``bench/scenarios/`` (documented in its README).

pydantic 2 models, unknown keys refused; every problem is reported at once as
``key: what is wrong — what to do`` (the same convention as the daemon's config). Units are in the
key names: ``_s`` seconds, ``_bytes`` bytes.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tuner.config import GuardrailsSection


class ScenarioError(ValueError):
    """The scenario file cannot be used. ``problems`` holds one ``key: message`` line per problem."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        if len(problems) == 1:  # one line, as every CLI error
            super().__init__(f"scenario {path}: {problems[0]}")
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"scenario {path} has {len(problems)} problems:\n{lines}")

    def one_line(self) -> str:
        """The problems on one line (the CLI's error line)."""
        return f"scenario {self.path}: " + "; ".join(self.problems)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemorySection(_Section):
    """Accelerator memory left after the target's weights: KV cache for every sequence plus the draft."""

    kv_pool_bytes: float = Field(gt=0, description="bytes for KV cache and draft weights")
    target_kv_bytes_per_token: float = Field(gt=0)
    tokens_per_seq: int = Field(gt=0, description="context each running sequence holds (mean)")


class FailingConfig(_Section):
    """Configs that do not start (a broken draft path, a build that rejects the K...)."""

    draft: str | None = Field(default=None, description="draft name; None: any draft")
    k: list[int] | None = Field(default=None, description="these K only; None: any K")


class EngineSection(_Section):
    """The target's step cost T(B, K) = target_step_s + per_token_s·max(B·(K+1) − free_tokens, 0) + K·(draft
    pass at B)."""

    target_step_s: float = Field(gt=0, description="fixed part of one target forward pass")
    per_token_s: float = Field(default=0.0, ge=0, description="target cost per scored token")
    free_tokens: float = Field(
        default=0.0,
        ge=0,
        description="scored tokens a target pass takes at its fixed cost before per_token_s applies (a pass "
        "bound by reading the weights until the batch fills the compute: the roofline's flat part)",
    )
    restart_downtime_s: float = Field(default=60.0, ge=0, description="serving gap of a config change")
    start_failure_s: float = Field(
        default=0.0, ge=0, description="extra serving gap when a config fails and the old one is restarted"
    )
    max_num_seqs: int = Field(default=256, ge=1, description="vLLM --max-num-seqs")
    live_k_max: int = Field(
        default=0,
        ge=0,
        le=16,
        description="K_max the engine runs for live K tables (the spectuner plugin, docs/controller.md): a change "
        "that keeps the draft and needs no K above it costs no downtime; 0: every change restarts",
    )
    kv_read_s_per_token: float = Field(
        default=0.0,
        ge=0,
        description="target step time per context token read per running sequence (attention's KV read): "
        "adds kv_read_s_per_token·B·memory.tokens_per_seq to every step; needs [engine.memory]",
    )
    step_time_cv: float = Field(default=0.02, ge=0, lt=1, description="per-window noise on the step time")
    skip_draft_pass_at_k0: bool = Field(
        default=False,
        description="the spectuner plugin skips a draft model's pass in decode-only K = 0 steps ([plugin] "
        "skip_draft_pass_at_k0): a table's K = 0 costs the target plus the pass in the share of steps a prompt "
        "enters (the acceptance a request loses after K = 0 steps is not modelled)",
    )
    skip_draft_pass_at_k0_prompts: bool = Field(
        default=False,
        description="with skip_draft_pass_at_k0, steps with a prompt skip it too ([plugin] "
        "skip_draft_pass_at_k0_prompts; an engine without prefix caching): a table's K = 0 costs the target alone",
    )
    sidecar_cpu_share: float = Field(
        default=0.0,
        ge=0,
        lt=0.9,
        description="share of the machine's CPU spectuner's own threads take while it runs beside a CPU-bound "
        "engine on the same cores (the lab: the daemon's jobs, the front door, the step writer); the engine "
        "then runs at 1 − share of its speed under spectuner's policies (not the fixed configs, not the "
        "baselines). 0 for a GPU engine, whose steps do not wait for the sidecar's CPU",
    )
    memory: MemorySection | None = None
    failing_configs: list[FailingConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _prompts_need_the_skip(self) -> EngineSection:
        if self.skip_draft_pass_at_k0_prompts and not self.skip_draft_pass_at_k0:
            raise ValueError("skip_draft_pass_at_k0_prompts = true needs skip_draft_pass_at_k0 = true; set both")
        return self


class DraftSection(_Section):
    """A draft the engine can speculate with. α is the per-token acceptance; position i's conditional
    acceptance is α·(1 − position_decay)^i."""

    name: str = Field(min_length=1)
    method: Literal["draft_model", "eagle", "eagle3", "ngram", "suffix"] = "draft_model"
    cost_ratio: float = Field(default=0.0, ge=0, description="draft pass / target pass at every batch size")
    draft_fixed_s: float | None = Field(default=None, ge=0, description="fitted draft pass cost (overrides c)")
    draft_per_seq_s: float | None = Field(default=None, ge=0, description="fitted draft cost per sequence")
    weights_bytes: float = Field(default=0.0, ge=0)
    kv_bytes_per_token: float = Field(default=0.0, ge=0)
    alpha: float = Field(ge=0, le=1)
    prior_alpha: float | None = Field(
        default=None, gt=0, lt=1, description="the α an operator expects before measuring (swap ranking); default 0.5"
    )
    position_decay: float = Field(default=0.0, ge=0, lt=1)
    alpha_jitter_sd: float = Field(default=0.0, ge=0, lt=0.5, description="per-window noise on α (prompt mix)")
    alpha_request_sd: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="spread of α between requests (the prompts): a window's α varies by this over √(requests "
        "the window saw), so windows at one stream scatter more than at 64, as on a live engine",
    )
    alpha_schedule: list[tuple[float, float]] | None = Field(
        default=None, description="[[time_s, alpha], ...]: α over time, linear between points (overrides alpha)"
    )
    proposal_share: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="share of a sequence's steps at which a lookup (ngram, suffix) finds a match and drafts; "
        "the others verify one token alone (α is the acceptance of what it drafted)",
    )

    @field_validator("alpha_schedule")
    @classmethod
    def _schedule(cls, value: list[tuple[float, float]] | None) -> list[tuple[float, float]] | None:
        if value is None:
            return value
        if not value:
            raise ValueError("alpha_schedule is empty; give [[time_s, alpha], ...] or leave it out")
        times = [t for t, _ in value]
        if times != sorted(times):
            raise ValueError(f"alpha_schedule times must increase but got {times}")
        bad = [a for _, a in value if not 0.0 <= a <= 1.0]
        if bad:
            raise ValueError(f"alpha_schedule values must lie in [0, 1] but got {bad}")
        return value

    @property
    def path(self) -> str | None:
        return None if self.method in ("ngram", "suffix") else f"/sim/drafts/{self.name}"


class PhaseSection(_Section):
    name: str = ""
    duration_s: float = Field(gt=0)
    concurrency: float = Field(ge=0)
    alpha_scale: float | dict[str, float] = Field(
        default=1.0, description="workload difficulty: multiplies α (one number, or per draft name; default 1)"
    )

    @field_validator("alpha_scale")
    @classmethod
    def _scale(cls, value: float | dict[str, float]) -> float | dict[str, float]:
        values = value.values() if isinstance(value, dict) else [value]
        bad = [v for v in values if not 0.0 <= v <= 2.0]
        if bad:
            raise ValueError(f"alpha_scale must lie in [0, 2] but got {bad}")
        return value

    def scale_for(self, draft: str) -> float:
        return self.alpha_scale.get(draft, 1.0) if isinstance(self.alpha_scale, dict) else self.alpha_scale


class LoadSection(_Section):
    """Closed-loop load: ``concurrency`` requests are in the engine at any time (the batch), each
    asking for ``output_tokens`` tokens. Goodput is generated tokens per second."""

    kind: Literal["constant", "diurnal", "bursty", "phases"] = "constant"
    concurrency: float = Field(default=1.0, ge=0, description="constant; bursty: between bursts")
    output_tokens: float = Field(default=128.0, gt=0, description="mean output tokens per request")
    trough_concurrency: float = Field(default=1.0, ge=0, description="diurnal minimum")
    peak_concurrency: float = Field(default=32.0, ge=0, description="diurnal maximum")
    peak_at_s: float = Field(default=50400.0, ge=0, description="diurnal: time of day of the peak")
    period_s: float = Field(default=86400.0, gt=0)
    burst_concurrency: float = Field(default=64.0, ge=0)
    burst_every_s: float = Field(default=3600.0, gt=0, description="mean time between burst starts")
    burst_duration_s: float = Field(default=300.0, gt=0)
    phases: list[PhaseSection] = Field(default_factory=list)

    @model_validator(mode="after")
    def _phases(self) -> LoadSection:
        if self.kind == "phases" and not self.phases:
            raise ValueError("kind is 'phases' but no [[load.phases]] are given; add them")
        extra = sorted((self.model_fields_set - {"kind"}) - LOAD_KEYS[self.kind])
        if extra:
            raise ValueError(
                f"{extra} do not apply to kind = {self.kind!r} (it reads {sorted(LOAD_KEYS[self.kind])}); remove them"
            )
        return self


# Which [load] keys each kind reads: a key of another kind is a mistake, refused at load.
LOAD_KEYS: dict[str, set[str]] = {
    "constant": {"concurrency", "output_tokens"},
    "diurnal": {"trough_concurrency", "peak_concurrency", "peak_at_s", "period_s", "output_tokens"},
    "bursty": {"concurrency", "burst_concurrency", "burst_every_s", "burst_duration_s", "output_tokens"},
    "phases": {"phases", "output_tokens"},
}


class ControllerSection(_Section):
    collect_interval_s: float = Field(default=10.0, gt=0)
    decide_interval_s: float = Field(default=60.0, gt=0)
    evidence_window_s: float = Field(default=300.0, gt=0)
    verify_window_s: float = Field(default=300.0, gt=0)
    regression_tolerance: float = Field(default=0.05, ge=0, lt=1)
    k_max: int = Field(default=8, ge=1, le=16)
    cost_ratio: float | None = Field(
        default=None, gt=0, description="policy.cost_ratio the operator configures; default: the start draft's"
    )
    guardrails: dict[str, Any] = Field(default_factory=dict, description="[guardrails] overrides")
    candidates: list[str] | None = Field(
        default=None, description="drafts offered to the swap policy as [[drafts]]; None: every draft; []: none"
    )
    daemon: dict[str, Any] = Field(
        default_factory=dict,
        description="more spectuner.toml tables for the controller, as in a real config (swap, policy, memory...)",
    )

    @field_validator("guardrails")
    @classmethod
    def _known_rails(cls, value: dict[str, Any]) -> dict[str, Any]:
        known = set(GuardrailsSection.model_fields) - {"maintenance_windows"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown guardrail key(s) {unknown}; known: {sorted(known)}")
        return value


class StartSection(_Section):
    draft: str | None = Field(default=None, description="None: speculation off")
    k: int = Field(default=3, ge=0)


class BaselineSection(_Section):
    """Knobs of the comparison policies (defaults follow the systems they imitate)."""

    ma_smoothing: float = Field(default=0.3, gt=0, le=1, description="sglang_ma: EMA weight of a new window")
    ma_up: float = Field(default=0.8, gt=0, le=1, description="sglang_ma: K+1 when accepted/K above this")
    ma_down: float = Field(default=0.4, ge=0, lt=1, description="sglang_ma: K−1 when accepted/K below this")
    cutoff_window_s: float = Field(default=300.0, gt=0, description="trtllm_cutoff: averaging window")
    cutoff_accept_length: float = Field(default=1.5, ge=1, description="trtllm_cutoff: off below this length")
    ucb_epoch_s: float = Field(default=900.0, gt=0, description="ucb: time each pull keeps a config")
    ucb_exploration: float = Field(default=0.5, ge=0, description="ucb: exploration weight")
    ucb_k: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 6, 8], description="ucb: K per draft arm")


class ShadowSection(_Section):
    """Shadow evaluation of the drafts on sampled traffic (docs/shadow.md): every ``interval_s`` (the
    first one ``interval_s`` after the start, as the daemon's job) each
    draft model and ngram candidate gets α evidence from ``tokens_per_run`` replayed output tokens
    (binomially noisy), off by a per-run error of sd ``bias_sd`` shared by the run's drafts (replay against
    serving); EAGLE-style
    heads are not shadow-evaluated (they need the target's hidden states)."""

    interval_s: float = Field(default=600.0, gt=0, description="time between shadow runs")
    interval_max_s: float | None = Field(
        default=None, gt=0,
        description="the longest wait while runs agree ([shadow] evaluate_interval_max_s); unset: 4 × interval_s",
    )
    tokens_per_run: int = Field(default=2000, ge=1, description="recorded output tokens replayed per run")
    k: int = Field(default=3, ge=1, le=16, description="K the replay drafts with")
    bias_sd: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="per-run error of the shadow α, shared by every draft of the run (they replay the same "
        "recorded requests)",
    )
    run_s: float = Field(default=0.0, ge=0, description="a run's duration: its evidence lands this long after")
    cpu_share: float = Field(
        default=0.0,
        ge=0,
        lt=0.9,
        description="share of the machine's CPU a run's replay child takes while it runs, where it shares the "
        "engine's cores (the lab): the engine runs at 1 − share of its speed meanwhile; 0 beside a GPU engine",
    )
    max_machine_share: float = Field(
        default=0.02,
        ge=0,
        lt=1,
        description="[shadow] max_machine_share: the replays' CPU budget, each run charged cpu_share × run_s "
        "machine-seconds; 0: no budget",
    )


class Scenario(_Section):
    name: str
    description: str = ""
    calibration: str = ""
    duration_s: float = Field(gt=0)
    seed: int = 0
    change_at_s: float | None = Field(default=None, description="when the scenario changes (detection time)")
    engine: EngineSection
    drafts: list[DraftSection] = Field(min_length=1)
    start: StartSection = Field(default_factory=StartSection)
    load: LoadSection = Field(default_factory=LoadSection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    baselines: BaselineSection = Field(default_factory=BaselineSection)
    shadow: ShadowSection | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        names = [d.name for d in self.drafts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"draft names must be unique but {dupes} repeat")
        if self.start.draft is not None and self.start.draft not in names:
            raise ValueError(f"start.draft {self.start.draft!r} is not one of the drafts {names}")
        if self.start.k > self.controller.k_max:
            raise ValueError(f"start.k ({self.start.k}) is above controller.k_max ({self.controller.k_max})")
        for f in self.engine.failing_configs:
            if f.draft is not None and f.draft not in names:
                raise ValueError(f"engine.failing_configs names draft {f.draft!r}, not one of {names}")
            above = sorted(k for k in f.k or () if k > self.controller.k_max)
            if above:
                raise ValueError(
                    f"engine.failing_configs K {above} above controller.k_max ({self.controller.k_max}) never run"
                )
        if self.change_at_s is not None and self.change_at_s >= self.duration_s:
            raise ValueError(f"change_at_s ({self.change_at_s}) is not before duration_s ({self.duration_s})")
        for d in self.drafts:
            if d.method in ("ngram", "suffix"):
                loaded = sorted({"weights_bytes", "kv_bytes_per_token", "cost_ratio"} & d.model_fields_set)
                if loaded:
                    raise ValueError(f"draft {d.name!r} ({d.method}) loads no model: {loaded} do not apply")
            elif "proposal_share" in d.model_fields_set:
                raise ValueError(
                    f"draft {d.name!r} ({d.method}) drafts at every step: proposal_share applies to ngram or suffix"
                )
        if self.engine.kv_read_s_per_token > 0 and self.engine.memory is None:
            raise ValueError("engine.kv_read_s_per_token needs [engine.memory] (tokens_per_seq: the context read)")
        unknown_candidates = sorted(set(self.controller.candidates or ()) - set(names))
        if unknown_candidates:
            raise ValueError(f"controller.candidates names unknown draft(s) {unknown_candidates}; drafts: {names}")
        for i, phase in enumerate(self.load.phases):
            if isinstance(phase.alpha_scale, dict):
                unknown = sorted(set(phase.alpha_scale) - set(names))
                if unknown:
                    raise ValueError(f"load.phases[{i}].alpha_scale names unknown draft(s) {unknown}; drafts: {names}")
        if self.controller.collect_interval_s > self.controller.decide_interval_s:
            raise ValueError("controller.collect_interval_s must not exceed decide_interval_s")
        return self

    def draft(self, name: str) -> DraftSection:
        for d in self.drafts:
            if d.name == name:
                return d
        raise KeyError(name)


def _problem(err: Any) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        return f"{key}: is required — add it"
    if err["type"] == "extra_forbidden":
        return f"{key}: is not a known key — remove it or check the spelling (see bench/scenarios/README.md)"
    if "input" in err and err["type"] not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{key}: {msg}"


def parse_scenario(data: dict[str, Any], path: str = "<scenario>") -> Scenario:
    """Validate a scenario, its ``[controller.*]`` tables included (they are built into the daemon's
    config here, so a typo there is refused now, not after every baseline has run)."""
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(path, [_problem(e) for e in exc.errors()]) from None
    from tuner.sim.engine import SimEngine  # the engine and the runner import this module
    from tuner.sim.run import daemon_config

    try:
        daemon_config(scenario, SimEngine(scenario))
    except ScenarioError as exc:
        raise ScenarioError(path, exc.problems) from None
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file. Raises :class:`ScenarioError` naming every problem."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(str(p), ["file not found; see bench/scenarios/ for examples"]) from None
    except UnicodeDecodeError as exc:
        raise ScenarioError(str(p), [f"not UTF-8 text (byte {exc.start}): is this a scenario TOML file?"]) from None
    except OSError as exc:
        raise ScenarioError(str(p), [f"cannot read the file: {exc}"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(str(p), [f"not valid TOML: {exc}; fix the syntax at that line"]) from None
    return parse_scenario(data, str(p))
