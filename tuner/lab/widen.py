"""Embed a small trained Llama inside a larger one that computes exactly the same logits.

Why: on 2 CPU cores a model large enough to have GPU-like step-cost physics (the forward pass
dominating per-step overhead, verification growing with tokens) cannot be trained in a build's
minutes, but its *text* only has to be the small trained model's. The large model ("shell") carries
the small one in its first ``h`` residual dimensions, its first heads and first MLP units and its first
layers; every other weight is dense random compute whose *write back* into the residual stream is
zero. So the engine does the full shell's arithmetic on every token (no kernel skips a dense matmul of
random numbers) and still predicts exactly what the small model predicts.

The details that keep the logits equal:

- the residual stream's extra dimensions start at zero (embedding columns zero) and stay zero (every
  ``o_proj`` / ``down_proj`` row beyond ``h`` is zero);
- RMSNorm averages over the shell's width ``H``: with the extra dimensions zero, the mean square is
  ``h / H`` of the small model's, so the norm weights are scaled by ``sqrt(h / H)`` and its epsilon
  by ``h / H``;
- extra heads and MLP units compute from the residual (random q/k/v, gate/up) but their output
  columns in ``o_proj`` / ``down_proj`` are zero; extra layers are whole random layers with zero
  output projections (residual pass-through).

The small model's head dimension and rotary settings are kept, so attention is the same per head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ShellShape:
    """A shell's shape; every field at least the embedded model's."""

    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


def widen(small: Any, shape: ShellShape, seed: int) -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` whose logits equal ``small``'s (fp32, to rounding)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sc = small.config
    h, hs = int(sc.hidden_size), shape.hidden_size
    head_dim = int(getattr(sc, "head_dim", None) or h // sc.num_attention_heads)
    heads = int(sc.num_attention_heads)
    if int(sc.num_key_value_heads or heads) != heads:
        raise ValueError("widen: grouped-query attention in the small model is not supported")
    if hs < h or shape.num_layers < sc.num_hidden_layers or shape.num_heads < heads:
        raise ValueError(f"widen: shell {shape} is smaller than the model it must carry")
    if shape.num_heads * head_dim != hs:
        raise ValueError(f"widen: {shape.num_heads} heads × head_dim {head_dim} must equal hidden {hs}")
    if shape.intermediate_size < sc.intermediate_size:
        raise ValueError(f"widen: intermediate {shape.intermediate_size} < {sc.intermediate_size}")

    cfg_kw = sc.to_dict()
    for k in ("architectures", "transformers_version", "_name_or_path"):
        cfg_kw.pop(k, None)
    cfg_kw.update(
        hidden_size=hs,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        intermediate_size=shape.intermediate_size,
        head_dim=head_dim,
        # mean square over H with zeros beyond h is (h/H)× the small one's: scale eps alike
        rms_norm_eps=float(sc.rms_norm_eps) * h / hs,
    )
    torch.manual_seed(seed)
    big = LlamaForCausalLM(LlamaConfig(**cfg_kw))
    norm_scale = math.sqrt(h / hs)
    d = h  # q/k/v/o widths of the carried heads: heads × head_dim == h
    i = int(sc.intermediate_size)
    with torch.no_grad():
        big.model.embed_tokens.weight.zero_()
        big.model.embed_tokens.weight[:, :h] = small.model.embed_tokens.weight
        big.lm_head.weight.zero_()
        big.lm_head.weight[:, :h] = small.lm_head.weight
        big.model.norm.weight.fill_(1.0)
        big.model.norm.weight[:h] = small.model.norm.weight * norm_scale
        for n, layer in enumerate(big.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            # Dark compute writes nothing back: zero output projections first, then carry the small layer.
            attn.o_proj.weight.zero_()
            mlp.down_proj.weight.zero_()
            if n >= sc.num_hidden_layers:
                continue
            s = small.model.layers[n]
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(attn, name).weight
                w[:d, :] = 0.0
                w[:d, :h] = getattr(s.self_attn, name).weight
            attn.o_proj.weight[:h, :d] = s.self_attn.o_proj.weight
            for name in ("gate_proj", "up_proj"):
                w = getattr(mlp, name).weight
                w[:i, :] = 0.0
                w[:i, :h] = getattr(s.mlp, name).weight
            mlp.down_proj.weight[:h, :i] = s.mlp.down_proj.weight
            layer.input_layernorm.weight.fill_(1.0)
            layer.input_layernorm.weight[:h] = s.input_layernorm.weight * norm_scale
            layer.post_attention_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight[:h] = s.post_attention_layernorm.weight * norm_scale
    big.eval()
    return big
