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
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from policies.draft_choice import DraftCandidate
from policies.memory import FREE_METHODS, kv_bytes_per_token

log = logging.getLogger(__name__)

DRAFT_KEYS = ("method", "model")


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
                header = json.loads(fh.read(n))
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                count = 1
                for dim in meta["shape"]:
                    count *= int(dim)
                total += count
    except (OSError, ValueError, KeyError, struct.error):
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
) -> DraftCandidate:
    """A :class:`DraftCandidate`, sizes filled from the local model directory where not given."""
    if method in FREE_METHODS:
        return DraftCandidate(
            name, method, None, prior_alpha=prior_alpha, cost_ratio=cost_ratio, speculative_config=dict(extra or {})
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
    )


def same_draft(spec: Mapping[str, Any], candidate: DraftCandidate) -> bool:
    """Whether a speculative config runs this candidate (same method and draft model)."""
    if spec.get("method") != candidate.method:
        return False
    if candidate.free:
        return True
    return _norm(spec.get("model")) == _norm(candidate.path)


def _norm(path: Any) -> str | None:
    if not isinstance(path, str) or not path:
        return None
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else path


def current_candidate(
    spec: Mapping[str, Any], candidates: Sequence[DraftCandidate], default_cost_ratio: float | None
) -> tuple[DraftCandidate | None, list[DraftCandidate]]:
    """The candidate the engine runs now and the full list (the running draft is added, named after
    its path, when no configured candidate matches it)."""
    for c in candidates:
        if same_draft(spec, c):
            return c, list(candidates)
    method = spec.get("method")
    if not isinstance(method, str) or method == "off":
        return None, list(candidates)
    model = spec.get("model") if isinstance(spec.get("model"), str) else None
    if method not in FREE_METHODS and not model:
        return None, list(candidates)
    name = "current:" + (Path(model).name if model else method)
    running = build_candidate(name, method, model, cost_ratio=default_cost_ratio)
    return running, [*candidates, running]


def spec_config_for(candidate: DraftCandidate, k: int, table: Iterable[Sequence[int]] | None = None) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` running ``candidate`` at K (and a per-batch-size table)."""
    if k <= 0 and table is None:
        return {"method": "off", "num_speculative_tokens": 0}
    cfg: dict[str, Any] = {"method": candidate.method, "num_speculative_tokens": int(k)}
    if candidate.path:
        cfg["model"] = candidate.path
    cfg.update(dict(candidate.speculative_config))
    if table is not None:
        cfg["num_speculative_tokens_per_batch_size"] = [[int(x) for x in row] for row in table]
    return cfg


__all__ = [
    "build_candidate",
    "count_params",
    "current_candidate",
    "read_model_config",
    "same_draft",
    "spec_config_for",
]
