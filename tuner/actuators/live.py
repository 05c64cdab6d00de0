"""Apply K (or a per-batch-size K table) inside the running engine, without a restart.

The engine runs our vLLM plugin (``collectors/vllm_plugin``): its engine-core process listens on a
token-authenticated control channel and swaps the scheduler's per-batch-size K lookup. This actuator:

1. decides whether the change is live-able (:meth:`LiveActuator.plan`): the same method and draft
   (only ``num_speculative_tokens`` / ``num_speculative_tokens_per_batch_size`` differ), every K of
   the resulting table ≤ the engine's K_max and one the engine can run, the channel reachable and
   answering "supported" (every live-K internal detected in its vLLM, engine started with a table);
2. if so, sets the table, checks the read-back, and verifies in the per-step stream (the plugin's
   steps, via :class:`collectors.step_ingest.StepFeed`) that steps now draft the new K for their batch
   size; a change the stream contradicts is undone and the engine is marked as not live-capable;
3. otherwise — or when verification fails — delegates to the fallback actuator (normally the restart
   actuator) with the *engine* config: the same draft started at K_max with the requested table, so
   that the next K change can be live again.

Every result is a :class:`LiveApplyResult` saying which path was taken (``path``) and why it fell back
(``fallback_reason``).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collectors.records import EngineKey
from collectors.step_ingest import StepFeed, StepRecord, drafted_k
from collectors.vllm_plugin import env as plugin_vars
from collectors.vllm_plugin.client import ControlClient, ControlError
from collectors.vllm_plugin.protocol import ControlState, k_for_batch
from policies.spec_config import K_KEYS, SpecConfig
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec, config_fingerprint

log = logging.getLogger(__name__)

_OPEN_END = 1 << 16  # a plain K becomes one row [1, _OPEN_END, K]; vLLM clips rows at max_num_seqs


@dataclass(frozen=True)
class LiveApplyResult(ApplyResult):
    path: str = "live"  # "live", or the fallback actuator's kind ("restart", "command", ...)
    fallback_reason: str = ""  # why the live path was not taken (empty on the live path)
    verified: str = ""  # live path: "stream" (steps at the new K seen), "read_back" (engine confirms, no steps yet)
    # Live path: decision → the first step at the new K (its stats' arrival time in vLLM's API server), and
    # decision → the sidecar holding enough steps to call the change verified.
    decision_to_first_step_s: float | None = None
    decision_to_verified_s: float | None = None


def effective_table(config: VllmSpec) -> list[list[int]] | None:
    """The per-batch-size K table a config asks for (a plain K is one open-ended row); vLLM caps each
    row's K at the config's K (``SpecConfig.effective_table``). None for a config without speculation."""
    rows = SpecConfig.from_vllm(config).effective_table(_OPEN_END)
    return [list(row) for row in rows] if rows is not None else None


def _without_k(config: VllmSpec | None) -> str:
    return config_fingerprint({key: v for key, v in (config or {}).items() if key not in K_KEYS})


@dataclass
class _Evidence:
    """What the step stream says about a change, step by step."""

    new: int = 0  # steps that drafted the new K (≠ the old K) for their batch size
    old: int = 0  # steps that still drafted the old K (≠ the new K)
    zero_run: int = 0  # consecutive decode steps with no drafts where the new K is 0
    informative: int = 0  # steps at a batch size whose K changed
    first_new_wall: float | None = None  # Unix time of the first step at the new K (the step's own timestamp)
    verified_at: float | None = None  # monotonic time the evidence was complete
    # each engine's previous step's batch size: the K a step verifies was looked up at that one (below)
    last_batch: dict[EngineKey, int] = field(default_factory=dict)


class LiveActuator(Actuator):
    """Live K through the plugin's control channel; anything else through ``fallback``."""

    kind = "live"
    needs_restart = False

    def __init__(
        self,
        control: ControlClient,
        fallback: Actuator,
        *,
        feed: StepFeed | None = None,
        k_max: int | None = None,
        verify_timeout_s: float = 5.0,
        min_evidence_steps: int = 2,
        zero_k_evidence_steps: int = 3,
        k0_pass_skipped: bool | None = None,
        k0_prompt_pass_skipped: bool = False,
    ) -> None:
        super().__init__()
        if verify_timeout_s <= 0:
            raise ValueError(f"verify_timeout_s must be positive but got {verify_timeout_s}")
        if min_evidence_steps < 1 or zero_k_evidence_steps < 1:
            raise ValueError(
                f"evidence step counts must be at least 1 but got {min_evidence_steps}, {zero_k_evidence_steps}"
            )
        if k_max is not None and k_max < 0:
            raise ValueError(f"k_max cannot be negative but got {k_max}")
        self.control = control
        self.fallback = fallback
        self.feed = feed
        self.k_max = k_max
        self.verify_timeout_s = verify_timeout_s
        self.min_evidence_steps = min_evidence_steps
        self.zero_k_evidence_steps = zero_k_evidence_steps
        # Engine processes (by pid) where a live change did not show in the stream: never again there.
        self._not_live: dict[int, str] = {}
        # The plugin's detected features from the engine's last answer (ControlState.features): when its
        # vLLM lacks live K's internals, restarts start exactly the requested config (no K_max + table).
        self._engine_features: dict[str, bool] = {}
        # ``[plugin] skip_draft_pass_at_k0`` as configured (None: not checked). The controller prices a table's
        # K = 0 on the config's word; an engine that says otherwise is named once per engine process.
        self.k0_pass_skipped = k0_pass_skipped
        self.k0_prompt_pass_skipped = k0_prompt_pass_skipped  # ``[plugin] skip_draft_pass_at_k0_prompts``
        self._k0_mismatch_named: set[int] = set()

    def _check_k0_pass(self, state: ControlState) -> None:
        if self.k0_pass_skipped is None or state.pid in self._k0_mismatch_named:
            return
        if (state.k0_draft_pass == "skipped") == self.k0_pass_skipped:
            # the prompt steps: only once the engine has seen one ("unknown" before), and only one way
            # (an engine that skips them unasked is still priced safely: its K = 0 costs less than priced)
            if self.k0_pass_skipped and self.k0_prompt_pass_skipped and state.k0_prompt_pass == "runs":
                self._k0_mismatch_named.add(state.pid)
                log.warning(
                    "live actuator: [plugin] skip_draft_pass_at_k0_prompts is true but the engine (pid %d) keeps the "
                    "draft's pass in K = 0 steps with a prompt (it runs with prefix caching, or was not started with "
                    "%s=all), so a K table's K = 0 rows cost more than the controller thinks; start it with "
                    "--no-enable-prefix-caching and %s=all, or set the key to false",
                    state.pid,
                    plugin_vars.SKIP_K0_DRAFT_PASS,
                    plugin_vars.SKIP_K0_DRAFT_PASS,
                )
            return
        self._k0_mismatch_named.add(state.pid)
        if self.k0_pass_skipped:
            log.warning(
                "live actuator: [plugin] skip_draft_pass_at_k0 is true but the engine (pid %d) runs the draft's pass "
                "at K = 0, so a K table's K = 0 rows cost more than the controller thinks; start the engine with "
                "%s=1 (the daemon does when it starts the engine) or set the key to false",
                state.pid,
                plugin_vars.SKIP_K0_DRAFT_PASS,
            )
        else:
            log.warning(
                "live actuator: the engine (pid %d) skips the draft's pass at K = 0 (%s) but [plugin] "
                "skip_draft_pass_at_k0 is false, so the controller overprices a K table's K = 0 rows; set the key "
                "to true",
                state.pid,
                plugin_vars.SKIP_K0_DRAFT_PASS,
            )

    # -- planning --------------------------------------------------------------------------------
    def plan(self, config: VllmSpec) -> tuple[list[list[int]] | None, ControlState | None, str]:
        """(table, engine state, "") when ``config`` can be applied live, else (None, state?, reason)."""
        if self.current is None:
            return None, None, "the config in force is not known yet"
        if _without_k(config) != _without_k(self.current):
            changed = sorted(
                key
                for key in set(config) | set(self.current)
                if key not in K_KEYS and config.get(key) != self.current.get(key)
            )
            return None, None, f"more than K changes ({', '.join(changed)}): that needs a restart"
        table = effective_table(config)
        if table is None:
            return None, None, "speculation is off in the requested config"
        try:
            state = self.control.get()
        except ControlError as exc:
            return None, None, f"control channel: {exc}"
        self._engine_features = dict(state.features)
        self._check_k0_pass(state)
        if not state.supported:
            return None, state, f"live K unsupported by the engine: {state.reason}"
        if state.pid in self._not_live:
            return None, state, self._not_live[state.pid]
        for row in table:
            if row[2] > state.k_max:
                return None, state, f"K={row[2]} is above the K_max={state.k_max} the engine started with"
            if row[2] not in state.allowed_k:
                return None, state, f"K={row[2]} is not one the engine can run live ({state.allowed_k})"
        return table, state, ""

    def needs_restart_for(self, config: VllmSpec) -> bool:
        """Whether applying ``config`` would go through the fallback (for the switching-cost rail)."""
        table, _, _ = self.plan(config)
        return table is None

    def engine_config(self, config: VllmSpec, state: ControlState | None = None) -> VllmSpec:
        """What the fallback starts: the requested draft at K_max with the requested table, so the
        engine stays live-capable. Configs without speculation pass unchanged."""
        table = effective_table(config)
        if table is None:
            return dict(config)
        features = state.features if state is not None and state.features else self._engine_features
        if not (features.get("k_table", True) and features.get("live_k", True)):
            return dict(config)  # this vLLM can never change K live: start exactly what was asked
        k_max = max([self.k_max or 0, state.k_max if state else 0, *(row[2] for row in table)])
        if k_max == 0:
            return dict(config)  # vLLM needs num_speculative_tokens > 0 for a table
        end = state.max_num_seqs if state and state.max_num_seqs else None
        rows = [[lo, min(hi, end) if end and lo <= end else hi, k] for lo, hi, k in table]
        return {**config, "num_speculative_tokens": k_max, "num_speculative_tokens_per_batch_size": rows}

    # -- the Actuator interface ------------------------------------------------------------------
    def start(self, config: VllmSpec) -> ApplyResult:
        self.fallback.progress = self.progress
        result = self.fallback.start(self.engine_config(config))
        if result.ok:
            self.current = dict(config)
        return result

    def ensure_running(self) -> ApplyResult | None:
        return self.fallback.ensure_running()

    def stop(self) -> None:
        self.fallback.stop()

    def apply(self, config: VllmSpec) -> ApplyResult:
        unchanged = self._unchanged(config)
        if unchanged:
            return unchanged
        table, state, reason = self.plan(config)
        if table is None or state is None:
            return self._fall_back(config, state, reason)
        return self._apply_live(config, table, state)

    # -- the live path ---------------------------------------------------------------------------
    def _apply_live(self, config: VllmSpec, table: list[list[int]], before: ControlState) -> ApplyResult:
        sub = self.feed.subscribe() if self.feed is not None else None
        t0, t0_wall = time.monotonic(), time.time()
        try:
            try:
                after = self.control.set_table(table)
            except ControlError as exc:
                if exc.code == "invalid_table":
                    return LiveApplyResult(
                        ApplyStatus.ROLLED_BACK,
                        f"the engine refused the K table {table}: {exc}; the previous config stays in force",
                        self.current,
                        0.0,
                        path="live",
                    )
                return self._fall_back(config, before, f"control channel: {exc}")
            set_s = time.monotonic() - t0
            mismatch = self._read_back_mismatch(table, after)
            if mismatch:
                self._restore(before)
                return self._fall_back(config, before, f"read-back differs from the request: {mismatch}")
            if sub is None:
                self.current = dict(config)
                return LiveApplyResult(
                    ApplyStatus.APPLIED,
                    f"K table {after.table} set live in {set_s * 1000:.0f} ms (read back; no step stream to verify)",
                    self.current,
                    0.0,
                    path="live",
                    verified="read_back",
                )
            ev = self._watch(sub, table, before.table, after.max_num_seqs)
        finally:
            if sub is not None:
                sub.close()
        first_s = None if ev.first_new_wall is None else max(0.0, ev.first_new_wall - t0_wall)
        verified_s = None if ev.verified_at is None else ev.verified_at - t0
        verified = ev.verified_at is not None
        # a fallback restarts the engine: one odd step (a stream the batch changes under, a step in flight when
        # the table changed) must not send a change there; several old-K steps and no new one do
        if not verified and ev.old > self.min_evidence_steps and ev.new == 0:
            why = (
                f"after the live change to {table}, {ev.old} step(s) still drafted the old K and none the new "
                f"one within {self.verify_timeout_s:g} s: live K does not take effect on this engine"
            )
            log.warning("live actuator: %s; restoring %s and falling back", why, before.table)
            self._not_live[before.pid] = why
            self._restore(before)
            return self._fall_back(config, before, why)
        self.current = dict(config)
        if verified or ev.new > 0:
            how, note = "stream", (
                f"; first step at the new K {first_s * 1000:.0f} ms after the decision" if first_s is not None else ""
            )
        else:
            how, note = "read_back", (
                "; not yet seen in the step stream (no steps at the changed batch sizes)"
                if ev.informative == 0
                else "; the step stream is not conclusive yet"
            )
        log.info("live actuator: K table %s in force (%s)%s", after.table, how, note)
        return LiveApplyResult(
            ApplyStatus.APPLIED,
            f"K table {after.table} set live in {set_s * 1000:.0f} ms, no restart{note}",
            self.current,
            0.0,
            path="live",
            verified=how,
            decision_to_first_step_s=first_s,
            decision_to_verified_s=verified_s,
        )

    def _read_back_mismatch(self, table: list[list[int]], after: ControlState) -> str:
        for batch_size in range(1, max(after.max_num_seqs, 1) + 1):
            want, got = k_for_batch(table, batch_size), k_for_batch(after.table, batch_size)
            if want != got:
                return f"batch size {batch_size}: asked K={want}, engine uses K={got}"
        return ""

    def _watch(self, sub: Any, table: list[list[int]], old_table: list[list[int]], max_num_seqs: int) -> _Evidence:
        ev = _Evidence()
        deadline = time.monotonic() + self.verify_timeout_s
        while time.monotonic() < deadline:
            steps: list[StepRecord] = sub.get(max(0.0, deadline - time.monotonic()))
            for step in steps:
                self._judge(ev, step, table, old_table, max_num_seqs)
            if ev.new >= self.min_evidence_steps or ev.zero_run >= self.zero_k_evidence_steps:
                ev.verified_at = time.monotonic()
                break
        return ev

    @staticmethod
    def _judge(ev: _Evidence, step: StepRecord, table: list[list[int]], old_table: list[list[int]], max_b: int) -> None:
        # vLLM's scheduler looks K up at a step's batch size and drafts that many tokens in the step; the
        # next step verifies them. So a step's drafted K belongs to the previous step's batch size (of the
        # same engine): judged at its own, a step after requests finished (16 → 12) reads as the old K at 12.
        proposed_at = ev.last_batch.get(step.key)
        ev.last_batch[step.key] = step.batch_size
        if proposed_at is None:
            return  # the first step seen: the batch its drafts were chosen at is unknown
        b = min(max(proposed_at, 1), max_b) if max_b else max(proposed_at, 1)
        new_k, old_k = k_for_batch(table, b), k_for_batch(old_table, b)
        if new_k is None or new_k == old_k:
            return  # this batch size's K did not change: the step says nothing about the change
        ev.informative += 1
        k = drafted_k(step)
        if new_k == 0:
            if step.spec.drafts == 0 and step.spec.generated_tokens > 0:
                ev.zero_run += 1
                if ev.first_new_wall is None:
                    ev.first_new_wall = step.ts.timestamp()
            else:
                ev.zero_run = 0
                ev.first_new_wall = None  # a drafted step after "zero" ones: those were prefill steps
                if k == old_k:
                    ev.old += 1
            return
        if k == new_k:
            ev.new += 1
            if ev.first_new_wall is None:
                ev.first_new_wall = step.ts.timestamp()
        elif k == old_k and k > 0:
            ev.old += 1

    def _restore(self, before: ControlState) -> None:
        try:
            self.control.set_table(before.table)
        except ControlError as exc:
            log.warning("live actuator: could not restore the K table %s (%s)", before.table, exc)

    # -- the fallback path -----------------------------------------------------------------------
    def _fall_back(self, config: VllmSpec, state: ControlState | None, reason: str) -> ApplyResult:
        if state is None:
            try:  # best effort: the engine's K_max and max_num_seqs shape the config it restarts with
                state = self.control.get()
            except ControlError:
                state = None
        engine_cfg = self.engine_config(config, state)
        log.info("live actuator: %s; applying through the %s actuator", reason, self.fallback.kind)
        self.fallback.progress = self.progress  # the controller's audit notes reach through the delegation
        result = self.fallback.apply(engine_cfg)
        if result.ok:
            self.current = dict(config)
            in_force: VllmSpec | None = self.current
        elif result.status is ApplyStatus.ROLLED_BACK or result.config is not None:
            in_force = self.current  # the fallback kept (or restored) what was in force
        else:
            in_force = None
            self.current = None
        return LiveApplyResult(
            result.status,
            f"not live ({reason}); {self.fallback.kind} actuator: {result.message}",
            in_force,
            result.downtime_s,
            result.detail,
            path=self.fallback.kind,
            fallback_reason=reason,
        )


def load_or_create_token(path: Path, create: bool) -> str:
    """The shared plugin token from ``path``; with ``create``, a new random one written 0600 when the
    file does not exist (the sidecar starts the engine and hands it the same file)."""
    if not create and not path.exists():
        raise ValueError(
            f"plugin token file {path} does not exist; write a random secret there and give the engine the "
            f"same file (SPECTUNER_PLUGIN_TOKEN_FILE={path})"
        )
    return load_or_create_secret(path, "plugin token file", "put a random secret in it")


def load_or_create_secret(path: Path, what: str, fix_empty: str) -> str:
    """The secret in ``path``; a new random one written 0600 when the file does not exist. An empty
    file is an error (``what`` and ``fix_empty`` word it): an empty secret would let anyone in."""
    try:
        token = path.read_text().strip()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        return token
    if not token:
        raise ValueError(f"{what} {path} is empty; {fix_empty}")
    return token


def shared_plugin_token(path: Path, *, ingest: bool, control: bool, sidecar_starts_engine: bool) -> str | None:
    """The token the plugin and the sidecar share (``[plugin] token_file``); None when neither the
    ingest endpoint nor the control channel is configured.

    The ingest endpoint always needs one: when it listens, a missing file is created (0600, a random
    secret) for the plugin to read through ``SPECTUNER_PLUGIN_TOKEN_FILE``. The control channel alone
    creates it only when the sidecar starts the engine. An empty or unreadable file raises ``ValueError``.
    """
    if not (ingest or control):
        return None
    try:
        return load_or_create_token(path, create=ingest or sidecar_starts_engine)
    except OSError as exc:
        raise ValueError(f"cannot read or create plugin token file {path}: {exc}") from None


def plugin_env(
    *,
    ingest_url: str | None,
    control_address: str | None,
    token_file: Path | None,
    skip_k0_draft_pass: bool = False,
    skip_k0_prompt_pass: bool = False,
) -> dict[str, str]:
    """Environment for an engine the sidecar starts, so the plugin inside it finds the sidecar.
    ``skip_k0_prompt_pass`` widens ``skip_k0_draft_pass`` to steps with a prompt (``all``)."""
    env: dict[str, str] = {}
    if skip_k0_draft_pass:
        env[plugin_vars.SKIP_K0_DRAFT_PASS] = "all" if skip_k0_prompt_pass else "1"
    if ingest_url:
        env[plugin_vars.INGEST_URL] = ingest_url
    if control_address:
        env[plugin_vars.CONTROL_ADDR] = control_address
    if token_file is not None:
        env[plugin_vars.TOKEN_FILE] = str(token_file)
    return env
