"""Shadow replay: vLLM's n-gram lookup reproduced exactly, and greedy verify steps counted as vLLM does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.acceptance import evidence_from_draft_steps
from policies.shadow_replay import ngram_lookup, ngram_propose, replay_proposer, steps_from_predictions

pytestmark = pytest.mark.unit


def test_ngram_takes_the_longest_match_and_its_earliest_occurrence() -> None:
    # "1 2 3" ends the context; it occurs at 0 (followed by 7 8) and at 5 (followed by 9 9).
    tokens = [1, 2, 3, 7, 8, 1, 2, 3, 9, 9, 4, 1, 2, 3]
    assert ngram_propose(tokens, 1, 3, 2, 1000) == [7, 8]
    # no n-gram of length ≥ 2 recurs: nothing proposed
    assert ngram_propose([1, 2, 3, 4], 2, 3, 3, 1000) == []
    # fewer than k tokens after the match, and the max_model_len cap
    assert ngram_propose([5, 6, 5], 1, 2, 4, 1000) == [6, 5]
    assert ngram_propose([5, 6, 5], 1, 2, 4, 4) == [6]


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 5),
)
def test_ngram_matches_vllms_own_lookup(tokens: list[int], min_n: int, extra: int, k: int) -> None:
    vllm_ngram = pytest.importorskip("vllm.v1.spec_decode.ngram_proposer")
    want = vllm_ngram._find_longest_matched_ngram_and_propose_tokens(
        np.array(tokens, dtype=np.int32), min_n, min_n + extra, 64, k
    )
    assert ngram_propose(tokens, min_n, min_n + extra, k, 64) == [int(x) for x in want]


def test_replay_counts_steps_like_the_engine() -> None:
    output = [10, 11, 12, 13, 14, 15]

    def propose(ctx: list[int] | tuple[int, ...]) -> list[int]:
        # right about the next token, wrong about the one after
        nxt = output.index(ctx[-1]) + 1 if ctx[-1] in output else 0
        return [output[nxt] if nxt < len(output) else 0, 99]

    result = replay_proposer([1, 2], output, propose)
    # steps start at 1 (token 0 is the prefill's): 1→ accepts 11, bonus 12; 3→ accepts 13, bonus 14; 5→ one left
    assert result.accepted == (1, 1, 1)
    assert result.drafted == (2, 2, 1)
    ev = evidence_from_draft_steps(result.accepted, result.drafted)
    assert (ev.successes, ev.failures, ev.drafts) == (3, 2, 3)


def test_predictions_give_the_same_steps_as_an_equivalent_proposer() -> None:
    rng = np.random.default_rng(3)
    output = [int(x) for x in rng.integers(0, 3, 60)]
    predicted = [int(x) for x in rng.integers(0, 3, 60)]
    prompt = [7, 7]
    k = 3

    def propose(ctx: list[int] | tuple[int, ...]) -> list[int]:
        # a greedy draft that, given the true prefix up to q, predicts predicted[q]; past an accepted
        # token it sees that token, so its next proposal is predicted[q + 1]
        q = len(ctx) - len(prompt)
        return [predicted[q + i] for i in range(k) if q + i < len(output)]

    a = steps_from_predictions(output, predicted, k)
    b = replay_proposer(prompt, output, propose)
    assert (a.accepted, a.drafted) == (b.accepted, b.drafted)
    assert a.evidence == b.evidence


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="min_n"):
        ngram_propose([1, 2], 0, 2, 3, 10)
    with pytest.raises(ValueError, match="one prediction per output token"):
        steps_from_predictions([1, 2, 3], [1, 2], 2)


def test_the_share_of_steps_a_lookup_drafts_at_is_counted_from_the_replays_totals() -> None:
    rng = np.random.default_rng(11)
    # a prompt whose 2-grams recur now and then in an output of fresh tokens: the lookup drafts at some steps
    prompt = [int(x) for x in rng.integers(0, 6, 40)]
    output = [int(x) for x in rng.integers(0, 9, 200)]
    drafting = plain = 0
    p = 1
    while p < len(output):  # the replay's own walk, counting the steps it drafted nothing at
        proposal = ngram_propose(prompt + output[:p], 2, 5, 3, 10_000)[: len(output) - p]
        if not proposal:
            plain, p = plain + 1, p + 1
            continue
        n = 0
        while n < len(proposal) and proposal[n] == output[p + n]:
            n += 1
        drafting, p = drafting + 1, p + n + 1
    result = replay_proposer(prompt, output, lambda ctx: ngram_propose(ctx, 2, 5, 3, 10_000))
    assert plain > 0 and drafting > 0
    assert result.proposal_share == pytest.approx(drafting / (drafting + plain), abs=1e-9)
    # a draft model drafts at every step (its last step may run past the record: still 1, not more)
    predicted = [int(x) for x in rng.integers(0, 9, 200)]
    assert steps_from_predictions(output, predicted, 3).proposal_share == 1.0
    assert steps_from_predictions(output, output, 5).proposal_share == 1.0


def test_a_lookup_without_its_bounds_is_replayed_as_vllm_resolves_them() -> None:
    assert ngram_lookup({}) == (5, 5)  # vLLM's default when neither is given
    assert ngram_lookup({"prompt_lookup_max": 4}) == (4, 4)
    assert ngram_lookup({"prompt_lookup_min": 2}) == (2, 2)
    assert ngram_lookup({"prompt_lookup_min": 2, "prompt_lookup_max": 5, "other": "x"}) == (2, 5)
    for bad, match in (({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "must be ≤"),
                       ({"prompt_lookup_max": 0}, "≥ 1"), ({"prompt_lookup_min": "2"}, "integer")):
        with pytest.raises(ValueError, match=match):
            ngram_lookup(bad)
    vllm_config = pytest.importorskip("vllm.config")
    bounds: list[dict[str, int]] = [{}, {"prompt_lookup_max": 4}, {"prompt_lookup_min": 2}]
    for keys in [*bounds, {"prompt_lookup_min": 2, "prompt_lookup_max": 5}]:
        spec = vllm_config.SpeculativeConfig(method="ngram", num_speculative_tokens=3, **keys)
        assert ngram_lookup(keys) == (spec.prompt_lookup_min, spec.prompt_lookup_max)
