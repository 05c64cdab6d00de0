"""Memory cost of speculation: draft weights, draft KV cache and K lookahead slots per sequence.

Purely computational: takes an already-parsed ``config.json`` dict, never opens files.

- draft weights = parameters × bytes per parameter (dtype);
- KV bytes per token = layers × 2 (K and V) × KV heads × head dim × bytes per element;
- each running sequence holds its context in the draft's KV cache too, and reserves K lookahead
  slots (target + draft KV) for the tokens being verified;
- ngram (CPU or GPU) and suffix speculation load no model and keep no KV on the GPU: they cost
  nothing here (suffix decoding's suffix trees live in host memory, which this model does not budget);
- EAGLE and EAGLE-3 heads are draft checkpoints of one (or a few) decoder layers: their config.json
  and tensors give the footprint like any draft (the target's embedding and LM head, when shared, are
  not in the checkpoint and cost nothing extra);
- MTP modules ship inside the target checkpoint: :func:`mtp_footprint` sizes them from the target's
  config (``num_nextn_predict_layers`` modules, each taken as one decoder layer).

The budget is extra bytes speculation may use, and/or a minimum KV concurrency (how many sequences
of ``tokens_per_seq`` tokens the KV pool must still hold, as vLLM's "maximum concurrency" line
reports it). vLLM loads the draft's weights before sizing the KV pool, so they come out of the pool.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

# Bytes per element. Names as they appear in config.json ``torch_dtype``/``dtype`` and vLLM's
# ``--dtype``/``--kv-cache-dtype``.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "int8": 1,
    "uint8": 1,
    "int4": 0.5,
    "fp4": 0.5,
    "nvfp4": 0.5,
}

FREE_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


def dtype_bytes(dtype: str) -> float:
    """Bytes per element for a dtype name (``torch.float16`` and ``float16`` alike)."""
    name = str(dtype).strip().lower().removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


def _first(config: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def _positive_int(config: Mapping[str, Any], what: str, *names: str) -> int:
    value = _first(config, *names)
    if value is None:
        raise ValueError(f"config.json has no {what} (looked for {', '.join(names)})")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json {what} must be a positive integer but got {value!r}")
    return value


def kv_bytes_per_token(config: Mapping[str, Any], kv_cache_dtype: str | None = None) -> int:
    """layers × 2 × KV heads × head dim × bytes, from a parsed Hugging Face ``config.json``
    (multi-head latent attention: layers × (kv_lora_rank + qk_rope_head_dim) × bytes).

    ``kv_cache_dtype`` overrides the model dtype (vLLM ``--kv-cache-dtype fp8``). Multimodal configs
    keep the language model under ``text_config``; it is used when the top level has no layers.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a parsed config.json mapping but got {type(config).__name__}")
    if _first(config, "num_hidden_layers", "n_layer", "num_layers") is None and isinstance(
        config.get("text_config"), Mapping
    ):
        outer_dtype = _first(config, "torch_dtype", "dtype")
        config = dict(config["text_config"])
        config.setdefault("torch_dtype", outer_dtype)
    layers = _positive_int(config, "number of layers", "num_hidden_layers", "n_layer", "num_layers")
    dtype = kv_cache_dtype if kv_cache_dtype not in (None, "auto") else _first(config, "torch_dtype", "dtype")
    if dtype is None:
        raise ValueError("config.json names no dtype (torch_dtype); pass kv_cache_dtype explicitly")
    if config.get("kv_lora_rank") is not None:
        # Multi-head latent attention (DeepSeek V2/V3, their MTP modules): one latent vector plus the
        # rotary key part per token and layer, no separate K and V (as vLLM's MLA cache stores it).
        latent = _positive_int(config, "KV LoRA rank", "kv_lora_rank")
        rope = _positive_int(config, "rotary head dim", "qk_rope_head_dim")
        return math.ceil(layers * (latent + rope) * dtype_bytes(str(dtype)))
    heads = _positive_int(config, "number of attention heads", "num_attention_heads", "n_head")
    if config.get("multi_query") is True:
        kv_heads = 1
    elif _first(config, "num_key_value_heads", "num_kv_heads") is not None:
        kv_heads = _positive_int(config, "number of KV heads", "num_key_value_heads", "num_kv_heads")
    else:
        kv_heads = heads
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head dim", "head_dim")
    else:
        hidden = _positive_int(config, "hidden size", "hidden_size", "n_embd", "d_model")
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of {heads} heads; set head_dim")
        head_dim = hidden // heads
    return math.ceil(layers * 2 * kv_heads * head_dim * dtype_bytes(str(dtype)))


def weight_bytes(num_params: int, dtype: str) -> int:
    """Draft weights: parameters × bytes per parameter."""
    if isinstance(num_params, bool) or not isinstance(num_params, int) or num_params < 0:
        raise ValueError(f"parameter count must be an integer ≥ 0 but got {num_params!r}")
    return math.ceil(num_params * dtype_bytes(dtype))


@dataclass(frozen=True)
class DraftFootprint:
    """What one speculation method costs in memory. ngram/suffix: zero for both."""

    method: str
    weights_bytes: int = 0
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if self.weights_bytes < 0 or self.kv_bytes_per_token < 0:
            raise ValueError(f"memory footprint cannot be negative but got {self!r}")
        if self.method in FREE_METHODS and (self.weights_bytes or self.kv_bytes_per_token):
            raise ValueError(f"{self.method} speculation loads no model: its footprint must be zero")

    @classmethod
    def from_config(
        cls, method: str, config: Mapping[str, Any], num_params: int, dtype: str | None = None
    ) -> DraftFootprint:
        """A draft model's footprint from its parsed config.json and parameter count."""
        name = dtype if dtype is not None else _first(config, "torch_dtype", "dtype")
        if name is None:
            raise ValueError("the draft's dtype is unknown: config.json has no torch_dtype; pass dtype")
        return cls(method, weight_bytes(num_params, str(name)), kv_bytes_per_token(config, dtype))


@dataclass(frozen=True)
class MemoryBudget:
    """Limits speculation must respect. Either limit may be None (not enforced).

    ``budget_bytes``: extra bytes speculation may use. ``min_kv_concurrency``: sequences of
    ``tokens_per_seq`` tokens the KV pool must still hold (needs ``kv_pool_bytes`` and
    ``target_kv_bytes_per_token``). ``tokens_per_seq``: context each running sequence keeps
    (max_model_len for a worst case).
    """

    budget_bytes: int | None = None
    min_kv_concurrency: float | None = None
    kv_pool_bytes: int | None = None
    target_kv_bytes_per_token: int = 0
    tokens_per_seq: int = 0

    def __post_init__(self) -> None:
        if self.budget_bytes is not None and self.budget_bytes < 0:
            raise ValueError(f"memory budget cannot be negative but got {self.budget_bytes} bytes")
        if self.min_kv_concurrency is not None:
            if self.min_kv_concurrency < 0:
                raise ValueError(f"minimum KV concurrency cannot be negative but got {self.min_kv_concurrency}")
            if not self.kv_pool_bytes or self.target_kv_bytes_per_token <= 0 or self.tokens_per_seq <= 0:
                raise ValueError(
                    "a minimum KV concurrency needs kv_pool_bytes, target_kv_bytes_per_token and tokens_per_seq"
                )
        if self.target_kv_bytes_per_token < 0 or self.tokens_per_seq < 0:
            raise ValueError("KV bytes per token and tokens per sequence cannot be negative")


class MemoryReason(StrEnum):
    FITS = "fits"
    OVER_BUDGET_BYTES = "over_budget_bytes"
    BELOW_MIN_CONCURRENCY = "below_min_kv_concurrency"


@dataclass(frozen=True)
class MemoryCheck:
    fits: bool
    reason: MemoryReason
    message: str
    extra_bytes: int
    kv_concurrency: float | None


def speculation_bytes(
    draft: DraftFootprint, k: int, running_seqs: int, tokens_per_seq: int, target_kv_bytes_per_token: int
) -> int:
    """Extra bytes with K speculative tokens and ``running_seqs`` sequences; 0 when K = 0 or free."""
    if k <= 0 or draft.method in FREE_METHODS:
        return 0
    per_seq = draft.kv_bytes_per_token * (tokens_per_seq + k) + target_kv_bytes_per_token * k
    return draft.weights_bytes + running_seqs * per_seq


def check_memory(draft: DraftFootprint, k: int, running_seqs: int, budget: MemoryBudget) -> MemoryCheck:
    """Does speculation with this draft at K fit the budget with ``running_seqs`` sequences?"""
    extra = speculation_bytes(draft, k, running_seqs, budget.tokens_per_seq, budget.target_kv_bytes_per_token)
    concurrency: float | None = None
    if budget.kv_pool_bytes and budget.target_kv_bytes_per_token > 0 and budget.tokens_per_seq > 0:
        spends = k > 0 and draft.method not in FREE_METHODS
        pool = budget.kv_pool_bytes - (draft.weights_bytes if spends else 0)
        per_token = budget.target_kv_bytes_per_token + (draft.kv_bytes_per_token if spends else 0)
        slots = budget.tokens_per_seq + (k if spends else 0)
        concurrency = max(pool, 0) / (per_token * slots)
    if budget.budget_bytes is not None and extra > budget.budget_bytes:
        return MemoryCheck(
            False,
            MemoryReason.OVER_BUDGET_BYTES,
            f"{draft.method} at K = {k} with {running_seqs} sequences needs {extra / 2**20:.1f} MiB, "
            f"over the {budget.budget_bytes / 2**20:.1f} MiB budget.",
            extra,
            concurrency,
        )
    if budget.min_kv_concurrency is not None and concurrency is not None and concurrency < budget.min_kv_concurrency:
        return MemoryCheck(
            False,
            MemoryReason.BELOW_MIN_CONCURRENCY,
            f"{draft.method} at K = {k} leaves KV room for {concurrency:.1f} sequences of "
            f"{budget.tokens_per_seq} tokens, below the required {budget.min_kv_concurrency:g}.",
            extra,
            concurrency,
        )
    return MemoryCheck(
        True,
        MemoryReason.FITS,
        f"{draft.method} at K = {k} fits ({extra / 2**20:.1f} MiB).",
        extra,
        concurrency,
    )


@dataclass(frozen=True)
class KvCapacity:
    """The engine's KV pool as measured, and how many sequences another config could run in it.

    ``tokens``: what the pool holds (``vllm:cache_config_info`` num_gpu_blocks × block_size), each token
    costing the target's KV plus the running draft's (vLLM sizes one block table over every layer, the
    draft's included); ``tokens_per_seq``: context a running sequence holds (KV usage × ``tokens`` /
    requests running, less the running config's K lookahead slots). vLLM loads a draft's weights before
    sizing the pool, so the pool plus the running draft's weights is what any config divides.
    """

    tokens: float
    target_kv_bytes_per_token: int
    tokens_per_seq: float
    running: DraftFootprint | None = None  # None: speculation off now
    running_k: int = 0

    def __post_init__(self) -> None:
        if not (self.tokens > 0 and self.target_kv_bytes_per_token > 0 and self.tokens_per_seq > 0):
            raise ValueError(f"a KV capacity needs tokens, KV bytes per token and tokens per sequence > 0: {self!r}")

    @property
    def bytes(self) -> float:
        """The KV pool plus the running draft's weights: what any config's weights and KV come out of."""
        d = self.running if self.running_k > 0 and self.running is not None else None
        if d is None or d.method in FREE_METHODS:
            return self.tokens * self.target_kv_bytes_per_token
        return self.tokens * (self.target_kv_bytes_per_token + d.kv_bytes_per_token) + d.weights_bytes

    def max_batch(self, draft: DraftFootprint | None, k: int) -> int:
        """Sequences of ``tokens_per_seq`` (+ K lookahead slots) that fit with ``draft`` at K (None or
        K = 0: plain decoding); 0 when its weights do not fit at all."""
        lookahead = k if draft is not None and k > 0 else 0  # every method reserves its K tokens' slots
        loaded = draft if lookahead and draft is not None and draft.method not in FREE_METHODS else None
        pool = self.bytes - (loaded.weights_bytes if loaded is not None else 0)
        per_token = self.target_kv_bytes_per_token + (loaded.kv_bytes_per_token if loaded is not None else 0)
        return max(0, math.floor(pool / (per_token * (self.tokens_per_seq + lookahead)))) if pool > 0 else 0


def mtp_footprint(
    target_config: Mapping[str, Any],
    target_params: int,
    dtype: str | None = None,
    kv_cache_dtype: str | None = None,
) -> DraftFootprint:
    """MTP speculation (``method = "mtp"`` or a ``*_mtp`` model type): the target's own
    ``num_nextn_predict_layers`` modules (1 when absent), each sized as one decoder layer: weights
    ``target_params / num_hidden_layers`` per module (embedding and LM head spread over the layers,
    so an overestimate: safe for a budget), KV one layer's worth per module.
    """
    cfg = target_config
    if _first(cfg, "num_hidden_layers", "n_layer", "num_layers") is None and isinstance(
        cfg.get("text_config"), Mapping
    ):
        cfg = cfg["text_config"]
    layers = _positive_int(cfg, "number of layers", "num_hidden_layers", "n_layer", "num_layers")
    found = _first(cfg, "num_nextn_predict_layers", "mtp_num_hidden_layers")
    modules = 1 if found is None else found
    if isinstance(modules, bool) or not isinstance(modules, int) or modules <= 0:
        raise ValueError(f"config.json num_nextn_predict_layers must be a positive integer but got {modules!r}")
    name = dtype if dtype is not None else _first(target_config, "torch_dtype", "dtype") or _first(cfg, "torch_dtype")
    if name is None:
        raise ValueError("the target's dtype is unknown: config.json has no torch_dtype; pass dtype")
    per_layer_kv = kv_bytes_per_token(target_config, kv_cache_dtype) / layers
    return DraftFootprint(
        "mtp",
        weight_bytes(math.ceil(target_params * modules / layers), str(name)),
        math.ceil(per_layer_kv * modules),
    )
