"""The typed speculative config (policies/spec_config.py): the vLLM edge, K per batch size, change kinds."""

from __future__ import annotations

import pytest

from policies.spec_config import OFF, ChangeKind, SpecConfig, change_kind

WEAK_SPEC = {"method": "draft_model", "model": "/models/weak", "num_speculative_tokens": 3}


def test_current_table_without_rows_is_one_row_at_k() -> None:
    assert SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 4}).table_rows(8) == ((1, 8, 4),)
    table = SpecConfig.from_vllm({"num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 8, 0]]})
    assert table.table_rows(8) == ((1, 2, 3), (3, 8, 0))
    assert SpecConfig("draft_model", "/d", None).table_rows(8) is None  # K unknown


@pytest.mark.parametrize(
    ("before", "after", "kind"),
    [
        (WEAK_SPEC, {**WEAK_SPEC, "model": "/models/good"}, "draft_swapped"),
        (WEAK_SPEC, {"method": "off", "num_speculative_tokens": 0}, "draft_swapped"),
        (WEAK_SPEC, {**WEAK_SPEC, "num_speculative_tokens": 5}, "k_changed"),
        (WEAK_SPEC, {**WEAK_SPEC, "num_speculative_tokens_per_batch_size": [[1, 16, 2]]}, "k_changed"),
        (WEAK_SPEC, dict(WEAK_SPEC), None),
        (None, WEAK_SPEC, None),
    ],
)
def test_change_kind(before: dict[str, object] | None, after: dict[str, object], kind: str | None) -> None:
    # the old dict API took {} for "no config known"; the typed one takes None (SpecConfig.from_vllm({}) is OFF)
    got = change_kind(SpecConfig.from_vllm(before) if before is not None else None, SpecConfig.from_vllm(after))
    assert got == kind
    if kind is not None:
        assert isinstance(got, ChangeKind)


def test_vllm_round_trip_keeps_every_key() -> None:
    raw = {
        "method": "draft_model",
        "model": "/d",
        "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 16, 1]],
        "draft_tensor_parallel_size": 1,
    }
    spec = SpecConfig.from_vllm(raw)
    assert spec.to_vllm() == raw
    assert spec.fingerprint == SpecConfig.from_vllm(dict(reversed(list(raw.items())))).fingerprint
    assert SpecConfig.from_vllm(None) is OFF and SpecConfig.from_vllm({}) is OFF
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": "4"})
    with pytest.raises(ValueError, match="row"):
        SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens_per_batch_size": [[1, 2]]})


def test_k_at_a_batch_size_and_derived_configs() -> None:
    spec = SpecConfig("draft_model", "/d", 5, ((1, 4, 5), (5, 16, 2), (17, 64, 0)))
    assert [spec.k_at(b) for b in (1, 4, 5, 16, 17, 100)] == [5, 5, 2, 2, 0, 0]
    assert spec.largest_k() == 5 and OFF.largest_k() == 0 and OFF.k_at(3) == 0
    assert spec.with_k(3) == SpecConfig("draft_model", "/d", 3)
    assert spec.with_k(0) is OFF and OFF.describe() == "speculation off"
    assert spec.with_table([[1, 8, 3], [9, 16, 1]], 4).k_table == ((1, 8, 3), (9, 16, 1))
    assert spec.describe() == "config method=draft_model draft=/d K=5 table=1-4:5,5-16:2,17-64:0"
    assert spec.draft == ("draft_model", "/d") and spec.drafts_at_k0
    assert not SpecConfig("ngram", None, 3).drafts_at_k0
