"""Is a speculative config fit to send to the engine? One check for `spectuner apply` (before the
override is written) and for the daemon (again before it is applied: the audit row may have been
written by an older CLI, another config, or by hand).

Pure: no I/O. ``validate_spec_config`` raises ``ValueError`` with what is wrong; ``check_override``
returns the reason to audit, or None when the override may be applied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from policies.draft_choice import DraftCandidate
from policies.memory import FREE_METHODS, DraftFootprint, MemoryBudget, check_memory, weight_bytes
from policies.spec_config import EXAMPLE, K_KEY, K_TABLE_KEY, KNOWN_KEYS, KNOWN_METHODS, MODEL_METHODS, SpecConfig
from tuner.config import BATCH_SIZE_LIMIT, K_LIMIT
from tuner.controller.candidates import same_draft


def validate_spec_config(config: Any, k_max: int | None) -> dict[str, Any]:
    """The config as a dict if it may be sent to vLLM; else ``ValueError`` naming what is wrong.

    Keys known to vLLM's SpeculativeConfig; method known (``*_mtp`` variants, or ``off`` alone); K an
    integer in ``0..min(k_max, K_LIMIT)``; a per-batch-size table of rows [lo, hi, K] contiguous from 1
    with every K ≤ the config's K; a model for model-based methods; finite numbers.
    """
    from tuner.store.rows import FieldError, check_k_table

    if not isinstance(config, dict):
        raise ValueError(f"the config must be a JSON object such as {EXAMPLE} but got {json.dumps(config)}")
    unknown = sorted(str(key) for key in config if key not in KNOWN_KEYS)
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(repr(u) for u in unknown)}: vLLM's speculative config has no such "
            "setting (see `vllm serve --help=speculative-config`)"
        )
    method = config.get("method")
    if not isinstance(method, str) or not (method in KNOWN_METHODS or method.endswith("_mtp")):
        raise ValueError(
            f"method {method!r} is not a vLLM speculative method; use one of {', '.join(sorted(KNOWN_METHODS))} "
            "(or a *_mtp variant)"
        )
    if method == "off":
        # K = 0 is allowed: it is how spectuner writes "off" itself (a canary's promotion order carries it)
        zero_k = type(config.get(K_KEY)) is int and config[K_KEY] == 0
        extra = sorted(key for key in set(config) - {"method"} if not (key == K_KEY and zero_k))
        if extra:
            raise ValueError(f'method "off" takes no other keys (but {K_KEY} = 0); drop {", ".join(extra)}')
        return dict(config)
    k = config.get(K_KEY)
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{K_KEY} (K) must be an integer ≥ 0 but got {json.dumps(k)}")
    if method in MODEL_METHODS and not (isinstance(config.get("model"), str) and config["model"]):
        raise ValueError(f'method {method!r} needs "model": the draft model path or hub name')
    ks = [k]
    table = config.get(K_TABLE_KEY)
    if table is not None:
        if not isinstance(table, list):
            raise ValueError(
                f"{K_TABLE_KEY} must be rows [lo, hi, K] but got {json.dumps(table)}"
            )
        try:
            rows = check_k_table(table)
        except FieldError as exc:
            raise ValueError(f"{K_TABLE_KEY}: {exc}") from None
        assert rows is not None
        top = max(r[2] for r in rows)
        if rows[-1][1] > BATCH_SIZE_LIMIT:  # the plugin expands the table into a list that long
            raise ValueError(
                f"{K_TABLE_KEY} reaches batch size {rows[-1][1]}; the table stops at "
                f"{BATCH_SIZE_LIMIT} (vLLM --max-num-seqs)"
            )
        if top > k:
            raise ValueError(
                f"the per-batch-size table uses K={top} above {K_KEY}={k}: vLLM treats "
                f"{K_KEY} as the table's maximum; raise it to {top}"
            )
        ks.extend(r[2] for r in rows)
    if max(ks) > K_LIMIT:
        raise ValueError(f"K={max(ks)} is above {K_LIMIT}, the most spectuner sends; choose a smaller K")
    if k_max is not None and max(ks) > k_max:
        raise ValueError(
            f"K={max(ks)} is above the engine's K_max {k_max} (policy.k_max of the config, or --k-max); "
            "choose a smaller K or raise K_max"
        )
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{key} is {value}; use a finite number")
    return dict(config)


def check_override(
    spec: Mapping[str, Any],
    *,
    k_max: int,
    drafts: Sequence[DraftCandidate],
    memory: MemoryBudget | None = None,
    running_seqs: int = 1,
) -> str | None:
    """None when the daemon may apply ``spec`` as an override; else the reason to audit.

    ``k_max``: the daemon's policy.k_max. ``drafts``: its candidates (config ``[[drafts]]`` and the
    registry); a model-based method must name one of their models (ngram/suffix need none).
    ``memory``: its budget, checked at the largest K with ``running_seqs`` sequences (policy's
    max_batch_size for a worst case); a candidate without a known size is not checked.
    """
    try:
        config = validate_spec_config(dict(spec), k_max)
    except ValueError as exc:
        return f"override refused: {exc}"
    method = str(config["method"])
    if method == "off" or method in FREE_METHODS:
        return None
    model = config.get("model")
    requested = SpecConfig.from_vllm(config)
    known = [d for d in drafts if d.path is not None and same_draft(requested, d)]
    if not known:
        paths = ", ".join(sorted({f"{d.name} ({d.method}: {d.path})" for d in drafts if d.path})) or "none"
        return (
            f"override refused: {method} draft {model!r} is not a candidate of this daemon (known: {paths}); "
            "add it to [[drafts]] or `spectuner drafts add` first"
        )
    if memory is None:
        return None
    draft = known[0]
    if draft.params <= 0 and draft.kv_bytes_per_token <= 0:
        return None  # size unknown: the guardrails of a normal change would not check it either
    table = config.get(K_TABLE_KEY) or []
    k = max([int(config[K_KEY]), *(int(row[2]) for row in table)])
    footprint = DraftFootprint(method, weight_bytes(draft.params, draft.dtype), draft.kv_bytes_per_token)
    fit = check_memory(footprint, k, running_seqs, memory)
    return None if fit.fits else f"override refused: {fit.message}"
