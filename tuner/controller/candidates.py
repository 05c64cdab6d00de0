"""Draft candidates for the swap policy: the config file's ``[[drafts]]`` plus the operator's registry
(``spectuner drafts add``), turned into :class:`policies.draft_choice.DraftCandidate`.

A candidate's memory footprint needs its parameter count and KV bytes per token; when the config
does not give them they are read from a local model directory (``config.json`` and the safetensors
headers), so an operator only has to name the path. A hub name without a local copy keeps what was
given (unknown sizes count as zero: the memory rail then cannot protect against that candidate, and
the candidate's ``message`` says so).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from policies.draft_choice import DraftCandidate
from policies.memory import FREE_METHODS, kv_bytes_per_token
from policies.spec_config import SpecConfig, is_mtp_method

log = logging.getLogger(__name__)

def read_model_config(path: str | None) -> dict[str, Any] | None:
    """The parsed ``config.json`` of a local model directory, else None (hub name, unreadable)."""
    if not path:
        return None
    p = Path(path).expanduser() / "config.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


_MAX_HEADER_BYTES = 100 << 20  # safetensors caps its JSON header at 100 MB


def count_params(path: str | None) -> int | None:
    """Parameters in a local model's safetensors files, read from their headers (no tensors loaded)."""
    if not path:
        return None
    files = sorted(Path(path).expanduser().glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for f in files:
            with f.open("rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                # a corrupt file's "length" can be anything: never read more than the file holds
                if not 0 < n <= min(f.stat().st_size - 8, _MAX_HEADER_BYTES):
                    return None
                header = json.loads(fh.read(n))
            if not isinstance(header, dict):
                return None
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                count = 1
                for dim in meta["shape"]:
                    count *= int(dim)
                total += count
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def build_candidate(
    name: str,
    method: str,
    model: str | None,
    *,
    num_params: int | None = None,
    dtype: str | None = None,
    kv_bytes: int | None = None,
    prior_alpha: float = 0.5,
    cost_ratio: float | None = None,
    extra: Mapping[str, Any] | None = None,
    draft_fixed_s: float | None = None,
    draft_per_seq_s: float | None = None,
) -> DraftCandidate:
    """A :class:`DraftCandidate`, sizes filled from the local model directory where not given."""
    if method in FREE_METHODS:
        return DraftCandidate(
            name,
            method,
            None,
            prior_alpha=prior_alpha,
            cost_ratio=cost_ratio,
            speculative_config=dict(extra or {}),
            draft_fixed_s=draft_fixed_s,
            draft_per_seq_s=draft_per_seq_s,
        )
    cfg = read_model_config(model)
    if dtype is None and cfg is not None:
        found = cfg.get("torch_dtype") or cfg.get("dtype")
        dtype = str(found) if found else None
    if kv_bytes is None and cfg is not None:
        try:
            kv_bytes = kv_bytes_per_token(cfg, dtype)
        except ValueError as exc:
            log.warning("draft %s: KV bytes per token unknown (%s)", name, exc)
    if num_params is None:
        num_params = count_params(model)
    return DraftCandidate(
        name,
        method,
        model,
        params=num_params or 0,
        kv_bytes_per_token=kv_bytes or 0,
        prior_alpha=prior_alpha,
        dtype=dtype or "bfloat16",
        cost_ratio=cost_ratio,
        speculative_config=dict(extra or {}),
        draft_fixed_s=draft_fixed_s,
        draft_per_seq_s=draft_per_seq_s,
    )


def same_draft(spec: SpecConfig, candidate: DraftCandidate) -> bool:
    """Whether a speculative config runs this candidate (same method and draft model; paths compared
    resolved, so ``./drafts/x`` and ``/srv/drafts/x`` are one draft)."""
    if spec.method != candidate.method:
        return False
    if candidate.free:
        return True
    return _norm(spec.model) == _norm(candidate.path)


def _norm(path: Any) -> str | None:
    if not isinstance(path, str) or not path:
        return None
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def current_candidate(
    spec: SpecConfig, candidates: Sequence[DraftCandidate], default_cost_ratio: float | None
) -> tuple[DraftCandidate | None, list[DraftCandidate]]:
    """The candidate the engine runs now and the full list (the running draft is added, named after
    its path, when no configured candidate matches it)."""
    for c in candidates:
        if same_draft(spec, c):
            return c, list(candidates)
    if spec.is_off:
        return None, list(candidates)
    if spec.method not in FREE_METHODS and not spec.model and not is_mtp_method(spec.method):
        return None, list(candidates)
    name = "current:" + (Path(spec.model).name if spec.model else spec.method)
    running = build_candidate(name, spec.method, spec.model, cost_ratio=default_cost_ratio)
    return running, [*candidates, running]


__all__ = [
    "build_candidate",
    "count_params",
    "current_candidate",
    "read_model_config",
    "same_draft",
]
