"""K = 0 steps with a prompt in them skip the draft's pass too, inside a real lab engine (CPU).

One engine for the module: the good draft at K_max = 3 behind a per-batch-size table, started without
prefix caching (``--no-enable-prefix-caching``) and with ``SPECTUNER_SKIP_K0_DRAFT_PASS=all`` (what
``[plugin] skip_draft_pass_at_k0_prompts`` sets). Checks that the plugin reads the engine's own cache
config (vLLM's ``cache_config.enable_prefix_caching`` on the real proposer) and skips every K = 0 step —
the prompts' included, so none keeps the pass — and, the price, that a request whose prompt the draft
never saw still returns exactly plain decoding's greedy text once it drafts, with no client error.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from collectors.vllm_plugin import env
from collectors.vllm_plugin.client import ControlClient
from tests.live.test_k0_pass_live import K_MAX, PROMPTS, all_at_once, long_beside_short, texts
from tests.live.test_plugin_live import Rig, good_draft_rig, settle
from tuner.lab.models import Manifest


@pytest.fixture(scope="module")
def rig(lab_models: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from good_draft_rig(
        tmp_path_factory, "k0-prompt-pass", K_MAX, {env.SKIP_K0_DRAFT_PASS: "all"}, ("--no-enable-prefix-caching",)
    )


def test_without_prefix_caching_every_k0_step_skips_and_a_prompt_the_draft_never_saw_keeps_its_text(
    rig: Rig,
) -> None:
    control = ControlClient(rig.control_addr, rig.token)
    state = control.get()
    assert state.supported, state.reason
    assert state.k0_draft_pass == "skipped" and state.k0_prompt_pass == "unknown"  # no K = 0 step seen yet

    # K = 0 everywhere: plain decoding, prompts and all, and not one draft pass
    control.set_table([[1, 16, 0]])
    reference = texts(all_at_once(rig))
    settle(rig, quiet_s=1.0)
    deadline = time.monotonic() + 10.0  # the worker publishes its counts ≤ once a second
    while control.get().k0_prompt_pass == "unknown" and time.monotonic() < deadline:
        time.sleep(0.2)
    state = control.get()
    assert state.k0_prompt_pass == "skipped"
    assert state.k0_passes_skipped > 0 and state.k0_passes_run == 0

    # K = 3 alone, K = 0 from two: the long request's prompt and first tokens never reach the draft's
    # cache; alone, it drafts against it. The target verifies every token: its text is plain decoding's.
    out, mark = long_beside_short(rig)
    assert out.get(PROMPTS[0]) == reference[0]
    settle(rig, quiet_s=1.0)
    alone = [s for s in rig.store.steps(rig.key) if s.ts.timestamp() > mark and s.batch_size == 1]
    assert sum(s.spec.draft_tokens for s in alone) > 0, "the long request never drafted alone"
    assert control.get().k0_passes_run == 0
    assert rig.server.alive()
