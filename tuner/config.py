"""The daemon's TOML config (`spectuner run --config spectuner.toml`), validated with pydantic 2.

Every problem is reported as ``key: what is wrong — what to do`` so an operator can fix the file
without reading code. Unknown keys are errors (a typo must not silently fall back to a default).
See ``docs/spectuner.example.toml`` for a commented example of every key.
"""

from __future__ import annotations

import re
import tomllib
from datetime import time
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policies.spec_config import SpecConfig
from tuner.alerts.settings import AlertsSection
from tuner.exporters.settings import ExportersSection

# Bounds every input path shares (config, `recommend`, `apply`, the daemon's override check).
K_LIMIT = 64  # largest num_speculative_tokens spectuner will consider or send
BATCH_SIZE_LIMIT = 4096  # largest batch size (vLLM --max-num-seqs) a K table may cover


class ConfigError(ValueError):
    """The config file cannot be used. ``problems`` holds one ``key: message`` line per problem."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        if len(problems) == 1:  # one line, as every CLI error
            super().__init__(f"config {path}: {problems[0]}")
        else:
            lines = "\n".join(f"  - {p}" for p in problems)
            super().__init__(f"config {path} has {len(problems)} problems:\n{lines}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mode(StrEnum):
    ADVISORY = "advisory"  # decide and record, never act
    AUTO = "auto"  # act through the actuator


class EngineSection(_Section):
    """Which engine spectuner watches."""

    metrics_url: str = Field(description="vLLM server (http://HOST:PORT) or its /metrics URL")
    health_url: str | None = Field(default=None, description="default: the metrics URL's /health")
    model_name: str | None = Field(default=None, description="served model name; default: any model on the page")

    @field_validator("metrics_url", "health_url")
    @classmethod
    def _http(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL; write http://HOST:PORT")
        return value


class RestartActuatorSection(_Section):
    """Supervise the vLLM server command and apply configs by a graceful restart."""

    argv: list[str] = Field(min_length=1, description="server command line WITHOUT --speculative-config")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="how long a start may take to be healthy")
    shutdown_timeout_s: float = Field(default=30.0, ge=0, description="drain time (vLLM --shutdown-timeout)")
    log_path: str = Field(default="engine.log", description="engine stdout/stderr, relative to the config file")
    pass_shutdown_timeout: bool = Field(
        default=True, description="append --shutdown-timeout to argv (vLLM ≥ 0.11 understands it)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for the server (TMPDIR, ...)")


class CommandActuatorSection(_Section):
    """Hand the config to an external command as JSON on stdin; exit 0 means applied."""

    argv: list[str] = Field(min_length=1)
    timeout_s: float = Field(default=60.0, gt=0)


class WebhookActuatorSection(_Section):
    """POST the config as JSON; a 2xx answer means applied."""

    url: str
    timeout_s: float = Field(default=30.0, gt=0)
    headers: dict[str, str] = Field(default_factory=dict)

    @field_validator("url")
    @classmethod
    def _http(cls, value: str) -> str:
        if not re.match(r"^https?://[^/\s]+", value):
            raise ValueError(f"{value!r} is not an http(s) URL")
        return value


class LiveActuatorSection(_Section):
    """Change K (the per-batch-size K table) inside the running engine through the spectuner vLLM plugin;
    anything else (another draft, K above K_max, live K unsupported) goes to the ``fallback`` actuator."""

    fallback: Literal["restart", "command", "webhook", "none"] = Field(
        default="restart", description="actuator for changes that cannot be made live (its table is required)"
    )
    k_max: int | None = Field(
        default=None,
        ge=1,
        le=K_LIMIT,
        description="K_max the engine starts with (smaller K are live); default policy.k_max",
    )
    verify_timeout_s: float = Field(default=5.0, gt=0, description="how long to watch the step stream for the new K")
    min_evidence_steps: int = Field(default=2, ge=1, description="steps at the new K that confirm a change")
    control_timeout_s: float = Field(default=3.0, gt=0, description="control-channel request timeout")


class FrontDoorSection(_Section):
    """The tap in front of a restart-managed engine (docs/controller.md, "Changes without an outage"):
    clients talk to the tap; an apply holds or switches there instead of failing requests."""

    engine_url: str = Field(description="where the tap reaches the engine: http://127.0.0.1:PORT (argv's --port)")
    listen: str | None = Field(
        default=None, description="run the tap inside the sidecar on this 127.0.0.1:PORT (clients connect there)"
    )
    control_url: str | None = Field(
        default=None, description="or drive a separate `spectuner tap --control-token-file F` at this URL"
    )
    control_token_file: str | None = Field(default=None, description="that tap's control token file (0600)")
    blue_green_port: int | None = Field(
        default=None, gt=0, lt=65536, description="second local port for the new engine (blue/green)"
    )
    replica_ports: list[int] = Field(
        default_factory=list,
        description="rolling: one local port per engine replica (argv's --port replaced for each; at least two)",
    )
    device: Literal["cpu", "gpu"] = Field(default="gpu", description="where the engine runs (the blue/green fit)")
    spare_gpu: bool = Field(default=False, description="a free GPU can hold the new engine beside the old one")
    max_hold_s: float = Field(default=120.0, gt=0, description="longest a request is held; then 503 + Retry-After")
    max_held_requests: int = Field(default=1000, ge=1, description="held requests beyond this get a 503 at once")
    drain_timeout_s: float = Field(default=30.0, gt=0, description="longest wait for in-flight requests to finish")
    read_timeout_s: float = Field(default=600.0, gt=0, description="in-process tap: upstream first-byte/read timeout")
    warmup_requests: int = Field(default=3, ge=0, description="blue/green: completions sent to the new engine first")
    env_by_port: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description='blue/green, rolling: extra environment for the engine on a port, e.g. { "8002" = '
        '{ VLLM_CPU_OMP_THREADS_BIND = "1" } } so two CPU engines do not share cores',
    )

    @field_validator("env_by_port")
    @classmethod
    def _ports(cls, value: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
        bad = [k for k in value if not k.isdigit() or not 0 < int(k) < 65536]
        if bad:
            raise ValueError(f"env_by_port keys must be port numbers but got {bad}")
        return value

    _http = field_validator("engine_url", "control_url")(EngineSection._http.__func__)  # type: ignore[attr-defined]

    @model_validator(mode="after")
    def _one_tap(self) -> FrontDoorSection:
        if (self.listen is None) == (self.control_url is None):
            raise ValueError("set exactly one of listen (a tap inside the sidecar) or control_url (a separate tap)")
        if self.control_url is not None and self.control_token_file is None:
            raise ValueError(
                "control_url needs control_token_file (the file given to `spectuner tap --control-token-file`)"
            )
        return self


def _check_replicas(ports: list[int], argv: list[str]) -> None:
    """A rolling apply needs two or more distinct ports and a server command line that names ``--port``."""
    if len(set(ports)) < 2:
        raise ValueError(
            f"strategy is 'rolling' but actuator.front_door.replica_ports lists {len(set(ports))} distinct "
            "port(s); list one per replica, at least two (e.g. [8000, 8002]), or choose another strategy"
        )
    if len(set(ports)) != len(ports) or not all(0 < p < 65536 for p in ports):
        raise ValueError(f"actuator.front_door.replica_ports must be distinct port numbers but got {ports}")
    if not any(a == "--port" or a.startswith("--port=") for a in argv):
        raise ValueError("strategy is 'rolling' but actuator.restart.argv has no --port to replace per replica")


class ActuatorSection(_Section):
    kind: Literal["restart", "command", "webhook", "live", "none"] = "none"
    strategy: Literal["auto", "blue_green", "drain_hold", "rolling", "restart"] = Field(
        default="auto",
        description="how a restart apply spares clients: auto = blue_green when a second engine fits, else "
        "drain_hold (both need [actuator.front_door]); without a front door, a plain restart; rolling = "
        "one replica of front_door.replica_ports at a time (never chosen by auto)",
    )
    front_door: FrontDoorSection | None = None
    restart: RestartActuatorSection | None = None
    command: CommandActuatorSection | None = None
    webhook: WebhookActuatorSection | None = None
    live: LiveActuatorSection | None = None

    @model_validator(mode="after")
    def _table_for_kind(self) -> ActuatorSection:
        if self.kind != "none" and getattr(self, self.kind) is None:
            raise ValueError(f"kind is {self.kind!r} but there is no [actuator.{self.kind}] table; add one")
        if self.strategy in ("blue_green", "drain_hold", "rolling") and self.front_door is None:
            raise ValueError(f"strategy is {self.strategy!r} but there is no [actuator.front_door] table; add one")
        if self.strategy == "blue_green" and self.front_door is not None and self.front_door.blue_green_port is None:
            raise ValueError("strategy is 'blue_green' but actuator.front_door.blue_green_port is not set")
        if self.strategy == "rolling" and self.front_door is not None:
            _check_replicas(self.front_door.replica_ports, self.restart.argv if self.restart is not None else [])
        live = self.live if self.kind == "live" else None
        if live is not None and live.fallback != "none" and getattr(self, live.fallback) is None:
            raise ValueError(
                f"actuator.live.fallback is {live.fallback!r} but there is no [actuator.{live.fallback}] "
                "table; add one (or set fallback = 'none')"
            )
        return self


class PluginSection(_Section):
    """The spectuner vLLM plugin inside the engine (docs/plugin.md): where it ships per-step statistics
    and where its live-K control channel listens. Unset keys: that part is off."""

    ingest_listen: str | None = Field(default=None, description="127.0.0.1:PORT the sidecar receives steps on")
    control_address: str | None = Field(default=None, description="127.0.0.1:PORT or unix:/abs/path (engine core)")
    token_file: str = Field(
        default="plugin.token",
        description="shared secret (relative to this file); created 0600 if the sidecar starts the engine",
    )
    skip_draft_pass_at_k0: bool = Field(
        default=False,
        description=(
            "K = 0 steps skip the draft model's pass (SPECTUNER_SKIP_K0_DRAFT_PASS in the engine; set by the "
            "sidecar when it starts the engine): a table's K = 0 then costs what plain decoding costs, and a "
            "request that lived through K = 0 steps drafts worse afterwards (docs/plugin.md)"
        ),
    )
    skip_draft_pass_at_k0_prompts: bool = Field(
        default=False,
        description=(
            "with skip_draft_pass_at_k0: K = 0 steps with a prompt in them skip the pass too "
            "(SPECTUNER_SKIP_K0_DRAFT_PASS=all), so a K = 0 row costs exactly plain decoding; only on an engine "
            "started with --no-enable-prefix-caching (with prefix caching on, the engine keeps those passes and "
            "says so), and a request that began at K = 0 drafts without its prompt if K rises while it runs"
        ),
    )

    @model_validator(mode="after")
    def _prompts_need_the_skip(self) -> PluginSection:
        if self.skip_draft_pass_at_k0_prompts and not self.skip_draft_pass_at_k0:
            raise ValueError(
                "skip_draft_pass_at_k0_prompts = true needs skip_draft_pass_at_k0 = true (it widens that skip to "
                "steps with a prompt); set both, or neither"
            )
        return self

    @field_validator("ingest_listen")
    @classmethod
    def _loopback_port(cls, value: str | None) -> str | None:
        if value is None:
            return value
        host, _, port = value.rpartition(":")
        if host not in ("127.0.0.1", "localhost") or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{value!r} is not 127.0.0.1:PORT; the ingest endpoint listens on loopback only")
        return value

    @field_validator("control_address")
    @classmethod
    def _control(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from collectors.vllm_plugin.protocol import Address, AddressError

        try:
            addr = Address.parse(value)
        except AddressError as exc:
            raise ValueError(str(exc)) from None
        if addr.unix_path is None and addr.port == 0:
            raise ValueError(f"{value!r} needs a fixed port: the sidecar must know where to connect")
        return value


class SpeculativeSection(_Section):
    """The config the engine starts with (vLLM's --speculative-config)."""

    method: str = Field(description="draft_model, eagle, eagle3, ngram, suffix, off ...")
    model: str | None = Field(default=None, description="draft model path or name (not for ngram/suffix/off)")
    num_speculative_tokens: int = Field(ge=0, le=K_LIMIT)
    extra: dict[str, Any] = Field(default_factory=dict, description="more keys passed to vLLM as they are")

    @model_validator(mode="after")
    def _model_needed(self) -> SpeculativeSection:
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f'method {self.method!r} needs a draft: set model = "/path/to/draft"')
        return self

    def to_spec_config(self) -> SpecConfig:
        """The config the engine starts with, typed (this table mirrors vLLM's JSON, keys included)."""
        return SpecConfig.from_vllm(
            {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
            | ({"model": self.model} if self.model else {})
            | self.extra
        )


class StepCostSection(_Section):
    """A measured step-time model T(B, K) = fixed_s + per_token_s·max(B·(K+1) − free_tokens, 0) + K·(draft_fixed_s
    + draft_per_seq_s·B), in seconds (see docs/policies.md). Replaces ``cost_ratio`` when given."""

    fixed_s: float = Field(gt=0, description="target forward pass, fixed part (s)")
    per_token_s: float = Field(default=0.0, ge=0, description="target cost per scored token (s)")
    draft_fixed_s: float = Field(default=0.0, ge=0, description="one draft pass, fixed part (s)")
    draft_per_seq_s: float = Field(default=0.0, ge=0, description="one draft pass, per running sequence (s)")
    free_tokens: float = Field(
        default=0.0,
        ge=0,
        description="tokens a target pass scores at its fixed cost before per_token_s applies (the roofline's "
        "knee: memory-bound below, compute-bound above; 0: linear throughout)",
    )


class PolicySection(_Section):
    k_max: int = Field(default=8, ge=0, le=K_LIMIT, description="largest K the controller may choose")
    cost_ratio: float = Field(default=0.05, gt=0, lt=10, description="draft step / target step (c)")
    evidence_window_s: float = Field(default=300.0, gt=0, description="how far back a decision looks")
    load_horizon_s: float = Field(
        default=3600.0,
        gt=0,
        description="one K is chosen for the load (requests running) of this long, weighted by time; "
        "a burst shorter than this does not make the controller restart the engine twice",
    )
    load_regime_band: float = Field(
        default=0.25,
        gt=0,
        lt=1,
        description="relative change of the load (requests running + waiting over a decide interval; at least "
        "1 request) that starts a new load regime",
    )
    load_regime_sustained_s: float = Field(
        default=300.0,
        gt=0,
        description="a load regime this old is sustained: K is then chosen for its load, not the whole "
        "load_horizon_s (≥ load_horizon_s: always the whole horizon)",
    )
    alpha_regime_band: float = Field(
        default=0.05, gt=0, lt=1, description="absolute change of α̂ that starts a new acceptance regime"
    )
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0)
    per_batch_size: bool = Field(
        default=False,
        description="choose vLLM's per-batch-size K table (K per load) instead of one K; "
        "the engine then runs at K = k_max and the table picks K per step",
    )
    max_batch_size: int = Field(
        default=16, ge=1, le=BATCH_SIZE_LIMIT, description="the table's last row (vLLM --max-num-seqs)"
    )
    target_params: int | None = Field(default=None, gt=0, description="target parameters (cost ratio of drafts)")
    step_cost: StepCostSection | None = Field(
        default=None,
        description="pin T(B, K) instead of fitting it from the plugin's per-step records (cells this engine "
        "has measured still replace it there, see step_cost_cell_min_steps)",
    )
    step_cost_fit: bool = Field(
        default=True,
        description="fit T(B, K) from the in-engine plugin's per-step records (needs [plugin]); "
        "until enough steps arrive, or when false, Leviathan's model from cost_ratio is used",
    )
    step_cost_horizon_s: float = Field(default=86400.0, gt=0, description="how far back steps count for the fit")
    step_cost_min_steps: int = Field(default=30, ge=3, description="decode steps needed before the fit is used")
    step_cost_refit_s: float = Field(
        default=300.0,
        gt=0,
        description="how long a fit and its measured cells are kept before the steps are read again (a swap "
        "refits at once); each refit is one grouped query over step_cost_horizon_s",
    )
    step_cost_cell_min_steps: int = Field(
        default=50,
        ge=1,
        description="decode steps a (batch-size band, K) cell of the running engine needs before its measured "
        "mean step time replaces the model's T(B, K) there (needs [plugin] and step_cost_fit)",
    )


class DraftCandidateSection(_Section):
    """A draft the controller may swap to (``[[drafts]]``)."""

    name: str = Field(min_length=1, max_length=64)
    method: Literal["draft_model", "eagle", "eagle3", "mtp", "ngram", "ngram_gpu", "suffix"] = "draft_model"
    model: str | None = Field(default=None, description="draft path or name (not for ngram/suffix)")
    num_params: int | None = Field(default=None, ge=0, description="parameters (weights memory, cost ratio)")
    dtype: str | None = Field(default=None, description="weights dtype; default: the draft's config.json")
    kv_bytes_per_token: int | None = Field(default=None, ge=0, description="default: from the draft's config.json")
    prior_alpha: float = Field(default=0.5, gt=0, lt=1, description="expected α until measured on this target")
    cost_ratio: float | None = Field(default=None, ge=0, lt=10, description="draft pass / target pass (c)")
    draft_fixed_s: float | None = Field(
        default=None,
        ge=0,
        lt=60,
        description="the draft's pass measured on its own, seconds per pass; with draft_per_seq_s, predictions use "
        "it instead of cost_ratio (a host-side proposer such as ngram: a fixed cost, ~0 per sequence)",
    )
    draft_per_seq_s: float | None = Field(
        default=None, ge=0, lt=60, description="the draft's pass, seconds per sequence in the batch (default 0)"
    )
    extra: dict[str, Any] = Field(default_factory=dict, description="more speculative-config keys, as they are")

    @model_validator(mode="after")
    def _model_needed(self) -> DraftCandidateSection:
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError(f'draft {self.name!r} ({self.method}) needs a model: set model = "/path/to/draft"')
        if self.method in ("ngram", "ngram_gpu", "suffix", "mtp") and self.model:
            raise ValueError(
                f"draft {self.name!r}: {self.method} loads no model of its own (MTP's modules are the target's); "
                "remove model"
            )
        return self


class SwapSection(_Section):
    """When a draft must be replaced: acceptance *staying* below the threshold (docs/architecture.md)."""

    enabled: bool = True
    threshold: float = Field(default=0.4, gt=0, lt=1, description="acceptance below which a draft is replaced")
    statistic: Literal["alpha", "draft_acceptance_rate"] = Field(
        default="alpha", description="α̂ (K-independent, default) or vLLM's raw A/T"
    )
    duration_s: float = Field(default=600.0, gt=0, description="how long acceptance must stay low")
    min_drafts: int = Field(default=2000, ge=0, description="drafts of evidence over the duration")
    segments: int = Field(default=3, ge=1, le=20, description="slices that must each be below the threshold")
    prior_strength_trials: float = Field(default=200.0, ge=0, description="weight of a candidate's prior α")
    shadow_error_sd: float = Field(
        default=0.02,
        ge=0,
        lt=0.5,
        description="how far a shadow replay's α̂ may lie from the traffic's (its sample of requests), assumed "
        "until consecutive replays of one acceptance regime measure it; a replay counts at most "
        "α̂(1 − α̂)/σ² trials (policies.replay_error); 0: off, every replayed token counts",
    )
    history_s: float = Field(default=7 * 86400.0, gt=0, description="how far back candidates' α is measured")
    fleet_prior: bool = Field(
        default=False,
        description="candidates' prior α from the other engines of this target in the store (docs/fleet.md)",
    )


class ShadowSection(_Section):
    """The sampled traffic record and its periodic shadow evaluation (docs/shadow.md, "In the daemon"):
    every draft candidate's α measured on recorded traffic, so the controller can rank a candidate it is
    not running. Off unless ``record_dir`` is set. **The record holds user data** (prompts, outputs)."""

    record_dir: str | None = Field(
        default=None,
        description="the sampled record's directory; the in-process tap (front_door.listen) writes it, a separate "
        "`spectuner tap --record-dir` may instead; unset: off",
    )
    record_sample_rate: float = Field(default=0.05, gt=0, le=1, description="share of completions recorded")
    record_max_bytes: int = Field(default=256 * 1024 * 1024, ge=4096, description="size cap of the record (bytes)")
    record_retention_s: float = Field(default=7 * 86400.0, gt=0, description="age limit of a sample")
    target: str | None = Field(
        default=None,
        description="the target model's directory: its tokenizer.json tokenises text responses, and a draft "
        "model is replayed against its vocabulary; needed for evaluation",
    )
    evaluate_interval_s: float = Field(
        default=900.0, ge=0, description="how often the candidates are replayed on the record; 0: record only"
    )
    evaluate_interval_max_s: float | None = Field(
        default=None,
        gt=0,
        description="the longest wait between replays while they agree (each agreeing run doubles the wait from "
        "evaluate_interval_s; the traffic moving or the candidates changing runs one at once); unset: "
        "4 × evaluate_interval_s; equal to it: a replay every evaluate_interval_s",
    )
    candidates: list[str] = Field(
        default_factory=list, description="the candidates replayed (names); empty: every registered and [[drafts]]"
    )
    k: int = Field(default=3, ge=1, le=16, description="K the replay drafts at (α is K-independent)")
    max_samples: int = Field(default=2000, ge=1, description="newest samples replayed per run")
    max_model_len: int | None = Field(default=None, ge=1, description="the engine's max_model_len; unset: no cap")
    threads: int = Field(default=1, ge=1, description="CPU threads the replay worker may use")
    nice: int = Field(default=19, ge=0, le=19, description="the worker's CPU priority drop")
    cpu_share: float = Field(default=0.1, gt=0, le=1, description="most CPU time the worker takes (share of a core)")
    max_machine_share: float = Field(
        default=0.02,
        ge=0,
        lt=1,
        description="the most of the host's CPUs the replays take over time (each run charged the CPU time it "
        "measured, up to two runs in a row; a run that would exceed it waits, whatever made it due): on a small "
        "host the replay slows an engine that shares its cores; 0: no budget",
    )
    timeout_s: float = Field(default=1800.0, gt=0, description="a replay run still going after this is stopped")

    @model_validator(mode="after")
    def _needs(self) -> ShadowSection:
        if self.record_dir is None:
            if self.target is not None or self.candidates:
                raise ValueError("target and candidates need record_dir (the record the replay reads); set it")
            return self
        if self.evaluate_interval_max_s is not None and self.evaluate_interval_max_s < self.evaluate_interval_s:
            raise ValueError(
                f"evaluate_interval_max_s = {self.evaluate_interval_max_s:g} is below evaluate_interval_s = "
                f"{self.evaluate_interval_s:g}: it is the longest wait, so at least that (or unset: 4 × it)"
            )
        if self.evaluate_interval_s > 0 and self.target is None:
            raise ValueError(
                'evaluate_interval_s > 0 needs target = "/path/to/target-model" (its tokenizer and vocabulary); '
                "set it, or evaluate_interval_s = 0 to record only"
            )
        return self


class MemorySection(_Section):
    """What speculation may cost in accelerator memory (draft weights + draft KV + K lookahead slots)."""

    budget_bytes: int | None = Field(default=None, ge=0, description="bytes speculation may use; unset: unlimited")
    tokens_per_seq: int = Field(default=0, ge=0, description="context kept per running sequence (max_model_len)")
    target_kv_bytes_per_token: int = Field(default=0, ge=0, description="the target's KV bytes per token")


class MaintenanceWindow(_Section):
    """A UTC time range on some weekdays (0 = Monday) in which restarts may happen."""

    days: list[int] = Field(default_factory=lambda: list(range(7)))
    start: time
    end: time

    @field_validator("days")
    @classmethod
    def _days(cls, value: list[int]) -> list[int]:
        bad = [d for d in value if not 0 <= d <= 6]
        if bad or not value:
            raise ValueError(f"days must be weekday numbers 0 (Monday) .. 6 (Sunday), got {value}")
        return value


class GuardrailsSection(_Section):
    min_drafts: int = Field(default=200, ge=0, description="drafts of evidence before any change")
    min_drafts_live: int = Field(
        default=50,
        ge=0,
        description="min_drafts for a change that does not interrupt serving: a wrong one costs one verification "
        "window at a worse K, then it is rolled back, so it may act on less evidence; drafts count as independent "
        "trials only up to the windows' over-dispersion in both; set it to min_drafts to treat every change alike",
    )
    min_evidence_s: float = Field(default=60.0, ge=0, description="seconds of windows before any change")
    min_gain: float = Field(default=0.03, ge=0, description="lower end of the predicted gain must beat 1 + this")
    min_gain_live: float = Field(
        default=0.01,
        ge=0,
        description="min_gain for a change that does not interrupt serving (a live K table through the plugin, "
        "blue/green, rolling): no downtime to repay and the verification window rolls back a loss, so a smaller "
        "sure gain is worth taking; set it to min_gain to treat every change alike",
    )
    live_gain_confidence: float = Field(
        default=0.8,
        gt=0.5,
        lt=1.0,
        description="one-sided confidence that a change that does not interrupt serving beats 1 + min_gain_live "
        "(a restart's is the upper tail of [policy] confidence, 0.975 at 0.95): a wrong live change costs one "
        "verification window before it is rolled back, a missed one the whole regime; set it to 0.975 to treat "
        "every change alike",
    )
    hysteresis_ticks: int = Field(default=2, ge=1, description="decisions in a row that must want the change")
    cooldown_s: float = Field(default=600.0, ge=0, description="quiet time after any change")
    max_changes_per_hour: int = Field(default=4, ge=0)
    restart_downtime_s: float = Field(default=60.0, ge=0, description="expected engine downtime per restart")
    payback_horizon_s: float = Field(
        default=3600.0,
        gt=0,
        description="gain must repay the downtime within this, and within the expected remaining length of "
        "the current acceptance regime (measured on this engine, policies/regime.py) — and of the load regime "
        "when K is chosen for a sustained one (policies/load_window.py) —, whichever is shorter",
    )
    maintenance_windows: list[MaintenanceWindow] = Field(
        default_factory=list, description="when set, restarts only inside one of them"
    )


class ControllerSection(_Section):
    mode: Mode = Mode.ADVISORY
    collect_interval_s: float = Field(default=10.0, gt=0)
    decide_interval_s: float = Field(default=60.0, gt=0)
    health_interval_s: float = Field(default=15.0, gt=0)
    retention_interval_s: float = Field(default=300.0, gt=0)
    verify_window_s: float = Field(default=300.0, gt=0, description="evaluation window after a change")
    regression_tolerance: float = Field(default=0.05, ge=0, lt=1, description="realized loss tolerated")


CanaryMetric = Literal["goodput", "ttft_p99", "tpot_p99", "error_rate"]
_CANARY_METRICS: tuple[CanaryMetric, ...] = ("goodput", "ttft_p99", "tpot_p99", "error_rate")


class CanarySection(_Section):
    """Canary verification (docs/fleet.md): replicas behind one router, one sidecar each, one shared store.
    A change goes to one replica first and is judged against the untouched ones over the same minutes;
    promoted to them, or rolled back on the canary alone. Without an untouched replica in the store, a
    change is verified before/after as usual."""

    enabled: bool = False
    max_s: float = Field(default=900.0, gt=0, description="longest a canary runs; still undecided then: rolled back")
    warmup_s: float = Field(default=30.0, ge=0, description="canary windows this soon after the apply are not judged")
    min_samples: int = Field(default=5, ge=2, description="windows needed on each side, per metric")
    bucket_s: float = Field(
        default=60.0, ge=0, description="same-time levelling buckets (needs 2 untouched replicas; 0: raw samples)"
    )
    peer_stale_s: float = Field(default=120.0, gt=0, description="a replica with no window this recent is no baseline")
    confidence: float = Field(default=0.95, gt=0.5, lt=1.0, description="of each metric's effect interval")
    significance: float = Field(default=0.05, gt=0, lt=0.5, description="of each metric's Mann–Whitney U test")
    pass_score: float = Field(default=0.75, ge=0, le=1, description="share of metrics passing needed to promote")
    metrics: list[CanaryMetric] = Field(
        default_factory=lambda: list(_CANARY_METRICS),
        min_length=1,
        description="judged metrics, all critical; one with no data on either side is left out and said so",
    )
    goodput_tolerance_rel: float = Field(default=0.02, ge=0, lt=1, description="goodput loss allowed (share)")
    latency_tolerance_rel: float = Field(default=0.10, ge=0, description="TTFT/TPOT p99 rise allowed (share)")
    error_rate_tolerance: float = Field(default=0.001, ge=0, le=1, description="error-rate rise allowed (absolute)")


class DatabaseSection(_Section):
    url: str | None = None


class SpectunerConfig(_Section):
    engine: EngineSection
    actuator: ActuatorSection = Field(default_factory=ActuatorSection)
    speculative: SpeculativeSection
    policy: PolicySection = Field(default_factory=PolicySection)
    guardrails: GuardrailsSection = Field(default_factory=GuardrailsSection)
    controller: ControllerSection = Field(default_factory=ControllerSection)
    canary: CanarySection = Field(default_factory=CanarySection)
    database: DatabaseSection = Field(default_factory=DatabaseSection)
    plugin: PluginSection = Field(default_factory=PluginSection)
    exporters: ExportersSection = Field(default_factory=ExportersSection)
    alerts: AlertsSection = Field(default_factory=AlertsSection)
    drafts: list[DraftCandidateSection] = Field(default_factory=list, description="swap candidates ([[drafts]])")
    swap: SwapSection = Field(default_factory=SwapSection)
    memory: MemorySection = Field(default_factory=MemorySection)
    shadow: ShadowSection = Field(default_factory=ShadowSection)
    # Where the file was read from (relative paths resolve against its directory).
    base_dir: Path = Field(default=Path("."), exclude=True)

    @model_validator(mode="after")
    def _consistent(self) -> SpectunerConfig:
        if self.actuator.kind == "live" and not self.plugin.control_address:
            raise ValueError(
                "actuator.kind is 'live' but plugin.control_address is not set: give the engine core's control "
                'channel address (e.g. control_address = "unix:/run/spectuner/control.sock")'
            )
        if self.controller.mode is Mode.AUTO and self.actuator.kind == "none":
            raise ValueError(
                "controller.mode is 'auto' but actuator.kind is 'none': choose an actuator "
                "(restart, command, webhook) or set mode = 'advisory'"
            )
        names = [d.name for d in self.drafts]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"drafts: the name(s) {', '.join(dupes)} appear more than once; names must be unique")
        if self.speculative.num_speculative_tokens > self.policy.k_max:
            raise ValueError(
                f"speculative.num_speculative_tokens ({self.speculative.num_speculative_tokens}) is above "
                f"policy.k_max ({self.policy.k_max}); raise k_max or start with a smaller K"
            )
        return self

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() else self.base_dir / p


_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it or check the spelling (see docs/spectuner.example.toml)",
    "literal_error": "use one of the listed values",
    "enum": "use one of the listed values",
}


def _problem(err: Any) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    msg = str(err["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    fix = _FIXES.get(kind)
    if kind == "missing":
        msg = "is required"
    elif kind == "extra_forbidden":
        msg = "is not a known key"
    elif "input" in err and kind not in ("value_error", "assertion_error"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{key}: {msg}" + (f" — {fix}" if fix else "")


def parse_config(data: dict[str, Any], *, path: str = "<config>", base_dir: Path | None = None) -> SpectunerConfig:
    """Validate already-parsed TOML data. Raises :class:`ConfigError` listing every problem."""
    try:
        config = SpectunerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(path, [_problem(e) for e in exc.errors()]) from None
    if base_dir is not None:
        config = config.model_copy(update={"base_dir": base_dir})
    return config


def load_config(path: str | Path) -> SpectunerConfig:
    """Read and validate a TOML file. Raises :class:`ConfigError` (missing file, bad TOML, bad keys)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), ["file not found; write one (see docs/spectuner.example.toml)"]) from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), [f"not UTF-8 text (byte {exc.start}): is this the TOML config?"]) from None
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read the file: {exc}"]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(p), [f"not valid TOML: {exc}; fix the syntax at that line"]) from None
    return parse_config(data, path=str(p), base_dir=p.resolve().parent)
