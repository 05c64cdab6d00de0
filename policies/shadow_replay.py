"""Shadow replay: what a draft candidate *would* have accepted on recorded traffic. Pure.

Under greedy verification the target's output does not depend on the draft, so a recorded
(prompt, output) pair fixes every verify step's outcome once the draft's proposals are known:

- a step starts at output position ``p`` (position 0 comes from the prefill, so the first step starts
  at 1), the draft proposes up to K tokens from ``prompt + output[:p]``, the step accepts the longest
  prefix equal to ``output[p:]`` and the target adds its bonus token, so the next step starts at
  ``p + accepted + 1``;
- ngram (prompt lookup) proposals are vLLM's, reproduced exactly (:func:`ngram_propose`);
- a draft model's greedy proposal at position ``q`` given accepted tokens equals its argmax on the
  true prefix ``prompt + output[:q]`` (an accepted token *is* the target's), so one teacher-forced
  pass of the candidate gives every step (:func:`steps_from_predictions`).

Steps yield ``(accepted, drafted)`` pairs, turned into α evidence by
:func:`policies.acceptance.evidence_from_draft_steps` — the same estimator the serving path uses on
vLLM's per-request ``per_step_accepted``/``per_step_drafted``. Near the end of a recorded output a
step's drafted count is cut to what can still be checked against it (vLLM would verify tokens past a
``max_tokens`` stop that the record does not hold).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from policies.acceptance import AcceptanceEvidence, evidence_from_draft_steps

Proposer = Callable[[Sequence[int]], Sequence[int]]
"""Tokens so far → proposed draft tokens (at most K)."""


@dataclass(frozen=True)
class ReplayResult:
    """Verify steps of one candidate over one or more recorded samples."""

    accepted: tuple[int, ...]
    drafted: tuple[int, ...]
    samples: int
    output_tokens: int

    @property
    def evidence(self) -> AcceptanceEvidence:
        return evidence_from_draft_steps(self.accepted, self.drafted)

    @property
    def proposal_share(self) -> float | None:
        return proposal_share(self.evidence, self.samples, self.output_tokens)

    def __add__(self, other: ReplayResult) -> ReplayResult:
        return ReplayResult(
            self.accepted + other.accepted,
            self.drafted + other.drafted,
            self.samples + other.samples,
            self.output_tokens + other.output_tokens,
        )


EMPTY = ReplayResult((), (), 0, 0)


def proposal_share(evidence: AcceptanceEvidence, samples: int, output_tokens: int) -> float | None:
    """Share of the decode steps in which the proposer drafted, from a replay's totals: a step that drafted
    emitted its accepted tokens and the bonus token, every other decode step one token, and each sample's
    first output token came from its prefill. 1 for a draft model (it drafts at every step; its last step
    may run past the record, hence the clamp); below 1 for a prompt lookup that found no match at some
    steps. None without drafts."""
    if evidence.drafts <= 0 or output_tokens - samples <= 0:
        return None
    plain = max(0.0, output_tokens - samples - evidence.drafts - evidence.successes)
    return evidence.drafts / (evidence.drafts + plain)


def ngram_lookup(extra: Mapping[str, object]) -> tuple[int, int]:
    """(min_n, max_n) of a prompt lookup as vLLM resolves its speculative config
    (``vllm/config/speculative.py``): neither given → 5 and 5; one given → the other equals it. A replay
    that defaulted to 1-grams proposed at 80 % of the lab's hard-prompt steps and accepted 1.2 tokens a
    step where vLLM's 2–5-grams accepted 2.3."""
    given: dict[str, int] = {}
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        value = extra.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer ≥ 1 but got {value!r}")
        given[name] = value
    if not given:
        return 5, 5
    min_n = given.get("prompt_lookup_min", given.get("prompt_lookup_max", 0))
    max_n = given.get("prompt_lookup_max", min_n)
    if min_n > max_n:
        raise ValueError(f"prompt_lookup_min={min_n} must be ≤ prompt_lookup_max={max_n}")
    return min_n, max_n


def ngram_propose(tokens: Sequence[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """vLLM's prompt-lookup proposal (``vllm/v1/spec_decode/ngram_proposer.py``,
    ``_find_longest_matched_ngram_and_propose_tokens``): the longest n-gram (``min_n ≤ n ≤ max_n``)
    ending the context that also occurs earlier, its *earliest* occurrence among the longest, and up
    to ``k`` tokens after it (fewer near the context's end or ``max_model_len``)."""
    if min_n < 1 or max_n < min_n or k < 1:
        raise ValueError(f"ngram needs 1 ≤ min_n ≤ max_n and k ≥ 1 but got min_n={min_n}, max_n={max_n}, k={k}")
    total = len(tokens)
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = 0
    position = 0
    prev = 0
    i = 1
    # KMP over the reversed context: the longest prefix of rev (a suffix of the context) that also ends
    # at i; ties keep the latest i, i.e. the earliest occurrence in the original order.
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest = prev
                position = i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    k = min(k, total - start)
    return list(tokens[start : start + k])


def replay_proposer(prompt: Sequence[int], output: Sequence[int], propose: Proposer) -> ReplayResult:
    """Greedy verify steps of ``propose`` against the recorded ``output``."""
    context = list(prompt) + list(output)
    n_prompt = len(prompt)
    accepted: list[int] = []
    drafted: list[int] = []
    p = 1
    while p < len(output):
        proposal = list(propose(context[: n_prompt + p]))
        checkable = proposal[: len(output) - p]
        if not checkable:
            p += 1  # no draft this step: the target decodes one token alone
            continue
        n = 0
        while n < len(checkable) and checkable[n] == output[p + n]:
            n += 1
        accepted.append(n)
        drafted.append(len(checkable))
        p += n + 1
    return ReplayResult(tuple(accepted), tuple(drafted), 1, len(output))


def steps_from_predictions(output: Sequence[int], predicted: Sequence[int], k: int) -> ReplayResult:
    """Verify steps of a greedy draft model with ``k`` speculative tokens, from its argmax
    ``predicted[q]`` of output token ``q`` given the true prefix (``len(predicted) == len(output)``)."""
    if k < 1:
        raise ValueError(f"k must be ≥ 1 but got {k}")
    if len(predicted) != len(output):
        raise ValueError(f"one prediction per output token needed: {len(predicted)} for {len(output)}")
    accepted: list[int] = []
    drafted: list[int] = []
    p = 1
    while p < len(output):
        width = min(k, len(output) - p)
        n = 0
        while n < width and predicted[p + n] == output[p + n]:
            n += 1
        accepted.append(n)
        drafted.append(width)
        p += n + 1
    return ReplayResult(tuple(accepted), tuple(drafted), 1, len(output))


def with_shadow(
    history: Mapping[str, AcceptanceEvidence], shadow: Mapping[str, AcceptanceEvidence]
) -> dict[str, AcceptanceEvidence]:
    """Serving history plus shadow evidence, per candidate: both are Bernoulli evidence of the same
    draft's acceptance on this target's traffic, so their likelihoods add (a candidate never served
    is ranked on its shadow evidence instead of its prior alone)."""
    out = dict(history)
    for name, ev in shadow.items():
        out[name] = out[name] + ev if name in out else ev
    return out
