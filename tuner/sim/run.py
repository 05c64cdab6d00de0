"""Run a scenario under each policy and compare them.

Every adaptive policy runs against the REAL store (SQLite in a temporary file, migrated once per
process and copied per run) and the simulated engine through the simulated actuator:

- ``spectuner``: the real :class:`~tuner.controller.controller.Controller` (verify, then decide, every
  ``decide_interval_s``) with its default policy and guardrails; windows reach the store through the
  daemon's :class:`~tuner.store.tagging.ConfigTaggingSink`, as the collector's do.
- ``sglang_ma``, ``trtllm_cutoff``, ``ucb``: :class:`ThinDriver` — same store, same
  ``tuner.controller.context.measure``, same actuator, no guardrails (see ``tuner.sim.baselines``).
- ``fixed_k3`` (the start draft at K = 3), ``no_spec`` and every fixed config: no controller at all.
- ``best_fixed``: every config (each draft at K = 1..k_max, and off) is simulated and the one with
  the highest total goodput is kept — the best fixed config *in hindsight*, which is the oracle of
  ``ratio_to_oracle``. ``dynamic_oracle_goodput`` is the expected goodput of the best config at
  every window with free switching: an upper bound no policy can reach.

Windows between two decide ticks are written in one batch (the controller reads only at ticks, so
this is what it would see from per-window writes; it makes a 24 h scenario fast).
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from collectors.records import EngineKey, LatencySummary, StepRecord, WindowRecord
from policies.acceptance import evidence_from_counters
from policies.change import ChangeDetectorConfig, ChangeDetectorState, update_change_detector
from policies.counters import SpecCounters
from policies.memory import FREE_METHODS
from policies.spec_config import SpecConfig
from policies.step_cost import StepCostModel
from tuner.actuators.base import ApplyStatus
from tuner.config import ConfigError, PolicySection, SpectunerConfig, StepCostSection, parse_config
from tuner.controller.audit import TickResult
from tuner.controller.context import DecisionContext, measure
from tuner.controller.controller import Controller, Policy
from tuner.controller.policy import PolicyOutcome
from tuner.sim.actuator import SimActuator, SimClock, live_change
from tuner.sim.baselines import Baseline, make_baseline
from tuner.sim.engine import OFF, SimConfig, SimEngine
from tuner.sim.scenario import Scenario, ScenarioError
from tuner.sim.shadow import ShadowFeed
from tuner.store import AppliedBy, EngineConfigRecord, Store, upgrade
from tuner.store.tagging import ConfigTaggingSink
from tuner.wiring import controller_settings, draft_candidates

T0 = datetime(2026, 1, 5, tzinfo=UTC)  # a Monday, 00:00 UTC: simulated time 0
URL = "http://sim.invalid:8000/metrics"
KEY = EngineKey(URL, "sim-target", "0")

# The real Controller, configured as `spectuner run` would be; the second with [policy.step_cost] = the engine's
# true T(B, K) (what a perfect fit of the step-cost model would give).
CONTROLLER = ("spectuner", "spectuner_stepcost")
ADAPTIVE = (*CONTROLLER, "sglang_ma", "trtllm_cutoff", "ucb")
POLICIES = (
    "spectuner",
    "fixed_k3",
    "no_spec",
    "best_fixed",
    "sglang_ma",
    "trtllm_cutoff",
    "ucb",
    "spectuner_stepcost",
)


class StoreFactory:
    """Fresh migrated SQLite databases: the schema is migrated once, then the file is copied."""

    def __init__(self) -> None:
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None  # RAM-backed when there is one
        self.dir = Path(tempfile.mkdtemp(prefix="spectuner-sim-", dir=base))
        self.template = self.dir / "template.db"
        upgrade(f"sqlite:///{self.template}")
        self._n = 0

    def new(self) -> Store:
        self._n += 1
        path = self.dir / f"run-{self._n}.db"
        shutil.copyfile(self.template, path)
        return Store(f"sqlite:///{path}")

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StoreFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class PolicyRun:
    """What one policy did over the scenario."""

    policy: str
    driver: str  # controller | thin_driver | fixed
    config: str  # the fixed config, or the start config of an adaptive policy
    total_tokens: float = 0.0
    duration_s: float = 0.0
    changes: int = 0  # config changes that took effect (rollbacks of a regression included)
    restarts: int = 0  # engine restarts, failed starts included
    failed_starts: int = 0
    rollbacks: int = 0  # regressions rolled back by verify + starts that failed and fell back
    downtime_s: float = 0.0
    detection_s: float | None = None  # first reaction (proposal or change) after the scenario's change
    change_detector_s: float | None = None  # spectuner's CUSUM (policies.change) on the same windows
    timeline: list[tuple[float, str]] = field(default_factory=list)  # (sim seconds, config label)
    configs: list[tuple[float, SimConfig]] = field(default_factory=list)  # the timeline's configs
    detector_alarms: int = 0  # the CUSUM's alarms over the whole run (spectuner only)
    detector_false_alarms: int = 0  # ... of which the running draft's true α had not moved by its shift
    phases: dict[str, float] = field(default_factory=dict)  # phase → generated tokens
    ticks: dict[str, int] = field(default_factory=dict)  # tick action → count
    hourly_goodput: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time: the speed figure that does not depend on other load

    @property
    def goodput(self) -> float:
        return self.total_tokens / self.duration_s if self.duration_s > 0 else 0.0


class _Driver:
    """The policy side of the loop: receives windows, acts at decide ticks."""

    def flush(self, records: Sequence[WindowRecord], steps: Sequence[StepRecord] = ()) -> None: ...

    def tick(self, now: datetime) -> None: ...


class ControllerDriver(_Driver):
    """spectuner itself: the real Controller on the real store, built from a daemon config."""

    def __init__(
        self,
        store: Store,
        actuator: SimActuator,
        config: SpectunerConfig,
        clock: SimClock,
        run: PolicyRun,
        change_at: datetime | None,
    ) -> None:
        settings = controller_settings(config)
        self.controller = Controller(
            store, actuator, settings, clock, candidates=lambda: draft_candidates(config, store)
        )
        self.inner: Policy = self.controller.policy  # the controller's own default policy, unchanged
        self.controller.policy = self._policy
        self.sink = ConfigTaggingSink(store)
        self.run = run
        self.change_at = change_at
        self.steady: tuple[str, str | None] | None = None  # the policy's answer on the last tick before the change
        store.upsert_engine(KEY, seen_at=clock.now)
        self.controller.sync_configs(clock.now, AppliedBy.STARTUP)

    def flush(self, records: Sequence[WindowRecord], steps: Sequence[StepRecord] = ()) -> None:
        self.sink.write_windows_and_steps(records, steps)

    def pin_step_cost(self, model: StepCostModel) -> None:
        """``[policy.step_cost]`` = ``model`` from the next tick: spectuner_stepcost's true T(B, K) is the
        draft in force's, so after a swap it is re-read for the new draft (as an operator would re-pin it)."""
        s = self.controller.settings
        section = StepCostSection(
            fixed_s=model.fixed_s,
            per_token_s=model.per_token_s,
            draft_fixed_s=model.draft_fixed_s,
            draft_per_seq_s=model.draft_per_seq_s,
            free_tokens=model.free_tokens,
        )
        policy = replace(s.policy, policy=s.policy.policy.model_copy(update={"step_cost": section}))
        self.controller.settings = replace(s, policy=policy)

    def tick(self, now: datetime) -> None:
        # As the daemon's decide job: verify, then decide at the same ``now``. When verify rolled a change
        # back, the restart moved the clock past ``now`` and the rolled-back config starts after it; the
        # daemon's decide would then fail this tick (its context would start after ``now``) and carry on at
        # the next, so the simulation skips decide on such a tick.
        results = self.controller.verify(now)
        if self.controller.clock() <= now:
            results.append(self.controller.decide(now))
        else:
            self.run.ticks["decide_skipped_after_rollback"] = self.run.ticks.get("decide_skipped_after_rollback", 0) + 1
        for r in results:
            self._count(r, now)

    def _policy(self, ctx: DecisionContext) -> PolicyOutcome:
        """The controller's policy, unchanged; the driver only notes what it answered (detection time)."""
        outcome = self.inner(ctx)
        answer = (str(outcome.reason), outcome.target.fingerprint if outcome.target is not None else None)
        if self.change_at is not None:
            if ctx.now < self.change_at:
                self.steady = answer
            elif self.run.detection_s is None and answer != self.steady:
                self.run.detection_s = (ctx.now - self.change_at).total_seconds()
        return outcome

    def _count(self, r: TickResult, now: datetime) -> None:
        self.run.ticks[r.action] = self.run.ticks.get(r.action, 0) + 1
        if r.action == "rolled_back":
            self.run.rollbacks += 1


class ThinDriver(_Driver):
    """A baseline policy on the same store, evidence and actuator, without spectuner's guardrails."""

    def __init__(
        self,
        store: Store,
        actuator: SimActuator,
        engine: SimEngine,
        baseline: Baseline,
        clock: SimClock,
        run: PolicyRun,
        change_at: datetime | None,
    ) -> None:
        self.store, self.actuator, self.engine, self.baseline = store, actuator, engine, baseline
        self.clock, self.run, self.change_at = clock, run, change_at
        store.upsert_engine(KEY, seen_at=clock.now)
        store.record_config(
            KEY, EngineConfigRecord.of(SpecConfig.from_vllm(actuator.current), clock.now, AppliedBy.STARTUP)
        )
        self.sink = ConfigTaggingSink(store)

    def flush(self, records: Sequence[WindowRecord], steps: Sequence[StepRecord] = ()) -> None:
        self.sink.write_windows(records)  # the baselines decide from windows only

    def tick(self, now: datetime) -> None:
        current = self.store.current_config(KEY)
        assert current is not None
        evidence = measure(self.store, [KEY], current, now, self.baseline.evidence_window_s)
        current_cfg = self.actuator.config
        target = self.baseline.decide(evidence, current_cfg, now)
        if target is None or target == current_cfg:
            return
        t = (now - T0).total_seconds()
        responds = float(self.engine.expected_goodput(target, t)) > float(self.engine.expected_goodput(current_cfg, t))
        if self.change_at is not None and now >= self.change_at and self.run.detection_s is None and responds:
            # a change that responds to the event (the new config is truly better now), not an exploration
            self.run.detection_s = (now - self.change_at).total_seconds()
        spec = self.engine.to_spec(target)
        result = self.actuator.apply(spec.to_vllm())
        done = max(self.clock(), now)
        if result.status is ApplyStatus.APPLIED:
            self.store.record_config(KEY, EngineConfigRecord.of(spec, done, AppliedBy.RESTART))
        elif result.status is ApplyStatus.ROLLED_BACK and result.config is not None:
            self.store.record_config(
                KEY, EngineConfigRecord.of(SpecConfig.from_vllm(result.config), done, AppliedBy.ROLLBACK)
            )
            self.run.rollbacks += 1
        self.baseline.applied(target, result.status is ApplyStatus.APPLIED, done)


def _seed(scenario_seed: int, policy: str) -> np.random.Generator:
    return np.random.default_rng([scenario_seed, 7, zlib.crc32(policy.encode())])


def _step(w: Any, key: EngineKey) -> StepRecord | None:
    """One step per window, as the in-engine plugin would ship it (the plugin ships every step; one
    sampled step per window keeps a 24 h run fast and gives the controller's step-cost fit its data)."""
    if w.batch <= 0 or not math.isfinite(w.step_s):
        return None
    b = max(1, round(w.batch))
    k = w.k
    spec = SpecCounters()
    if k > 0 and w.spec is not None and w.spec.drafts > 0:
        per_pos = tuple(round(a * b / w.spec.drafts) for a in w.spec.accepted_per_pos)
        spec = SpecCounters(b, b * k, sum(per_pos), per_pos, k, generated_tokens=b + sum(per_pos))
    return StepRecord(
        ts=T0 + timedelta(seconds=w.end_s),
        key=key,
        batch_size=b,
        step_time_s=w.step_s,
        spec=spec,
        num_scheduled_tokens=b * (k + 1),
    )


def _record(w: Any, key: EngineKey, output_tokens: float) -> WindowRecord:
    """The scraper's window; requests finished (vLLM's e2e latency count) at the scenario's mean output
    tokens per request, the latencies themselves not modelled."""
    return WindowRecord(
        key=key,
        start=T0 + timedelta(seconds=w.start_s),
        end=T0 + timedelta(seconds=w.end_s),
        spec=w.spec,
        generation_tokens=w.generation_tokens,
        requests_running=w.batch,
        requests_waiting=w.waiting,
        kv_cache_usage=w.kv_usage,
        e2e_latency=LatencySummary(count=w.generation_tokens / output_tokens),
    )


def simulate(
    scenario: Scenario,
    engine: SimEngine,
    policy: str,
    start: SimConfig,
    *,
    seed: int | None = None,
    stores: StoreFactory | None = None,
) -> PolicyRun:
    """Run one policy (an adaptive one, or the fixed config ``start``) over the whole scenario."""
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    seed = scenario.seed if seed is None else seed
    rng = _seed(seed, policy)
    s, c = scenario, scenario.controller
    clock = SimClock(T0)
    actuator = SimActuator(engine, clock, start)
    driver_kind = "controller" if policy in CONTROLLER else "thin_driver" if policy in ADAPTIVE else "fixed"
    run = PolicyRun(policy, driver_kind, start.label)
    change_at = T0 + timedelta(seconds=s.change_at_s) if s.change_at_s is not None else None
    store: Store | None = None
    driver: _Driver | None = None
    if policy in ADAPTIVE:
        if stores is None:
            raise ValueError("adaptive policies need a StoreFactory")
        store = stores.new()
        cache = engine.cache_config(start)
        if cache is not None:
            store.upsert_engine(KEY, seen_at=clock.now, cache_config=cache)
        if policy in CONTROLLER:
            config = daemon_config(scenario, engine, step_cost=policy == "spectuner_stepcost")
            driver = ControllerDriver(store, actuator, config, clock, run, change_at)
        else:
            driver = ThinDriver(store, actuator, engine, make_baseline(policy, engine), clock, run, change_at)
    detector = _detector(scenario) if policy in CONTROLLER else None
    det = _DetectorRun(engine, start) if detector is not None else None
    shadow = (
        ShadowFeed(s, s.shadow, engine, np.random.default_rng([seed, 21]))
        if s.shadow is not None and policy in CONTROLLER
        else None
    )
    hours = max(1, math.ceil(s.duration_s / 3600.0))
    hourly = np.zeros(hours)
    n_phases = len(s.load.phases)
    phase_tokens = np.zeros(max(n_phases, 1))
    t = 0.0
    next_tick = c.decide_interval_s
    run.timeline.append((0.0, start.label))
    run.configs.append((0.0, start))
    try:
        while t < s.duration_s - 1e-9:
            # The windows up to the next decide tick (fixed configs: the whole run) in one draw.
            horizon = s.duration_s if driver is None else min(next_tick, s.duration_s)
            n = max(1, math.ceil((horizon - t) / c.collect_interval_s - 1e-9))
            starts = t + c.collect_interval_s * np.arange(n, dtype=np.float64)
            ends = np.minimum(starts + c.collect_interval_s, horizon)
            cpu_taken = None
            if policy in CONTROLLER and (s.engine.sidecar_cpu_share > 0 or shadow is not None):
                # spectuner's sidecar shares a CPU engine's cores: its threads, and a replay while one runs
                cpu_taken = s.engine.sidecar_cpu_share + (
                    shadow.cpu_taken(starts, ends) if shadow is not None else np.zeros(len(starts))
                )
            ws = engine.windows(actuator.config, starts, ends, rng, cpu_taken)
            tokens = np.array([w.generation_tokens for w in ws])
            run.total_tokens += float(tokens.sum())
            np.add.at(hourly, np.minimum((starts // 3600).astype(np.int64), hours - 1), tokens)
            if n_phases:
                np.add.at(phase_tokens, engine._phase(starts), tokens)
            if detector is not None and det is not None:
                det.config(actuator.config, t)
                for w in ws:
                    det.feed(detector, w, run, change_at)
            t = horizon
            if driver is None:
                continue
            records = [_record(w, KEY, scenario.load.output_tokens) for w in ws]
            driver.flush(records, [st for st in (_step(w, KEY) for w in ws) if st is not None])
            clock.now = T0 + timedelta(seconds=t)
            if shadow is not None and store is not None:
                moved = driver.controller.memory.alpha_moved_at if isinstance(driver, ControllerDriver) else None
                shadow.tick(clock.now, t, store, moved)
            before = actuator.config
            driver.tick(clock.now)
            after_s = (clock.now - T0).total_seconds()
            if after_s > t:  # the engine was down for a restart: nothing was generated meanwhile
                t = min(after_s, s.duration_s)
            if actuator.config != before:
                if policy == "spectuner_stepcost" and isinstance(driver, ControllerDriver):
                    driver.pin_step_cost(engine.cost[actuator.config.draft or start.draft or s.drafts[0].name])
                # a restart sizes a new KV pool: the engine's cache_config_info changes with the config
                cache = engine.cache_config(actuator.config)
                if store is not None and cache is not None:
                    store.upsert_engine(KEY, seen_at=clock.now, cache_config=cache)
                run.timeline.append((round(t, 3), actuator.config.label))
                run.configs.append((round(t, 3), actuator.config))
            while next_tick <= t + 1e-9:
                next_tick += c.decide_interval_s
    finally:
        if store is not None:
            store.close()
    for i, phase in enumerate(s.load.phases):
        name = phase.name or f"phase {i + 1}"
        run.phases[name] = run.phases.get(name, 0.0) + float(phase_tokens[i])
    run.duration_s = s.duration_s
    st = actuator.stats
    run.restarts, run.failed_starts, run.downtime_s = st.restarts, st.failed_starts, st.downtime_s
    run.changes = max(len(run.timeline) - 1, 0)
    run.hourly_goodput = [round(float(x) / 3600.0, 3) for x in hourly]
    run.wall_s = time.perf_counter() - t_wall
    run.cpu_s = time.process_time() - t_cpu
    return run


def daemon_config(scenario: Scenario, engine: SimEngine, *, step_cost: bool = False) -> SpectunerConfig:
    """The spectuner.toml an operator would write for this engine, validated by the real config code:
    the controller's settings and draft candidates are then built exactly as ``spectuner run`` builds them."""
    c, e = scenario.controller, scenario.engine
    start = start_config(scenario)
    cost_ratio = c.cost_ratio
    if cost_ratio is None:
        cost_ratio = engine.cost[start.draft or scenario.drafts[0].name].cost_ratio(1.0)
    spec = engine.to_spec(start)
    # the config file's [speculative] table mirrors vLLM's JSON
    speculative: dict[str, Any] = SpecConfig(spec.method, spec.model, 0 if start.off else start.k).to_vllm()
    data: dict[str, Any] = {
        "engine": {"metrics_url": URL},
        "actuator": {"kind": "command", "command": {"argv": ["/bin/true"]}},  # replaced by the SimActuator
        "speculative": speculative,
        "policy": {"k_max": c.k_max, "cost_ratio": max(cost_ratio, 1e-6), "evidence_window_s": c.evidence_window_s},
        "guardrails": {"restart_downtime_s": e.restart_downtime_s, **c.guardrails},
        "controller": {
            "mode": "auto",
            "collect_interval_s": c.collect_interval_s,
            "decide_interval_s": c.decide_interval_s,
            "verify_window_s": c.verify_window_s,
            "regression_tolerance": c.regression_tolerance,
        },
        "drafts": [
            _candidate(engine, d.name) for d in scenario.drafts if c.candidates is None or d.name in c.candidates
        ],
    }
    # The plugin ships every step; the simulator one sampled step per collect window (``_step``). A measured
    # step-cost cell needs as much decode time here as live: its minimum in windows, not in steps.
    steps_per_window = max(c.collect_interval_s / e.target_step_s, 1.0)
    min_steps = PolicySection.model_fields["step_cost_cell_min_steps"].default
    data["policy"]["step_cost_cell_min_steps"] = max(1, math.ceil(min_steps / steps_per_window))
    if e.skip_draft_pass_at_k0:
        data["plugin"] = {
            "skip_draft_pass_at_k0": True,
            "skip_draft_pass_at_k0_prompts": e.skip_draft_pass_at_k0_prompts,
        }
    if e.memory is not None:
        # the target's KV bytes per token, as an operator reads it from the model's config.json: with the
        # engine's cache_config_info, the KV pool that caps each config's batch
        data["memory"] = {"target_kv_bytes_per_token": int(e.memory.target_kv_bytes_per_token)}
    if step_cost:
        m = engine.cost[start.draft or scenario.drafts[0].name]
        data["policy"]["step_cost"] = {
            "fixed_s": m.fixed_s,
            "per_token_s": m.per_token_s,
            "draft_fixed_s": m.draft_fixed_s,
            "draft_per_seq_s": m.draft_per_seq_s,
            "free_tokens": m.free_tokens,
        }
    _merge(data, c.daemon)
    try:
        return parse_config(data, path=f"{scenario.name} [controller]")
    except ConfigError as exc:
        raise ScenarioError(scenario.name, [f"controller.daemon → {p}" for p in exc.problems]) from None


def _candidate(engine: SimEngine, name: str) -> dict[str, Any]:
    """A ``[[drafts]]`` entry for one of the scenario's drafts (sizes as bf16 parameters)."""
    d = engine.drafts[name]
    entry: dict[str, Any] = {
        "name": d.name,
        "method": d.method,
        "cost_ratio": min(engine.cost[name].cost_ratio(1.0), 9.99),
        "prior_alpha": d.prior_alpha if d.prior_alpha is not None else 0.5,
    }
    if d.method in FREE_METHODS:
        # a lookup's pass runs on the host at the same cost whatever the batch: registered in seconds, as
        # the lab registers its calibrated one (``tuner.lab.closed_loop.lab_lookup_pass``); a ratio of the
        # target's pass would grow with the batch
        m = engine.cost[name]
        entry.update(draft_fixed_s=m.draft_fixed_s, draft_per_seq_s=m.draft_per_seq_s)
    if d.path is not None:
        entry.update(
            model=d.path,
            num_params=int(d.weights_bytes // 2),
            dtype="bfloat16",
            kv_bytes_per_token=int(d.kv_bytes_per_token),
        )
    return entry


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _detector(scenario: Scenario) -> ChangeDetectorConfig:
    return ChangeDetectorConfig(window_s=scenario.controller.collect_interval_s)


class _DetectorRun:
    """The CUSUM (``policies.change``) fed every window of the running config; it restarts when the
    config changes (another draft or K is another α). An alarm is false when the running draft's true α
    (the scenario's, without the windows' jitter) moved less than half the detector's shift since the
    reference began."""

    def __init__(self, engine: SimEngine, start: SimConfig) -> None:
        self.engine = engine
        self.state = ChangeDetectorState()
        self.cfg = start
        self.since_s = 0.0

    def config(self, cfg: SimConfig, t: float) -> None:
        if cfg != self.cfg:
            self.cfg, self.state, self.since_s = cfg, ChangeDetectorState(), t

    def feed(self, config: ChangeDetectorConfig, w: Any, run: PolicyRun, change_at: datetime | None) -> None:
        if w.spec is None or self.cfg.off:
            return
        ev = evidence_from_counters(w.spec)
        if ev.evidence is None:
            return
        now = T0 + timedelta(seconds=w.end_s)
        decision, self.state = update_change_detector(self.state, ev.evidence, now, config)
        if not decision.changed:
            return
        run.detector_alarms += 1
        draft = str(self.cfg.draft)
        moved = abs(float(self.engine.alpha(draft, w.end_s)) - float(self.engine.alpha(draft, self.since_s)))
        if moved < config.shift / 2:
            run.detector_false_alarms += 1
        self.since_s = w.end_s
        if change_at is not None and now >= change_at and run.change_detector_s is None:
            run.change_detector_s = (now - change_at).total_seconds()


@dataclass(frozen=True)
class ChangeJudgement:
    """What the world model says of a policy's config changes (expected goodput, no noise)."""

    unwarranted: int  # the new config was not better than the old at the moment of the change
    unpaid: int  # restarts whose gain until the next change did not repay their serving gap
    first_response_s: float | None  # first warranted change at or after the scenario's change_at_s


_BEYOND_END_S = 3600.0  # how far past the run's end the last change's payback is judged


def judge_changes(engine: SimEngine, run: PolicyRun, downtime_s: float) -> ChangeJudgement:
    """Each change of ``run`` against the truth: a false alarm is a change to a config that was not
    better when it was made; an unpaid restart is one whose expected extra tokens until the next change
    (for the last change: the end, or an hour after it on the world continued) fell short of the tokens its
    serving gap lost — a transient shorter than its payback."""
    s = engine.scenario
    unwarranted = unpaid = 0
    first: float | None = None
    dt = s.controller.collect_interval_s
    for i in range(1, len(run.configs)):
        t, new = run.configs[i]
        _, old = run.configs[i - 1]
        gap = 0.0 if live_change(engine, old, new) else downtime_s
        at = max(t - gap, 0.0)  # the decision was taken when the restart began
        better = float(engine.expected_goodput(new, at)) > float(engine.expected_goodput(old, at))
        if not better:
            unwarranted += 1
        elif s.change_at_s is not None and at >= s.change_at_s and first is None:
            first = at - s.change_at_s
        next_gap = 0.0 if i + 1 < len(run.configs) and live_change(engine, new, run.configs[i + 1][1]) else downtime_s
        # the last change's payback may run past the run's end: the world model continues (its last phase,
        # the diurnal cycle) for up to an hour, so a change made minutes before the end is not unpaid by fiat
        end = run.configs[i + 1][0] - next_gap if i + 1 < len(run.configs) else max(s.duration_s, t + _BEYOND_END_S)
        grid = np.arange(t, max(end, t + dt), dt) + dt / 2
        won = float(np.sum(engine.expected_goodput(new, grid) - engine.expected_goodput(old, grid)) * dt)
        lost = float(engine.expected_goodput(old, at)) * gap
        if gap > 0 and won < lost:  # a live change is not a restart
            unpaid += 1
    return ChangeJudgement(unwarranted, unpaid, first)


def start_config(scenario: Scenario) -> SimConfig:
    st = scenario.start
    return OFF if st.draft is None or st.k == 0 else SimConfig(st.draft, st.k)


def _grid(scenario: Scenario) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Midpoints and lengths of the collect windows of an undisturbed run."""
    dt = scenario.controller.collect_interval_s
    starts = dt * np.arange(math.ceil(scenario.duration_s / dt - 1e-9))
    ends = np.minimum(starts + dt, scenario.duration_s)
    return (starts + ends) / 2.0, ends - starts


def dynamic_oracle_tokens(engine: SimEngine, configs: Sequence[SimConfig]) -> float:
    """Expected tokens of the best config in every window, switching for free (an upper bound)."""
    mid, length = _grid(engine.scenario)
    best = np.max(np.stack([engine.expected_goodput(cfg, mid) for cfg in configs]), axis=0)
    return float((best * length).sum())


Progress = Callable[[str], None]


def run_scenario(
    scenario: Scenario,
    policies: Sequence[str] = POLICIES,
    *,
    seed: int | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Every requested policy over the scenario, as the JSON ``spectuner simulate`` prints."""
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown}; choose from {list(POLICIES)}")
    t_wall = time.perf_counter()
    engine = SimEngine(scenario)
    seed = scenario.seed if seed is None else seed
    say = progress or (lambda msg: None)
    start = start_config(scenario)
    configs = [cfg for cfg in engine.all_configs() if engine.start_problem(cfg) is None]
    runs: dict[str, PolicyRun] = {}
    # The oracle is always computed: ratio_to_oracle needs it.
    fixed_runs: dict[SimConfig, PolicyRun] = {}
    for cfg in configs:
        fixed_runs[cfg] = simulate(scenario, engine, f"fixed:{cfg.label}", cfg, seed=seed)
    best_cfg = max(configs, key=lambda cfg: (fixed_runs[cfg].total_tokens, -cfg.k))
    runs["best_fixed"] = fixed_runs[best_cfg]
    runs["best_fixed"].policy = "best_fixed"
    say(f"best fixed in hindsight: {best_cfg.label}")
    k3 = SimConfig(start.draft, 3) if start.draft else SimConfig(scenario.drafts[0].name, 3)
    with StoreFactory() as stores:
        for name in policies:
            if name == "best_fixed":
                continue
            if name == "fixed_k3":
                run = fixed_runs.get(k3) or simulate(scenario, engine, "fixed_k3", k3, seed=seed)
                run.policy = "fixed_k3"
            elif name == "no_spec":
                run = fixed_runs[OFF]
                run.policy = "no_spec"
            else:
                run = simulate(scenario, engine, name, start, seed=seed, stores=stores)
            runs[name] = run
            say(f"{name}: {run.goodput:.1f} tokens/s, {run.changes} changes ({run.wall_s:.1f} s)")
    oracle = runs["best_fixed"].goodput
    dynamic = dynamic_oracle_tokens(engine, configs) / scenario.duration_s
    out_policies = {name: _policy_json(runs[name], oracle, dynamic, scenario, engine) for name in policies}
    return {
        "scenario": scenario.name,
        "description": scenario.description,
        "seed": seed,
        "duration_s": scenario.duration_s,
        "oracle": {
            "kind": "best fixed config in hindsight (every draft × K = 1..k_max, and off; simulated)",
            "config": best_cfg.label,
            "goodput": round(oracle, 3),
            "dynamic_oracle_goodput": round(dynamic, 3),
            "dynamic_oracle_kind": "expected goodput of the best config in every window, switching for free",
        },
        "fixed_configs": {cfg.label: round(fixed_runs[cfg].goodput, 3) for cfg in configs},
        "requests_per_s": round(runs["best_fixed"].goodput / scenario.load.output_tokens, 3),
        "change_at_s": scenario.change_at_s,
        "policies": out_policies,
        "wall_s": round(time.perf_counter() - t_wall, 3),
    }


TIMELINE_MAX = 50  # timeline entries in the JSON; ``timeline_cut`` says when there were more


def _policy_json(
    run: PolicyRun, oracle: float, dynamic: float, scenario: Scenario, engine: SimEngine
) -> dict[str, Any]:
    days = scenario.duration_s / 86400.0
    judged = judge_changes(engine, run, scenario.engine.restart_downtime_s)
    out: dict[str, Any] = {
        "goodput": round(run.goodput, 3),
        "ratio_to_oracle": round(run.goodput / oracle, 4) if oracle > 0 else None,
        "ratio_to_dynamic_oracle": round(run.goodput / dynamic, 4) if dynamic > 0 else None,
        "changes": run.changes,
        "restarts": run.restarts,
        "failed_starts": run.failed_starts,
        "rollbacks": run.rollbacks,
        "false_alarms_per_day": round(judged.unwarranted / days, 3),
        "unpaid_restarts": judged.unpaid,
        "downtime_s": round(run.downtime_s, 3),
        "driver": run.driver,
        "config": run.config,
        "final_config": run.timeline[-1][1] if run.timeline else run.config,
        "timeline": [[t, label] for t, label in run.timeline[:TIMELINE_MAX]],
        "timeline_cut": len(run.timeline) > TIMELINE_MAX,
        "timeline_entries": len(run.timeline),
        "wall_s": round(run.wall_s, 3),
        "cpu_s": round(run.cpu_s, 3),
    }
    if scenario.change_at_s is not None:
        out["detection_s"] = run.detection_s
        out["response_s"] = judged.first_response_s
        if run.policy in CONTROLLER:
            out["change_detector_s"] = run.change_detector_s
    if run.policy in CONTROLLER:
        out["detector_alarms_per_day"] = round(run.detector_alarms / days, 3)
        out["detector_false_alarms_per_day"] = round(run.detector_false_alarms / days, 3)
    if run.phases:
        out["phases"] = _phase_goodput(run, scenario)
    if run.ticks:
        out["ticks"] = dict(sorted(run.ticks.items()))
    out["hourly_goodput"] = run.hourly_goodput
    return out


def _phase_goodput(run: PolicyRun, scenario: Scenario) -> dict[str, float]:
    durations: dict[str, float] = {}
    for i, p in enumerate(scenario.load.phases):
        name = p.name or f"phase {i + 1}"
        durations[name] = durations.get(name, 0.0) + p.duration_s  # a name may repeat
    return {name: round(run.phases.get(name, 0.0) / d, 3) for name, d in durations.items()}
