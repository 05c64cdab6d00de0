"""The closed loop on a real vLLM engine: `spectuner run` (a subprocess) supervises the lab server.

One scenario, in order, because every engine start costs ~1.5 min on 2 cores and each step starts
from where the last one left the engine:

1. The engine starts with the *weak* draft at K = 3; a 16-stream workload measures the fixed starting
   config's throughput at 16 (the baseline of step 5), then one stream runs.
2. (c) Acceptance stays below 0.4; the best-ranked candidate (``broken``: prior α 0.97, a draft path
   with no model) is tried and fails to start.
3. (e) While the daemon restores the weak config, it is killed with SIGKILL. A new daemon closes the
   interrupted apply as a rollback, stops the orphaned engine and serves the last recorded config
   (weak) again; the failed candidate is not tried again.
4. (a) Acceptance still stays low; the daemon swaps to ``good`` (with a per-batch-size table) — one
   successful swap, within a bounded time.
5. (d) A stationary stream: no change after the swap. (b) Concurrency 1 → 16 → 1: the table in
   force drafts at 1 stream and never more at 16 than alone (its throughput against the fixed starting
   config is printed, not asserted: that is a benchmark's, bench/bench_live.py). (With good's α ≈ 0.9
   the lab's step cost gives K = 1 at every batch size: a table's K = 0 still runs the draft's pass,
   which costs more at 16 streams than verifying one drafted token. Before that pass was counted the
   table was K = 1 alone, K = 0 from 2.)
Every engine restart shows in the store as a counter reset (the collector's restart handling, live),
and the draft ladder straddles the 0.4 threshold (weak's upper bound below it, good's α̂ far above).
These two checks replace the separate engine starts that used to test them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from policies.acceptance import effective_counters, estimate_alpha_from_evidence, pool_evidence
from tuner.engine.process import group_alive
from tuner.lab.closed_loop import LoopSettings, lab_daemon_config
from tuner.lab.models import Manifest
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.lab.serve import LabServer, speculative_config
from tuner.lab.workload import BackgroundLoad
from tuner.store import DecisionStatus, Store, StoredDecision, upgrade

from .conftest import MODELS_DIR

PROMPTS = tuple(p for pair in zip(PREDICTABLE, HARD, strict=False) for p in pair)  # easy and hard alternate
ROOT = Path(__file__).resolve().parents[2]
ENGINE_START_S = 420.0  # generous: a start takes 75–180 s on 2 busy cores


def start_daemon(config: Path, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SPECTUNER_LOG": "INFO", "PYTHONPATH": str(ROOT)}
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tuner.cli.main", "run", "--config", str(config)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode} while waiting for {what}:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}:\n{log.read_text()[-4000:]}")


def healthy(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def changes(store: Store) -> list[StoredDecision]:
    return [d for d in store.decisions() if d.decision.action == "change" and d.status != DecisionStatus.BLOCKED]


def applied(store: Store) -> list[StoredDecision]:
    return [d for d in changes(store) if d.status in (DecisionStatus.APPLIED, DecisionStatus.VERIFIED)]


def drafted_per_token(store: Store, since: Any) -> list[tuple[datetime, datetime, float]]:
    """(start, end, drafted tokens per generated token) of every window since ``since``.

    Not drafted tokens per draft: that is 1.0 for a window holding a single step at batch 1 (the table's
    K = 1) among hundreds at batch 16 drafting nothing — and 16 closed-loop requests of equal length end
    and restart together, so such steps are common. Per generated token, K = 1 alone gives ~0.5, K = 0
    at 16 streams ~0."""
    out = []
    for e in store.engines():
        for w in store.windows(e.key, since=since):
            if w.generation_tokens <= 0:
                continue
            drafted = w.spec.draft_tokens if w.spec is not None else 0.0
            start, end = (t if t.tzinfo else t.replace(tzinfo=UTC) for t in (w.start, w.end))
            out.append((start, end, drafted / w.generation_tokens))
    return out


@pytest.mark.timeout(1800)
def test_weak_draft_failed_candidate_crash_swap_and_table(lab_models: Manifest, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db_url)
    server = LabServer(draft="weak", k=3, models_dir=MODELS_DIR, workdir=tmp_path / "engine")
    assert server.workdir is not None
    server.workdir.mkdir(parents=True)
    server.tmp_dir.mkdir(parents=True, exist_ok=True)
    # A candidate whose directory exists (the sidecar's start checks refuse a missing path up front) but
    # holds no loadable model: its weights file is garbage, so the engine fails to start with it.
    broken = tmp_path / "broken-draft"
    weak_model = speculative_config(lab_models, "weak", 3)
    assert weak_model is not None
    shutil.copytree(weak_model["model"], broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    settings = LoopSettings(
        candidates=("good",),
        broken_candidate=str(broken),
        per_batch_size=True,
        k_max=3,
        swap_duration_s=30.0,
        swap_min_drafts=120,
        cooldown_s=20.0,
    )
    config = tmp_path / "spectuner.toml"
    config.write_text(lab_daemon_config(server, db_url, settings))
    log = tmp_path / "daemon.log"
    pid_file = server.log_path.with_name(server.log_path.name + ".pid")
    proc = start_daemon(config, log)
    load = BackgroundLoad(server.base_url, server.model_name, max_tokens=32)
    try:
        with Store(db_url) as store:
            # 1. the fixed starting config (weak, K = 3) at 16 streams, then 1 stream
            wait_for("the engine (weak, K=3)", lambda: healthy(server.base_url), ENGINE_START_S, proc, log)
            load.set_phase("fixed start, 16 streams", PROMPTS, 16)
            time.sleep(20)
            load.set_phase("weak, 1 stream", PROMPTS, 1)
            fixed16 = load.phases[0]

            # 2. the broken candidate is tried first and fails to start
            def broken_failed() -> StoredDecision | None:
                for d in store.decisions(status=DecisionStatus.APPLYING):
                    if "broken-draft" in str(d.decision.proposed_config) and (d.status_message or "").startswith(
                        "start_failed"
                    ):
                        return d
                return None

            attempt = wait_for("the broken candidate failing to start", broken_failed, 240 + ENGINE_START_S, proc, log)
            assert attempt.decision.reason == "swap_draft"
            assert attempt.decision.inputs["policy"]["trigger"]["upper"] < 0.4  # α̂ stayed below 0.4

            # 3. SIGKILL while the weak config is being restored; a new daemon finishes the rollback
            proc.kill()
            proc.wait()
            orphan = int(pid_file.read_text())
            proc = start_daemon(config, log)
            wait_for("the engine back (weak)", lambda: healthy(server.base_url), ENGINE_START_S, proc, log)
            assert not group_alive(orphan) or orphan == int(pid_file.read_text())
            closed = store.decision(attempt.id)
            assert closed.status == DecisionStatus.ROLLED_BACK, closed.status_message
            kinds = [e.kind for e in store.events()]
            assert "apply_rolled_back" in kinds and "apply_interrupted" in kinds
            assert not store.decisions(status=DecisionStatus.APPLYING)
            current = store.current_config(store.engines()[0].key)
            assert current is not None and "draft-weak" in str(current.config.draft_model)

            # 4. acceptance still low: one swap, to good, within a bounded time
            t_swap = time.monotonic()
            swap = wait_for(
                "the swap to good",
                lambda: [d for d in applied(store) if "draft-good" in str(d.decision.proposed_config)],
                240 + ENGINE_START_S,
                proc,
                log,
            )[0]
            swap_s = time.monotonic() - t_swap
            assert swap.decision.predicted_gain is not None and swap.decision.predicted_gain > 1.03
            table = swap.decision.proposed_config["num_speculative_tokens_per_batch_size"]
            assert table[0][2] >= 1 and table[-1][2] <= table[0][2], table  # drafts alone, no more at 16
            assert not any("broken-draft" in str(d.decision.proposed_config) for d in changes(store)[1:])
            wait_for("the engine (good)", lambda: healthy(server.base_url), 60, proc, log)

            # 5. (d) stationary 1 stream: nothing changes; (b) 1 → 16 → 1 with the table in force
            swapped_at = swap.updated_at
            time.sleep(settings.cooldown_s + 25)
            busy_from = datetime.now(UTC)
            load.set_phase("good + table, 16 streams", PROMPTS, 16)
            time.sleep(30)
            busy_until = datetime.now(UTC)
            load.set_phase("good + table, back to 1 stream", PROMPTS, 1)
            time.sleep(20)
            stats = load.stop()
            table16 = next(p for p in stats if p.phase == "good + table, 16 streams")
            steps = drafted_per_token(store, swapped_at + timedelta(seconds=5))
            # Windows by when they ran, not by the running-requests gauge: that is sampled at one instant,
            # and on a starved box a closed-loop client's next request is often not yet sent then.
            ramp = timedelta(seconds=5)
            busy = sorted(k for a, b, k in steps if a >= busy_from + ramp and b <= busy_until)
            alone = sorted(k for a, b, k in steps if b <= busy_from or a >= busy_until + ramp)
            print(  # the figures for the notes (pytest -s)
                f"\nswap after {swap_s:.0f} s of trying; fixed start at 16 streams {fixed16.tokens_per_s:.0f} tok/s, "
                f"good + table at 16 streams {table16.tokens_per_s:.0f} tok/s; table {table}; "
                "drafted per generated token: "
                f"alone {[round(x, 3) for x in alone]}, busy {[round(x, 3) for x in busy]}"
            )
            later = [d for d in applied(store) if d.id != swap.id and d.decision.created_at > swapped_at]
            assert later == [], [d.decision.message for d in later]
            assert len([d for d in applied(store) if d.decision.reason == "swap_draft"]) == 1
            # No throughput comparison here: two 30 s phases minutes apart on a loaded 2-core box differ by
            # ±20 % whatever the config (320 against 385 tok/s under two busy loops); the speed-up is measured
            # side by side in bench/bench_live.py. The test checks what the engine does: the table below.
            # the engine drafts as the table says: at one stream, and per generated token no more at 16
            # than alone (K = 1: ~0.5 drafted per generated token; K = 0: ~0). Windows spanning a change of
            # phase are left out; medians all the same.
            assert alone and busy and alone[len(alone) // 2] > 0.3, steps
            at_16 = next(k for lo, hi, k in table if lo <= 16 <= hi)
            limit = 0.1 if at_16 == 0 else alone[len(alone) // 2] * 1.15
            assert busy[len(busy) // 2] <= limit, (table, steps)
            resets = [e for e in store.events() if e.kind == "counter_reset"]
            assert len(resets) >= 2  # the restarts, seen by the collector as counter resets
            # the ladder straddles 0.4: weak's upper bound was below it (step 2), good's α̂ is far above
            good = pool_evidence([c for e in store.engines() for w in store.windows(e.key, since=swapped_at)
                                  if w.spec is not None and (c := effective_counters(w.spec)) is not None]).evidence
            assert good is not None and good.trials > 500
            alpha_good, ci_good = estimate_alpha_from_evidence(good)
            assert alpha_good is not None and ci_good is not None and ci_good[0] > 0.8, (alpha_good, ci_good)
            assert ci_good[0] > attempt.decision.inputs["policy"]["trigger"]["upper"] + 0.4
    finally:
        load.stop()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        with contextlib.suppress(OSError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
