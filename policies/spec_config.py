"""The speculative-decoding config as one typed value: :class:`SpecConfig`.

vLLM takes it as a JSON object (``--speculative-config``). Inside spectuner every layer passes this
frozen value instead; only the vLLM edge (actuators, the lab engine, the plugin, the config file's
``[speculative]`` table) converts with :meth:`SpecConfig.from_vllm` / :meth:`SpecConfig.to_vllm`, so
this is the one module that knows vLLM's key names. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

# vLLM's keys for the three fields spectuner reasons about; every other key rides along in ``extra``.
_METHOD = "method"
_MODEL = "model"
_K = "num_speculative_tokens"
_TABLE = "num_speculative_tokens_per_batch_size"
K_KEY = _K  # vLLM's name for K, for the places that print vLLM's JSON keys to an operator
K_TABLE_KEY = _TABLE
K_KEYS = (_K, _TABLE)  # what a live K change may touch (the draft stays loaded)
RESERVED_KEYS = frozenset({_METHOD, _MODEL, *K_KEYS})

# vLLM 0.32's speculative methods (SpeculativeConfig.method; *_mtp variants too) plus "off".
KNOWN_METHODS = frozenset(
    {"draft_model", "eagle", "eagle3", "ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator", "mtp", "off"}
)
MODEL_METHODS = frozenset({"draft_model", "eagle", "eagle3", "medusa", "mlp_speculator"})

# The keys of vLLM 0.32's SpeculativeConfig an operator may set (its init fields, less the ones vLLM
# fills in itself: draft/target model and parallel configs). Anything else is refused, not forwarded.
KNOWN_KEYS = frozenset(
    {
        "attention_backend",
        "code_revision",
        "disable_eagle_block_drop",
        "disable_padded_drafter_batch",
        "draft_sample_method",
        "draft_tensor_parallel_size",
        "dspark_draft_topk",
        "enable_adaptive_verification",
        "enforce_eager",
        "index_share_for_mtp_iteration",
        "kv_cache_dtype",
        "max_model_len",
        "method",
        "model",
        "moe_backend",
        "num_speculative_tokens",
        "num_speculative_tokens_per_batch_size",
        "parallel_drafting",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "quantization",
        "rejection_sample_method",
        "revision",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_min_token_prob",
        "tensor_parallel_size",
        "use_heterogeneous_vocab",
        "use_local_argmax_reduction",
    }
)

EXAMPLE = '{"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}'

OFF_METHOD = "off"

# vLLM methods whose proposer runs a model forward every step, K = 0 included, to keep the draft's KV
# cache in sync (SpeculativeConfig.uses_draft_kv_cache: use_eagle() or uses_draft_model() or
# uses_extract_hidden_states(); the MTP aliases are folded into "mtp" by vLLM).
_DRAFT_PASS_METHODS = frozenset({"draft_model", "eagle", "eagle3", "mtp", "dflash", "dspark", "extract_hidden_states"})

KRow = tuple[int, int, int]  # (lowest batch size, highest batch size, K), both ends inclusive


class ChangeKind(StrEnum):
    DRAFT_SWAPPED = "draft_swapped"  # the method or the draft model changes
    K_CHANGED = "k_changed"  # only K or the per-batch-size table changes


def is_mtp_method(method: object) -> bool:
    """Multi-token prediction: the draft is the target's own next-token modules (vLLM folds the
    ``*_mtp`` aliases into ``mtp``)."""
    return isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))


def method_drafts_at_k0(method: object) -> bool:
    """Does a K = 0 step under this speculative method still run a draft pass?"""
    return isinstance(method, str) and (method in _DRAFT_PASS_METHODS or method.endswith("_mtp"))


@dataclass(frozen=True)
class SpecConfig:
    """One engine's speculative-decoding config.

    ``k`` is the K the engine starts with (K_max under a table); ``k_table`` is vLLM's per-batch-size
    table, rows ``(lo, hi, K)`` ascending, the first starting at 1. ``k`` is None when the source did
    not name it (kept so that a config round-trips to the very JSON it came from). ``extra`` holds any
    other vLLM key as given (``prompt_lookup_max``, ``draft_tensor_parallel_size``…).
    """

    method: str = OFF_METHOD
    model: str | None = None
    k: int | None = None
    k_table: tuple[KRow, ...] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    # -- the vLLM edge ---------------------------------------------------------------------------
    @classmethod
    def from_vllm(cls, config: Mapping[str, Any] | None) -> SpecConfig:
        """Parse vLLM's ``--speculative-config`` object. None or ``{}`` is speculation off.

        Raises ValueError naming the bad key when a field has the wrong type."""
        if not config:
            return OFF
        method = config.get(_METHOD, OFF_METHOD)
        if not isinstance(method, str) or not method:
            raise ValueError(f'speculative config: "method" must be a non-empty string but got {method!r}')
        model = config.get(_MODEL)
        if model is not None and not isinstance(model, str):
            raise ValueError(f'speculative config: "model" must be a string but got {model!r}')
        k = config.get(_K)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f'speculative config: "{_K}" must be an integer ≥ 0 but got {k!r}')
        rows = config.get(_TABLE)
        table: tuple[KRow, ...] | None = None
        if rows is not None:
            table = _parse_table(rows)
        extra = {key: v for key, v in config.items() if key not in RESERVED_KEYS}
        return cls(method, model or None, k, table, extra)

    def to_vllm(self) -> dict[str, Any]:
        """vLLM's ``--speculative-config`` object (the exact keys it was parsed from)."""
        out: dict[str, Any] = {_METHOD: self.method}
        if self.model:
            out[_MODEL] = self.model
        if self.k is not None:
            out[_K] = self.k
        if self.k_table:
            out[_TABLE] = [list(row) for row in self.k_table]
        out.update(self.extra)
        return out

    @property
    def fingerprint(self) -> str:
        """A stable text identity (key order does not matter)."""
        return json.dumps(self.to_vllm(), sort_keys=True, separators=(",", ":"))

    # -- what it means ---------------------------------------------------------------------------
    @property
    def is_off(self) -> bool:
        return self.method == OFF_METHOD

    @property
    def speculates(self) -> bool:
        """Speculation is on with a K ≥ 1 (there is acceptance to measure and K to tune)."""
        return not self.is_off and self.k is not None and self.k >= 1

    @property
    def draft(self) -> tuple[str, str | None]:
        """The draft's identity: (method, draft model). Two configs with the same draft differ in K only."""
        return self.method, self.model

    @property
    def drafts_at_k0(self) -> bool:
        """Whether a K = 0 step (a table's row) still runs the draft model's pass (see vLLM's proposer)."""
        return method_drafts_at_k0(self.method)

    def table_rows(self, max_batch_size: int) -> tuple[KRow, ...] | None:
        """The table in force: vLLM's rows, or one row ``(1, max_batch_size, K)`` without a table;
        None when K is unknown."""
        if self.k_table:
            return self.k_table
        return ((1, max_batch_size, self.k),) if self.k is not None else None

    def effective_table(self, open_end: int) -> tuple[KRow, ...] | None:
        """What the engine drafts per batch size: vLLM caps each row's K at ``k`` (a plain K is one row
        up to ``open_end``). None without speculation."""
        if self.is_off:
            return None
        k = self.k or 0
        if not self.k_table:
            return ((1, open_end, k),)
        return tuple((lo, hi, min(row_k, k)) for lo, hi, row_k in self.k_table)

    def k_at(self, batch_size: int) -> int:
        """K drafted at ``batch_size``: the table row holding it (beyond the last row, the last row's;
        below the first, the first's), else ``k``; 0 when off."""
        if self.is_off:
            return 0
        if not self.k_table:
            return self.k or 0
        return k_at(self.k_table, batch_size)

    def largest_k(self) -> int | None:
        """The largest K any step may draft (a table's largest row), 0 when off, None when unknown."""
        if self.is_off:
            return 0
        if self.k_table:
            return max(row[2] for row in self.k_table)
        return self.k

    # -- derived configs -------------------------------------------------------------------------
    def with_k(self, k: int) -> SpecConfig:
        """This draft at one K (no table); K = 0 is speculation off (the draft is unloaded)."""
        if k == 0:
            return OFF
        return replace(self, k=k, k_table=None)

    def with_table(self, rows: Sequence[Sequence[int]], k_engine: int) -> SpecConfig:
        """This draft started at ``k_engine`` (K_max) with a per-batch-size table."""
        return replace(self, k=k_engine, k_table=_parse_table(rows))

    def describe(self) -> str:
        """One line for logs, events, the audit log and the CLI: ``config method=… draft=… K=…
        table=lo-hi:K,…``, or ``speculation off``."""
        if self.is_off:
            return "speculation off"
        parts = [f"method={self.method}"]
        if self.model:
            parts.append(f"draft={self.model}")
        if self.k is not None:
            parts.append(f"K={self.k}")
        if self.k_table:
            parts.append("table=" + ",".join(f"{lo}-{hi}:{k}" for lo, hi, k in self.k_table))
        return "config " + " ".join(parts)


OFF = SpecConfig(OFF_METHOD, None, 0)  # speculation off, as spectuner proposes it


def change_kind(before: SpecConfig | None, after: SpecConfig) -> ChangeKind | None:
    """What a change from ``before`` to ``after`` is (None: nothing spectuner tracks changed)."""
    if before is None:
        return None
    if before.draft != after.draft:
        return ChangeKind.DRAFT_SWAPPED
    if before.k != after.k or before.k_table != after.k_table:
        return ChangeKind.K_CHANGED
    return None


def k_at(rows: Sequence[KRow], batch_size: int) -> int:
    """K of the row holding ``batch_size`` (beyond the last row, the last row's; below the first, the first's)."""
    for lo, hi, k in rows:
        if lo <= batch_size <= hi:
            return k
    return rows[-1][2] if batch_size > rows[-1][1] else rows[0][2]


def _parse_table(rows: object) -> tuple[KRow, ...]:
    if not isinstance(rows, list | tuple) or not rows:
        raise ValueError(f'speculative config: "{_TABLE}" must be a non-empty list of [lo, hi, K] rows')
    out: list[KRow] = []
    for row in rows:
        if (
            not isinstance(row, list | tuple)
            or len(row) != 3
            or any(isinstance(x, bool) or not isinstance(x, int) for x in row)
        ):
            raise ValueError(f'speculative config: "{_TABLE}" row {row!r} is not [lo, hi, K] of integers')
        lo, hi, k = (int(x) for x in row)
        out.append((lo, hi, k))
    return tuple(out)


__all__ = [
    "EXAMPLE",
    "KNOWN_KEYS",
    "KNOWN_METHODS",
    "K_KEY",
    "K_KEYS",
    "K_TABLE_KEY",
    "MODEL_METHODS",
    "OFF",
    "OFF_METHOD",
    "RESERVED_KEYS",
    "ChangeKind",
    "KRow",
    "SpecConfig",
    "change_kind",
    "is_mtp_method",
    "k_at",
    "method_drafts_at_k0",
]
