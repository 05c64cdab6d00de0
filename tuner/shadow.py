"""Shadow evaluation: each draft candidate's α measured on recorded traffic, without loading it in
the engine (``spectuner shadow run``).

- ngram: vLLM's prompt lookup replayed exactly on the recorded token streams (no model);
- draft models: the candidate (torch + transformers, the ``shadow`` extra, imported lazily) reads
  ``prompt + the target's actual continuation`` in one teacher-forced pass per sample; its greedy
  proposals are checked against the target's tokens step by step (``policies.shadow_replay``).
  Samples whose request was sampled (temperature > 0) are counted too, and the result is marked
  ``greedy_only``: it is the acceptance greedy verification would see on those outputs;
- EAGLE-style heads and MTP read the target's hidden states, which a record does not hold: they are
  not evaluated here (``needs_canary``): try them on one replica or a blue/green canary;
- suffix decoding keeps a cache across requests: not replayed yet (``not_replayed``).

The worker runs at low priority with its own CPU budget (``os.nice``, ``torch.set_num_threads`` and a
CPU-share throttle, :class:`Throttle`) so an engine on the same host keeps its CPUs
(bench/bench_shadow.py measures the cost).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from collectors.traffic_record import TrafficSample
from policies.acceptance import estimate_alpha_from_evidence
from policies.shadow_replay import (
    EMPTY,
    ReplayResult,
    ngram_lookup,
    ngram_propose,
    replay_proposer,
    steps_from_predictions,
)
from policies.spec_config import K_KEY

HEAD_METHODS = frozenset({"eagle", "eagle3", "mtp", "medusa"})
NGRAM_METHODS = frozenset({"ngram", "ngram_gpu"})


class ShadowInputError(ValueError):
    """A candidate or target the shadow worker cannot use; the message says why and what to do."""


@dataclass(frozen=True)
class ShadowCandidate:
    name: str
    method: str
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShadowOutcome:
    """One candidate's replay, or why it was not replayed (``skipped``)."""

    candidate: ShadowCandidate
    k: int
    replay: ReplayResult = EMPTY
    greedy_only: bool = False
    tokenizer_check: str = "not_needed"
    skipped: str | None = None
    cpu_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def alpha(self, confidence: float = 0.95) -> tuple[float | None, tuple[float, float] | None]:
        return estimate_alpha_from_evidence(self.replay.evidence, confidence)


def limit_resources(threads: int, nice: int) -> None:
    """Lower this process's priority (``torch.set_num_threads`` caps its threads at load time)."""
    if threads < 1:
        raise ShadowInputError(f"--threads must be ≥ 1 but got {threads}")
    if nice > 0:
        with contextlib.suppress(OSError):  # not permitted: keep going at the current priority
            os.nice(nice)


class Throttle:
    """Keeps the worker's CPU time at most ``cpu_share`` of the wall time (of one core): after each
    sample it sleeps off any excess. 1.0: no throttle (nice alone)."""

    def __init__(self, cpu_share: float) -> None:
        if not 0 < cpu_share <= 1:
            raise ShadowInputError(f"--cpu-share must lie in (0, 1] but got {cpu_share}")
        self.cpu_share = cpu_share
        self._wall0 = time.monotonic()
        self._cpu0 = time.process_time()

    def pause(self) -> None:
        if self.cpu_share >= 1:
            return
        used = time.process_time() - self._cpu0
        owed = used / self.cpu_share - (time.monotonic() - self._wall0)
        if owed > 0:
            time.sleep(owed)


NO_THROTTLE = Throttle(1.0)


def check_draft_model(target: Path, draft: Path) -> str:
    """Refuse a draft that is not a model directory, or whose tokenizer differs from the target's."""
    if not (draft / "config.json").is_file():
        raise ShadowInputError(f"{draft}: not a model directory (no config.json); give a draft model's directory")
    t_vocab = _vocab(target)
    d_vocab = _vocab(draft)
    if t_vocab is None:
        raise ShadowInputError(f"{target}: no tokenizer.json; give the target model's directory with --target")
    if d_vocab is None:
        return "draft_has_no_tokenizer"  # many drafts ship weights only: the config's vocab size is checked
    if t_vocab != d_vocab:
        diff = len(set(t_vocab.items()) ^ set(d_vocab.items()))
        raise ShadowInputError(
            f"{draft}: its tokenizer differs from the target's ({diff} vocabulary entries differ); "
            "a draft must share the target's tokenizer to be verified token by token"
        )
    return "same_vocab"


def _vocab(path: Path) -> dict[str, int] | None:
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    vocab = data.get("model", {}).get("vocab")
    added = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    return {**(vocab if isinstance(vocab, dict) else {}), **added}


def evaluate_ngram(
    samples: Sequence[TrafficSample],
    k: int,
    extra: dict[str, Any],
    max_model_len: int,
    throttle: Throttle = NO_THROTTLE,
) -> ReplayResult:
    try:
        min_n, max_n = ngram_lookup(extra)
    except ValueError as exc:
        raise ShadowInputError(f"ngram candidate: {exc}") from exc
    total = EMPTY
    for s in samples:
        total = total + replay_proposer(
            s.prompt_ids, s.output_ids, lambda ctx: ngram_propose(ctx, min_n, max_n, k, max_model_len)
        )
        throttle.pause()
    return total


def evaluate_draft_model(
    samples: Sequence[TrafficSample], model_dir: Path, k: int, threads: int, throttle: Throttle = NO_THROTTLE
) -> ReplayResult:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ShadowInputError(
            f"draft-model shadow evaluation needs torch and transformers: pip install 'spectuner[shadow]' ({exc})"
        ) from exc
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI's --json output is one document
    hf_logging.set_verbosity_error()
    torch.set_num_threads(threads)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except (OSError, ValueError) as exc:
        raise ShadowInputError(f"{model_dir}: cannot load it as a causal LM ({exc})") from exc
    model.eval()
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    total = EMPTY
    with torch.inference_mode():
        for s in samples:
            ids = list(s.prompt_ids) + list(s.output_ids)
            if limit and len(ids) > limit:
                continue  # longer than the draft can read: vLLM would not draft there either
            if vocab and max(ids) >= vocab:
                raise ShadowInputError(f"{model_dir}: vocabulary of {vocab} tokens, the record holds id {max(ids)}")
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            n = len(s.prompt_ids)
            # The prediction of output token q reads positions up to n + q − 1.
            predicted = logits[n - 1 : n - 1 + len(s.output_ids)].argmax(-1).tolist()
            total = total + steps_from_predictions(s.output_ids, predicted, k)
            throttle.pause()
    return total


def evaluate(
    candidate: ShadowCandidate,
    samples: Sequence[TrafficSample],
    *,
    target: Path,
    k: int,
    threads: int = 1,
    max_model_len: int = 1 << 30,
    throttle: Throttle = NO_THROTTLE,
) -> ShadowOutcome:
    """Replay ``samples`` through one candidate (raises ``ShadowInputError`` on a bad candidate)."""
    start = time.process_time()
    greedy_only = any(not s.greedy for s in samples)
    method = candidate.method
    if method in HEAD_METHODS:
        return ShadowOutcome(
            candidate, k, skipped="needs_canary",
            details={"why": f"{method} reads the target's hidden states, which a record does not hold; "
                     "evaluate it on one replica or a blue/green canary"},
        )
    if method == "suffix":
        return ShadowOutcome(
            candidate, k, skipped="not_replayed",
            details={"why": "suffix decoding keeps a cross-request cache; its replay is not implemented"},
        )
    k = int(candidate.extra.get(K_KEY, k))
    if method in NGRAM_METHODS:
        replay = evaluate_ngram(samples, k, candidate.extra, max_model_len, throttle)
        check = "not_needed"
    elif method == "draft_model":
        if not candidate.model:
            raise ShadowInputError(f"candidate {candidate.name!r} (draft_model) has no model path")
        draft = Path(candidate.model)
        check = check_draft_model(target, draft)
        replay = evaluate_draft_model(samples, draft, k, threads, throttle)
    else:
        raise ShadowInputError(f"candidate {candidate.name!r}: method {method!r} cannot be shadow-evaluated")
    cpu = time.process_time() - start
    return ShadowOutcome(candidate, k, replay, greedy_only, check, None, cpu, {"cpu_s": round(cpu, 3)})


def select_samples(samples: Iterable[TrafficSample], since: datetime | None, limit: int | None) -> list[TrafficSample]:
    """The newest ``limit`` samples at or after ``since`` (oldest first)."""
    chosen = [s for s in samples if since is None or s.ts >= since]
    return chosen[-limit:] if limit else chosen
