"""docs/plugin.md and the README carry the support matrix exactly as collectors.vllm_support renders it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from collectors.vllm_support import ALL_FEATURES, EXPECTED, RELEASES, render_markdown

ROOT = Path(__file__).resolve().parents[3]
_BLOCK = re.compile(r"<!-- support-matrix:begin[^\n]*-->\n(.*?)<!-- support-matrix:end -->", re.S)


@pytest.mark.parametrize("doc", ["docs/plugin.md", "README.md"])
def test_docs_carry_the_generated_matrix(doc: str) -> None:
    blocks = _BLOCK.findall((ROOT / doc).read_text())
    assert blocks == [render_markdown()], f"{doc} is out of date: paste `python -m collectors.vllm_support` into it"


def test_matrix_covers_every_release_and_names_real_features() -> None:
    names = {f.name for f in ALL_FEATURES}
    assert len(names) == len(ALL_FEATURES)
    assert set(EXPECTED) == {r.label for r in RELEASES}
    assert all(claimed <= names for claimed in EXPECTED.values())
    rows = render_markdown().splitlines()
    assert len(rows) == 2 + len(ALL_FEATURES) + 1
