"""Shadow evidence in the simulator: the draft candidates' α measured on sampled traffic while the engine
runs something else, written where ``spectuner shadow run`` writes it (``tuner.store.shadow``), so the
real controller's draft choice reads it as it would in production. Sampled and noisy: a finite number of
replayed tokens (each verify step drawn from the draft's true α at that time) and an optional per-run
error between replay and serving."""

from __future__ import annotations

import math
from datetime import datetime

import numpy as np
from numpy.typing import NDArray

from policies.acceptance import estimate_alpha_from_evidence
from policies.shadow_replay import ReplayResult
from policies.shadow_schedule import ShadowSchedule, after_run, shadow_due
from tuner.sim.engine import SimEngine
from tuner.sim.scenario import Scenario, ShadowSection
from tuner.store import Store
from tuner.store.shadow import ShadowResult, write_shadow_result

HEAD_METHODS = frozenset({"eagle", "eagle3"})


class ShadowFeed:
    """Runs as the daemon's shadow job does: an interval job whose first firing is one ``interval_s`` after
    the start; a firing runs a replay when ``policies.shadow_schedule`` says one is due (the wait doubles
    while runs agree, up to ``interval_max_s``; the traffic moving runs one at once; every run within the
    ``max_machine_share`` budget), and each run's evidence is stored ``run_s`` after it starts (the replay
    takes that long)."""

    def __init__(self, scenario: Scenario, section: ShadowSection, engine: SimEngine, rng: np.random.Generator):
        self.scenario = scenario
        self.section = section
        self.engine = engine
        self.rng = rng
        self.next_s = section.interval_s
        self.runs = 0
        self.schedule = ShadowSchedule.configured(
            section.interval_s, section.interval_max_s, section.max_machine_share
        )
        self._landing: list[tuple[float, ShadowResult]] = []
        self._began: datetime | None = None
        self._busy: list[tuple[float, float]] = []  # (start s, end s) of each run's replay

    def cpu_taken(self, starts_s: NDArray[np.float64], ends_s: NDArray[np.float64]) -> NDArray[np.float64]:
        """Per window, the share of the machine the replays running in it took (``[shadow] cpu_share`` × the
        share of the window a replay ran). A run begun later is not known yet: the windows are drawn up to
        the tick that may begin one, and a run begins at a tick, so it starts after them."""
        taken = np.zeros(len(starts_s))
        if self.section.cpu_share <= 0:
            return taken
        length = np.maximum(ends_s - starts_s, 1e-9)
        for began, ended in self._busy:
            overlap = np.clip(np.minimum(ends_s, ended) - np.maximum(starts_s, began), 0.0, None)
            taken += self.section.cpu_share * overlap / length
        return taken

    def tick(self, now: datetime, t_s: float, store: Store, traffic_moved_at: datetime | None = None) -> None:
        """Run the shadow evaluation when its interval fires and a run is due, and store the runs that have
        finished (``t_s``: seconds into the scenario; ``traffic_moved_at``: the controller's
        ``ControllerMemory.alpha_moved_at``)."""
        if t_s + 1e-9 >= self.next_s:
            # a run still going when the interval fires again skips that firing (max_instances = 1 in
            # the daemon's scheduler): the next run is the first firing after this one ends
            every = self.section.interval_s
            names = [d.name for d in self.scenario.drafts if d.method not in HEAD_METHODS]
            if shadow_due(self.schedule, now, names, traffic_moved_at).due:
                self.next_s = t_s + every * max(1, math.ceil(self.section.run_s / every - 1e-9))
                self.runs += 1
                self._began = now
                self._busy = [(b, e) for b, e in self._busy if e > t_s] + [(t_s, t_s + self.section.run_s)]
                self._landing += [(t_s + self.section.run_s, r) for r in self._evaluate(now, t_s)]
            else:
                self.next_s = t_s + every
        due = [r for at_s, r in self._landing if at_s <= t_s + 1e-9]
        self._landing = [(at_s, r) for at_s, r in self._landing if at_s > t_s + 1e-9]
        for r in due:
            write_shadow_result(store, r)
        if due and self._began is not None:
            results = {r.candidate: (r.alpha, *r.alpha_ci) if r.alpha is not None and r.alpha_ci else None
                       for r in due}
            cost = self.section.cpu_share * self.section.run_s  # machine-seconds, as the daemon charges cpu_s ÷ CPUs
            self.schedule = after_run(self.schedule, self._began, results, cost)

    def _evaluate(self, now: datetime, t_s: float) -> list[ShadowResult]:
        results = []
        # one error for the run, shared by every draft: they replay the same recorded requests, whose mix is
        # what moves a replay off serving (live: good and medium moved together, 0.955-0.989 and 0.930-0.968
        # over five replays of the predictable prompts, good − medium 0.016-0.025)
        shift = self.rng.normal(0.0, self.section.bias_sd) if self.section.bias_sd else 0.0
        for d in self.scenario.drafts:
            if d.method in HEAD_METHODS:
                continue  # needs a canary
            alpha = min(max(float(self.engine.alpha(d.name, np.array([t_s]))[0]) + shift, 0.0), 0.999)
            replay = self._replay(alpha, d.proposal_share)
            a, ci = estimate_alpha_from_evidence(replay.evidence)
            results.append(ShadowResult(d.name, d.method, None, now, replay.samples, replay.output_tokens,
                                        self.section.k, replay.evidence, a, ci, False, "simulated",
                                        {"simulated_alpha": alpha}))
        return results

    def _replay(self, alpha: float, share: float = 1.0) -> ReplayResult:
        k = self.section.k
        accepted: list[int] = []
        tokens = 0
        while tokens < self.section.tokens_per_run:
            if share < 1.0 and self.rng.random() >= share:
                tokens += 1  # the lookup found no match: the target decodes one token alone
                continue
            # accepted tokens of one step: how many of K i.i.d. Bernoulli(α) succeed before the first failure
            draws = self.rng.random(k) < alpha
            n = int(k if draws.all() else np.argmin(draws))
            accepted.append(n)
            tokens += n + 1
        # one sample whose first token came from the prefill, as a recorded request's
        return ReplayResult(tuple(accepted), (k,) * len(accepted), 1, tokens + 1)
