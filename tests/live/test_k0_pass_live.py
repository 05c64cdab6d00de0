"""K = 0 steps without the draft model's pass, inside a real lab engine (CPU).

One engine for the module: the good draft at K_max = 3 behind a per-batch-size table, the plugin's
control channel and step stream on, and ``SPECTUNER_SKIP_K0_DRAFT_PASS=1`` (what ``[plugin]
skip_draft_pass_at_k0`` sets). Checks that the engine says it skips, that K = 0 steps really skip (the
plugin's count grows, the steps carry no drafts), and — the price of skipping — that requests which lived
through K = 0 steps and then drafted from a draft KV cache with holes still return exactly the greedy text
of plain decoding, with no client error, and that the draft still gets tokens accepted for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from collectors.vllm_plugin import env
from collectors.vllm_plugin.client import ControlClient
from tests.live.test_plugin_live import Rig, good_draft_rig, settle
from tuner.lab.load import LoadResult, run_load
from tuner.lab.models import Manifest
from tuner.lab.prompts import HARD, PREDICTABLE

K_MAX = 3
PROMPTS = [*PREDICTABLE[:3], HARD[0]]
TOKENS = 160


@pytest.fixture(scope="module")
def rig(lab_models: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from good_draft_rig(tmp_path_factory, "k0-pass", K_MAX, {env.SKIP_K0_DRAFT_PASS: "1"})


def all_at_once(rig: Rig) -> LoadResult:
    """Every prompt at once (batch 4), greedy, ``TOKENS`` tokens each."""
    server = rig.server
    return run_load(
        server.base_url, server.model_name, PROMPTS, concurrency=len(PROMPTS), count=len(PROMPTS), max_tokens=TOKENS
    )


def complete(rig: Rig, prompt: str, max_tokens: int, out: dict[str, str]) -> None:
    """One greedy completion of exactly ``max_tokens`` tokens into ``out[prompt]``."""
    body = {"model": rig.server.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    resp = httpx.post(f"{rig.server.base_url}/v1/completions", json=body, timeout=180)
    resp.raise_for_status()
    out[prompt] = resp.json()["choices"][0]["text"]


def long_beside_short(rig: Rig) -> tuple[dict[str, str], float]:
    """Under the table K = 3 alone, K = 0 from two: one long request (``TOKENS``) beside three short ones
    decodes at K = 0, then alone at K = 3. The batch size switches K inside the engine, so no timing of
    ours decides where the switch falls. Returns the texts by prompt and when it began (epoch s)."""
    ControlClient(rig.control_addr, rig.token).set_table([[1, 1, K_MAX], [2, 16, 0]])
    mark = time.time()
    out: dict[str, str] = {}
    jobs = [(PROMPTS[0], TOKENS), *((p, 24) for p in PROMPTS[1:])]
    threads = [threading.Thread(target=complete, args=(rig, p, n, out), daemon=True) for p, n in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out, mark


def texts(result: LoadResult) -> list[str]:
    assert result.errors == 0
    by_prompt = {r.prompt: r.text for r in result.requests}
    return [by_prompt[p] for p in PROMPTS]


def test_k0_steps_skip_the_pass_and_requests_that_lived_through_them_keep_their_text(rig: Rig) -> None:
    control = ControlClient(rig.control_addr, rig.token)
    state = control.get()
    assert state.supported, state.reason
    assert state.k0_draft_pass == "skipped" and state.features.get("k_table")

    # Plain decoding: K = 0 at every batch size. Each of its steps skips the draft's pass.
    control.set_table([[1, 16, 0]])
    mark = time.time()
    reference = texts(all_at_once(rig))
    settle(rig, quiet_s=1.0)
    plain = [s for s in rig.store.steps(rig.key) if s.ts.timestamp() > mark]
    assert plain and not any(s.spec.drafts for s in plain)
    # the model runs in vLLM's worker process, which publishes its counts to the engine core ≤ once a second
    skipped = control.get().k0_passes_skipped
    assert skipped > 0 and control.get().k0_passes_run > 0  # decode-only steps skipped; the prompts' steps ran

    # one long request beside three short ones decodes at K = 0 (its tokens never reach the draft's cache),
    # then alone at K = 3, drafting against the holes
    out, mark = long_beside_short(rig)
    assert out.get(PROMPTS[0]) == reference[0]  # the target verifies every token: a stale draft cache changes no text
    settle(rig, quiet_s=1.0)
    after = [s for s in rig.store.steps(rig.key) if s.ts.timestamp() > mark and s.batch_size == 1]
    drafted = sum(s.spec.draft_tokens for s in after)
    accepted = sum(s.spec.accepted_tokens for s in after)
    assert drafted > 0, "the long request never drafted alone"
    assert accepted > 0  # the draft still works for requests whose early tokens it never saw
    assert control.get().k0_passes_skipped > skipped
    assert rig.server.alive()
