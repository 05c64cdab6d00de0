"""A shell carries a small model exactly: same logits, while its extra weights are real dense compute."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tuner.lab.widen import ShellShape, widen  # noqa: E402


def _small(seed: int = 0, hidden: int = 64, layers: int = 2, heads: int = 2, kv_heads: int | None = None) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # trained-looking norms, not all ones: the scaling must carry them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_shell_computes_the_small_models_logits() -> None:
    small = _small()
    big = widen(small, ShellShape(hidden_size=160, num_layers=4, num_heads=5, intermediate_size=512), seed=3)
    ids = torch.randint(0, 97, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = small(input_ids=ids).logits, big(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert bool((a.argmax(-1) == b.argmax(-1)).all())
    n_small = sum(p.numel() for p in small.parameters())
    n_big = sum(p.numel() for p in big.parameters())
    assert n_big > 8 * n_small


def test_the_extra_weights_are_dense_random_compute_not_zeros() -> None:
    big = widen(_small(), ShellShape(hidden_size=128, num_layers=3, num_heads=4, intermediate_size=256), seed=3)
    layer = big.model.layers[0]
    # the heads and MLP units beyond the carried ones read the residual with random weights ...
    assert float(layer.self_attn.q_proj.weight[64:].detach().abs().mean()) > 1e-3
    assert float(layer.mlp.gate_proj.weight[128:].detach().abs().mean()) > 1e-3
    extra = big.model.layers[2]  # a whole layer the small model does not have
    assert float(extra.mlp.up_proj.weight.detach().abs().mean()) > 1e-3
    # ... and write nothing back into the residual stream
    assert float(layer.self_attn.o_proj.weight[:, 64:].detach().abs().max()) == 0.0
    assert float(layer.mlp.down_proj.weight[:, 128:].detach().abs().max()) == 0.0
    assert float(extra.mlp.down_proj.weight.detach().abs().max()) == 0.0


def test_changing_the_dark_weights_changes_nothing() -> None:
    small = _small(seed=4)
    big = widen(small, ShellShape(hidden_size=128, num_layers=3, num_heads=4, intermediate_size=256), seed=3)
    other = widen(small, ShellShape(hidden_size=128, num_layers=3, num_heads=4, intermediate_size=256), seed=99)
    assert not torch.equal(big.model.layers[2].mlp.up_proj.weight, other.model.layers[2].mlp.up_proj.weight)
    ids = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(big(input_ids=ids).logits, other(input_ids=ids).logits, atol=1e-4)


@pytest.mark.parametrize(
    ("shape", "why"),
    [
        (ShellShape(32, 2, 1, 128), "smaller"),
        (ShellShape(128, 1, 4, 256), "smaller"),
        (ShellShape(128, 2, 3, 256), "heads"),
        (ShellShape(128, 2, 4, 64), "intermediate"),
    ],
)
def test_a_shell_that_cannot_carry_the_model_is_refused(shape: ShellShape, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        widen(_small(), shape, seed=0)


def test_grouped_query_attention_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="grouped-query"):
        widen(_small(heads=2, kv_heads=1), ShellShape(128, 2, 4, 256), seed=0)
