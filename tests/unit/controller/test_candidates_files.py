"""Draft candidates sized from a local model directory: a corrupt weights file is "size unknown", never a
crash of the decide job (a garbage header length once raised MemoryError there)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from tuner.controller.candidates import count_params


def test_a_corrupt_safetensors_file_is_size_unknown(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")  # header length: 8 garbage bytes
    assert count_params(str(tmp_path)) is None
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**15) + b"{}")  # claims a petabyte header
    assert count_params(str(tmp_path)) is None
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")  # JSON, not an object
    assert count_params(str(tmp_path)) is None


def test_a_sound_header_counts_every_tensor(tmp_path: Path) -> None:
    header = json.dumps({"__metadata__": {}, "a": {"shape": [4, 8]}, "b": {"shape": [3]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 140)
    assert count_params(str(tmp_path)) == 35
