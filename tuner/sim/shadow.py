"""Shadow evidence in the simulator: the draft candidates' α measured on sampled traffic while the engine
runs something else, written where ``spectuner shadow run`` writes it (``tuner.store.shadow``), so the
real controller's draft choice reads it as it would in production. Sampled and noisy: a finite number of
replayed tokens (each verify step drawn from the draft's true α at that time) and an optional per-run
error between replay and serving."""

from __future__ import annotations

from datetime import datetime

import numpy as np

from policies.acceptance import estimate_alpha_from_evidence
from policies.shadow_replay import ReplayResult
from tuner.sim.engine import SimEngine
from tuner.sim.scenario import Scenario, ShadowSection
from tuner.store import Store
from tuner.store.shadow import ShadowResult, write_shadow_result

HEAD_METHODS = frozenset({"eagle", "eagle3"})


class ShadowFeed:
    def __init__(self, scenario: Scenario, section: ShadowSection, engine: SimEngine, rng: np.random.Generator):
        self.scenario = scenario
        self.section = section
        self.engine = engine
        self.rng = rng
        self.next_s = 0.0
        self.runs = 0

    def tick(self, now: datetime, t_s: float, store: Store) -> None:
        """Run the shadow evaluation when its interval is due (``t_s``: seconds into the scenario)."""
        if t_s + 1e-9 < self.next_s:
            return
        self.next_s = t_s + self.section.interval_s
        self.runs += 1
        for d in self.scenario.drafts:
            if d.method in HEAD_METHODS:
                continue  # needs a canary
            alpha = float(self.engine.alpha(d.name, np.array([t_s]))[0])
            alpha = min(max(alpha + self.rng.normal(0.0, self.section.bias_sd) if self.section.bias_sd else alpha,
                            0.0), 0.999)
            replay = self._replay(alpha)
            a, ci = estimate_alpha_from_evidence(replay.evidence)
            write_shadow_result(
                store,
                ShadowResult(d.name, d.method, None, now, replay.samples, replay.output_tokens, self.section.k,
                             replay.evidence, a, ci, False, "simulated", {"simulated_alpha": alpha}),
            )

    def _replay(self, alpha: float) -> ReplayResult:
        k = self.section.k
        accepted: list[int] = []
        tokens = 0
        while tokens < self.section.tokens_per_run:
            # accepted tokens of one step: how many of K i.i.d. Bernoulli(α) succeed before the first failure
            draws = self.rng.random(k) < alpha
            n = int(k if draws.all() else np.argmin(draws))
            accepted.append(n)
            tokens += n + 1
        return ReplayResult(tuple(accepted), (k,) * len(accepted), 1, tokens)
