"""The plugin's K = 0 wrapper around vLLM's proposer (collectors/vllm_plugin/k0_pass.py), in this process's
vLLM. The engine itself is exercised in tests/live/test_k0_pass_live.py; here: off unless asked, what a
decode-only K = 0 call returns without the forward, and that other K and steps with a prompt in them
reach vLLM's own code."""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from collectors.vllm_plugin import env, k0_pass


@pytest.fixture
def proposer_class(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a worker publishes its counts

    original = SpecDecodeBaseProposer.propose
    state, prompts = dict(k0_pass._state), dict(k0_pass._prompts)
    try:
        yield SpecDecodeBaseProposer
    finally:
        SpecDecodeBaseProposer.propose = original
        k0_pass._state.clear()
        k0_pass._state.update(state)
        k0_pass._prompts.clear()
        k0_pass._prompts.update(prompts)


class Metadata:
    """What the wrapper reads of vLLM's CommonAttentionMetadata: the batch size and the longest query."""

    def __init__(self, batch_size: int, max_query_len: int = 1) -> None:
        self._b = batch_size
        self.max_query_len = max_query_len

    def batch_size(self) -> int:
        return self._b


def test_off_unless_the_variable_says_so(proposer_class: Any) -> None:
    before = proposer_class.propose
    for value in ("", "0", "no"):
        assert k0_pass.install({env.SKIP_K0_DRAFT_PASS: value}) is False
    assert proposer_class.propose is before
    assert k0_pass.state()["k0_draft_pass"] == "runs"


def test_k0_returns_an_empty_draft_without_the_forward_and_other_k_reach_vllm(proposer_class: Any) -> None:
    calls: list[int] = []

    @functools.wraps(proposer_class.propose)  # vLLM's signature, which the wrapper binds positional calls to
    def vllm_propose(self: Any, num_speculative_tokens: int, target_token_ids: Any, *args: Any, **kw: Any) -> str:
        calls.append(num_speculative_tokens)
        return "vllm"

    proposer_class.propose = vllm_propose  # stands in for vLLM's forward, which needs a loaded draft model
    assert k0_pass.install({env.SKIP_K0_DRAFT_PASS: "1"}) is True
    assert k0_pass.install({env.SKIP_K0_DRAFT_PASS: "1"}) is True  # a second register() wraps nothing twice
    proposer = object.__new__(proposer_class)
    ids = torch.zeros(7, dtype=torch.int64)
    skipped = k0_pass.state()["k0_passes_skipped"]
    out = proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=Metadata(3))
    assert isinstance(out, torch.Tensor) and tuple(out.shape) == (3, 0) and out.dtype == torch.int64
    assert proposer.num_speculative_tokens == 0 and proposer._last_draft_probs is None
    # vLLM passes it by keyword; by position it is the seventh argument after self
    positional = proposer.propose(0, ids, None, None, None, None, Metadata(5))
    assert tuple(positional.shape) == (5, 0)
    assert calls == []
    assert proposer.propose(num_speculative_tokens=2, target_token_ids=ids, common_attn_metadata=Metadata(3)) == "vllm"
    assert calls == [2]
    # a prompt (or a chunk of one) in the step: the draft must see it, K = 0 or not
    ran = k0_pass.state()["k0_passes_run"]
    prefill = Metadata(3, max_query_len=17)
    assert proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=prefill) == "vllm"
    assert calls == [2, 0]
    assert k0_pass.state() == {
        "k0_draft_pass": "skipped",
        "k0_passes_skipped": skipped + 2,
        "k0_passes_run": ran + 1,
        "k0_prompt_pass": "runs",
    }
    # anything unexpected in the step's metadata: vLLM's own pass runs, the step does not fail
    odd = SimpleNamespace(max_query_len=1)  # no batch_size()
    assert proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=odd) == "vllm"
    assert calls == [2, 0, 0] and k0_pass.state()["k0_skip_failed"] == "yes"


def test_the_engine_core_adds_up_what_its_workers_published(proposer_class: Any, tmp_path: Path) -> None:
    """vLLM's CPU build and multi-GPU executors run the model in worker processes: the control channel's
    engine core reads the counts each worker published under the core's pid (and nobody else's)."""
    before = k0_pass.state()
    me = os.getpid()
    (tmp_path / f"spectuner-k0-pass-{me}-101.json").write_text(json.dumps({"skipped": 40, "run": 7}))
    (tmp_path / f"spectuner-k0-pass-{me}-102.json").write_text(json.dumps({"skipped": 2, "run": 1}))
    (tmp_path / f"spectuner-k0-pass-{me + 1}-103.json").write_text(json.dumps({"skipped": 500, "run": 500}))
    (tmp_path / f"spectuner-k0-pass-{me}-104.json").write_text("torn")  # a half-written file is skipped
    after = k0_pass.state()
    assert after["k0_passes_skipped"] == before["k0_passes_skipped"] + 42
    assert after["k0_passes_run"] == before["k0_passes_run"] + 8
    # a worker's own publication: keyed by its parent
    k0_pass._publish(force=True)
    mine = json.loads((tmp_path / f"spectuner-k0-pass-{os.getppid()}-{me}.json").read_text())
    assert mine == {"skipped": k0_pass.SKIPPED.count, "run": k0_pass.RAN.count, "prompts": ""}
    k0_pass._remove_published()
    assert not (tmp_path / f"spectuner-k0-pass-{os.getppid()}-{me}.json").exists()


def _stand_in_vllm(proposer_class: Any, calls: list[int]) -> None:
    @functools.wraps(proposer_class.propose)
    def vllm_propose(self: Any, num_speculative_tokens: int, target_token_ids: Any, *args: Any, **kw: Any) -> str:
        calls.append(num_speculative_tokens)
        return "vllm"

    proposer_class.propose = vllm_propose


def _proposer(proposer_class: Any, prefix_caching: bool | None) -> Any:
    """A proposer whose engine runs with or without prefix caching (None: a config without the field)."""
    proposer = object.__new__(proposer_class)
    cache = SimpleNamespace() if prefix_caching is None else SimpleNamespace(enable_prefix_caching=prefix_caching)
    proposer.vllm_config = SimpleNamespace(cache_config=cache)
    return proposer


def test_all_skips_the_prompt_steps_too_on_an_engine_without_prefix_caching(proposer_class: Any) -> None:
    calls: list[int] = []
    _stand_in_vllm(proposer_class, calls)
    assert k0_pass.install({env.SKIP_K0_DRAFT_PASS: "all"}) is True
    assert k0_pass.state()["k0_prompt_pass"] == "unknown"  # no step with a prompt seen yet
    proposer = _proposer(proposer_class, prefix_caching=False)
    ids = torch.zeros(40, dtype=torch.int64)
    ran, skipped = k0_pass.state()["k0_passes_run"], k0_pass.state()["k0_passes_skipped"]
    out = proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=Metadata(4, 33))
    assert tuple(out.shape) == (4, 0) and calls == []
    decode = proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=Metadata(4))
    assert tuple(decode.shape) == (4, 0) and calls == []
    after = k0_pass.state()
    assert after["k0_prompt_pass"] == "skipped" and after["k0_passes_run"] == ran
    assert after["k0_passes_skipped"] == skipped + 2
    # K > 0 still reaches vLLM, prompt or not
    assert (
        proposer.propose(num_speculative_tokens=3, target_token_ids=ids, common_attn_metadata=Metadata(4, 33)) == "vllm"
    )
    assert calls == [3]


@pytest.mark.parametrize("prefix_caching", [True, None])
def test_all_keeps_the_prompt_steps_pass_where_prefix_caching_shares_prompt_blocks(
    proposer_class: Any, prefix_caching: bool | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Prefix caching on (or a vLLM whose config does not say): a prompt block without draft KV would be
    reused by every later request with that prefix. ``all`` then acts as ``1``, and the engine says why."""
    calls: list[int] = []
    _stand_in_vllm(proposer_class, calls)
    assert k0_pass.install({env.SKIP_K0_DRAFT_PASS: "all"}) is True
    proposer = _proposer(proposer_class, prefix_caching=prefix_caching)
    ids = torch.zeros(40, dtype=torch.int64)
    with caplog.at_level("WARNING", logger=k0_pass.log.name):
        assert (
            proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=Metadata(4, 33))
            == "vllm"
        )
        assert (
            proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=Metadata(4, 9))
            == "vllm"
        )
    assert calls == [0, 0]
    assert sum("prefix caching" in r.getMessage() for r in caplog.records) == 1  # said once, not per step
    decode = proposer.propose(num_speculative_tokens=0, target_token_ids=ids, common_attn_metadata=Metadata(4))
    assert tuple(decode.shape) == (4, 0)  # decode-only steps still skip
    state = k0_pass.state()
    assert state["k0_prompt_pass"] == "runs" and "--no-enable-prefix-caching" in state["k0_prompt_skip_reason"]


def test_the_mode_is_read_from_the_variable() -> None:
    assert env.k0_skip_mode({}) == "off"
    assert env.k0_skip_mode({env.SKIP_K0_DRAFT_PASS: "0"}) == "off"
    assert env.k0_skip_mode({env.SKIP_K0_DRAFT_PASS: "1"}) == "decode"
    assert env.k0_skip_mode({env.SKIP_K0_DRAFT_PASS: "yes"}) == "decode"
    assert env.k0_skip_mode({env.SKIP_K0_DRAFT_PASS: " ALL "}) == "all"


def test_the_engine_core_reads_its_workers_verdict_on_prompt_steps(proposer_class: Any, tmp_path: Path) -> None:
    """The model, and so the engine's cache config, is in the worker: the engine core (which answers
    ``get``) learns whether prompt steps skip from what the workers published."""
    _stand_in_vllm(proposer_class, [])
    assert k0_pass.install({env.SKIP_K0_DRAFT_PASS: "all"}) is True
    me = os.getpid()
    worker = tmp_path / f"spectuner-k0-pass-{me}-201.json"
    worker.write_text(json.dumps({"skipped": 3, "run": 0, "prompts": ""}))
    assert k0_pass.state()["k0_prompt_pass"] == "unknown"
    worker.write_text(json.dumps({"skipped": 3, "run": 0, "prompts": "skipped"}))
    assert k0_pass.state()["k0_prompt_pass"] == "skipped"
    (tmp_path / f"spectuner-k0-pass-{me}-202.json").write_text(
        json.dumps({"skipped": 1, "run": 2, "prompts": "the engine runs with prefix caching"})
    )
    state = k0_pass.state()  # one worker of two keeps the pass: not skipped, and why
    assert state["k0_prompt_pass"] == "runs" and state["k0_prompt_skip_reason"] == "the engine runs with prefix caching"
