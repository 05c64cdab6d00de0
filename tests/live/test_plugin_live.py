"""The spectuner vLLM plugin inside a real lab engine (CPU): per-step stats and live K.

One engine for the whole module (started at K_max=5 with a per-batch-size table, the plugin's
environment set), one ingest server writing to a real SQLite store. Checks, in order:

1. the per-step records add up to the engine's own /metrics totals (read with a plain line scan);
2. K changes 5 → 2 → 0 → 4 through the live actuator take effect on the next steps (seen in the step
   stream), never touching the fallback, and greedy output stays identical. The reference is the
   output at K=0 set live on the same engine: with no draft tokens vLLM decodes exactly as without
   speculation, and a second engine start for a no-speculation reference would cost ~100 s of CI;
3. a wrong token is refused and counted, and changes nothing;
4. with the sidecar down the engine serves every request as before; the plugin's drops are counted
   and reported when the sidecar is back.
"""

from __future__ import annotations

import re
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from collectors.records import EngineKey
from collectors.step_ingest import StepFeed, StepIngestServer, drafted_k
from collectors.vllm_plugin import env
from collectors.vllm_plugin.client import ControlClient, ControlError
from tests.live.conftest import MODELS_DIR
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec
from tuner.actuators.live import LiveActuator, LiveApplyResult
from tuner.lab.load import run_load
from tuner.lab.models import Manifest
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.lab.serve import LabServer
from tuner.store import Store, upgrade

K_MAX = 5
PROMPTS = [*PREDICTABLE[:6], *HARD[:2]]


@dataclass
class Rig:
    server: LabServer
    store: Store
    ingest: StepIngestServer
    feed: StepFeed
    token: str
    control_addr: str
    key: EngineKey

    def restart_ingest(self) -> None:
        self.ingest = StepIngestServer(
            self.store, self.server.metrics_url, port=self.ingest.port, token=self.token, feed=self.feed
        ).start()


@contextmanager
def plugin_rig(server: LabServer, work: Path) -> Iterator[Rig]:
    """Start ``server`` (not yet started) with the plugin pointed at a fresh ingest server on a real
    SQLite store and a token-protected control socket; everything is stopped on exit."""
    url = f"sqlite:///{work / 'steps.db'}"
    upgrade(url)
    store = Store(url)
    token = secrets.token_urlsafe(16)
    token_file = work / "plugin.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    feed = StepFeed()
    sock_dir = Path(tempfile.mkdtemp(prefix="spt-"))  # AF_UNIX paths must stay short
    control_addr = f"unix:{sock_dir / 'ctl.sock'}"
    ingest = StepIngestServer(store, server.metrics_url, token=token, feed=feed).start()
    server.extra_env.update(
        {env.INGEST_URL: ingest.url, env.CONTROL_ADDR: control_addr, env.TOKEN_FILE: str(token_file)}
    )
    r = Rig(server, store, ingest, feed, token, control_addr, EngineKey(server.metrics_url, server.model_name, "0"))
    try:
        server.start()
        yield r
    finally:
        server.stop()
        r.ingest.stop()
        store.close()
        for p in sock_dir.iterdir():
            p.unlink()
        sock_dir.rmdir()


def good_draft_rig(
    tmp_path_factory: pytest.TempPathFactory,
    name: str,
    k_max: int,
    extra_env: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[Rig]:
    """A module's rig (``plugin_rig``): the good draft at ``k_max`` behind a one-row table."""
    work = tmp_path_factory.mktemp(name)
    server = LabServer(
        draft="good",
        k=k_max,
        per_batch_size=[[1, 16, k_max]],
        models_dir=MODELS_DIR,
        workdir=work / "engine",
        extra_env=dict(extra_env or {}),
        extra_args=extra_args,
    )
    with plugin_rig(server, work) as r:
        yield r


@pytest.fixture(scope="module")
def rig(lab_models: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from good_draft_rig(tmp_path_factory, "plugin", K_MAX)


def engine_spec_totals(metrics_url: str) -> dict[str, Any]:
    """The engine's speculation counters by a plain line scan of /metrics (not our parser)."""
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, Any] = {"per_pos": {}}
    for line in text.splitlines():
        m = re.match(r"vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens)_total\{[^}]*\} (\S+)", line)
        if m:
            out[m.group(1)] = int(float(m.group(2)))
        m = re.match(r'vllm:spec_decode_num_accepted_tokens_per_pos_total\{.*position="(\d+)".*\} (\S+)', line)
        if m:
            out["per_pos"][int(m.group(1))] = int(float(m.group(2)))
    return out


def settle(rig: Rig, quiet_s: float = 1.5, timeout_s: float = 30.0) -> None:
    """Wait until no step has arrived for ``quiet_s`` and everything received is written."""
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        n = rig.ingest.stats.accepted
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.1)
    assert rig.ingest.writer.flush(10)


class Tripwire(Actuator):
    """The fallback must not be used for K changes within K_max."""

    kind = "restart"

    def apply(self, config: VllmSpec) -> ApplyResult:
        raise AssertionError(f"the live actuator fell back to a restart for {config}")


def greedy_outputs(rig: Rig) -> list[str]:
    server = rig.server
    result = run_load(server.base_url, server.model_name, PROMPTS, concurrency=1, count=len(PROMPTS), max_tokens=32)
    assert result.errors == 0
    by_prompt = {r.prompt: r.text for r in result.requests}
    return [by_prompt[p] for p in PROMPTS]


def live_change(
    rig: Rig, actuator: LiveActuator, config: VllmSpec, k: int, streams: int
) -> tuple[LiveApplyResult, list[str]]:
    """Apply ``config`` (drafting ``k`` at the batch sizes greedy_outputs runs) through the live
    actuator under ``streams`` of steady traffic, so the change shows in the step stream at once;
    check it went live and that every later step drafts ``k``; return the result and greedy outputs."""
    stop = threading.Event()

    def background() -> None:
        while not stop.is_set():
            run_load(rig.server.base_url, rig.server.model_name, PREDICTABLE, concurrency=streams, count=2,
                     max_tokens=48)  # fmt: skip

    load = threading.Thread(target=background, daemon=True)
    load.start()
    time.sleep(0.5)
    try:
        res = actuator.apply(config)
    finally:
        stop.set()
        load.join(60)
    assert isinstance(res, LiveApplyResult)
    assert res.status is ApplyStatus.APPLIED and res.path == "live", res.message
    settle(rig, quiet_s=1.0)
    mark = time.time()
    outputs = greedy_outputs(rig)
    settle(rig, quiet_s=1.0)
    after = [s for s in rig.store.steps(rig.key) if s.ts.timestamp() > mark]
    drafted = {drafted_k(s) for s in after if s.spec.drafts}
    assert drafted == ({k} if k else set()), f"steps after the change to K={k} drafted {drafted}"
    assert any(s.spec.generated_tokens for s in after)
    return res, outputs


def test_per_step_totals_equal_metrics_totals(rig: Rig) -> None:
    result = run_load(rig.server.base_url, rig.server.model_name, PROMPTS, concurrency=4, count=24, max_tokens=48)
    assert result.errors == 0
    settle(rig)
    steps = rig.store.steps(rig.key)
    engine = engine_spec_totals(rig.server.metrics_url)
    assert steps, "no per-step records arrived"
    assert sum(s.spec.drafts for s in steps) == engine["drafts"] > 0
    assert sum(s.spec.draft_tokens for s in steps) == engine["draft_tokens"]
    assert sum(s.spec.accepted_tokens for s in steps) == engine["accepted_tokens"]
    per_pos = [sum(s.spec.accepted_per_pos[i] for s in steps) for i in range(K_MAX)]
    assert per_pos == [engine["per_pos"][i] for i in range(K_MAX)]
    # What /metrics lacks: draft tokens per position; at a fixed K=5 every draft reaches every position.
    drafted = [sum((s.spec.draft_tokens_per_pos or ())[i] for s in steps) for i in range(K_MAX)]
    assert drafted[0] == engine["drafts"] and sum(drafted) == engine["draft_tokens"]
    assert {s.batch_size for s in steps} <= set(range(0, 5)) and max(s.batch_size for s in steps) >= 2
    timed = [s.step_time_s for s in steps if s.step_time_s is not None]
    assert len(timed) >= len(steps) // 2 and all(0 < t < 5 for t in timed)
    assert rig.ingest.stats.plugin_dropped == 0


def test_live_k_changes_take_effect_and_greedy_output_is_unchanged(rig: Rig) -> None:
    actuator = LiveActuator(
        ControlClient(rig.control_addr, rig.token), Tripwire(), feed=rig.feed, k_max=K_MAX, verify_timeout_s=10
    )
    draft = rig.server.spec_config
    assert draft is not None
    actuator.current = {"method": draft["method"], "model": draft["model"], "num_speculative_tokens": K_MAX}
    outputs = {K_MAX: greedy_outputs(rig)}
    results: dict[int, LiveApplyResult] = {}
    for k in (2, 0, 4):
        res, outputs[k] = live_change(rig, actuator, {**actuator.current, "num_speculative_tokens": k}, k, streams=2)
        assert res.verified == "stream", res.message
        results[k] = res
    reference = outputs[0]  # K=0 live: no draft tokens, plain decoding
    for k, texts in outputs.items():
        assert texts == reference, f"greedy output at K={k} differs from decoding without speculation"
    # The change reached the engine's steps live: seconds at most, where a restart takes tens of seconds before
    # the first step. How fast (well under a second on a quiet machine) is bench/bench_plugin.py's figure; a
    # bound of 1 s here failed at 1.4 s with both cores of the CI box kept busy.
    for k, res in results.items():
        assert res.decision_to_first_step_s is not None and res.decision_to_first_step_s < 10.0, (k, res)


def test_wrong_token_is_refused(rig: Rig) -> None:
    good = ControlClient(rig.control_addr, rig.token)
    before = good.get()
    with pytest.raises(ControlError) as err:
        ControlClient(rig.control_addr, rig.token + "x").set_table([[1, 16, 1]])
    assert err.value.code == "bad_token"
    after = good.get()
    assert after.table == before.table and after.generation == before.generation
    assert after.refused == before.refused + 1


def test_sidecar_down_costs_the_engine_nothing(rig: Rig) -> None:
    rig.ingest.stop()  # the sidecar goes away
    result = run_load(rig.server.base_url, rig.server.model_name, PROMPTS, concurrency=4, count=16, max_tokens=48)
    assert result.errors == 0 and rig.server.alive()
    assert httpx.get(f"{rig.server.base_url}/health", timeout=5).status_code == 200
    time.sleep(6)  # past the shipper's longest back-off
    rig.restart_ingest()
    before = rig.ingest.stats.accepted
    result = run_load(rig.server.base_url, rig.server.model_name, PROMPTS[:2], concurrency=2, count=4, max_tokens=32)
    assert result.errors == 0
    deadline = time.monotonic() + 20  # the shipper retries after its back-off (≤ 5 s)
    while rig.ingest.stats.accepted == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rig.ingest.stats.accepted > before  # shipping resumed by itself
    assert rig.ingest.stats.plugin_dropped > 0  # and the gap is reported, not hidden
