"""`spectuner lab serve` bad input: one-line errors that name the fix, exit code 2, nothing started."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.unit.tuner.lab.conftest import spectuner
from tuner.lab.models import kv_bytes_per_token
from tuner.lab.serve import LabServer, LabUsageError, parse_per_batch_size, speculative_config


def test_serve_without_models_names_build_command(tmp_path: Path) -> None:
    r = spectuner("lab", "serve", "--models-dir", str(tmp_path / "nothing"))
    assert r.returncode == 2
    assert "spectuner lab build-models" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_unknown_draft_lists_choices(fake_models: Path) -> None:
    r = spectuner("lab", "serve", "--models-dir", str(fake_models), "--draft", "nope")
    assert r.returncode == 2
    assert "unknown draft 'nope'" in r.stderr and "good" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_serve_busy_port_names_the_option(fake_models: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = spectuner("lab", "serve", "--models-dir", str(fake_models), "--port", str(port))
    assert r.returncode == 2
    assert f"port {port}" in r.stderr and "--port" in r.stderr


def test_bad_per_batch_size_table(fake_models: Path) -> None:
    r = spectuner("lab", "serve", "--models-dir", str(fake_models), "--per-batch-size", "2-4:1")
    assert r.returncode == 2
    assert "start at batch size 1" in r.stderr


@pytest.mark.parametrize(
    ("text", "rows"),
    [("1-4:5,5-16:2", [[1, 4, 5], [5, 16, 2]]), ("[[1, 16, 0]]", [[1, 16, 0]])],
)
def test_parse_per_batch_size(text: str, rows: list[list[int]]) -> None:
    assert parse_per_batch_size(text) == rows


@pytest.mark.parametrize("text", ["1-4:5,6-16:2", "x", "[[1,2]]", "1-4:-1", "[[1, 4, 3], [5, 2, 1]]"])
def test_parse_per_batch_size_rejects(text: str) -> None:
    with pytest.raises(LabUsageError):
        parse_per_batch_size(text)


def test_speculative_config_shapes(fake_models: Path) -> None:
    server = LabServer(draft="good", k=4, per_batch_size=[[1, 4, 4], [5, 16, 0]], models_dir=fake_models)
    assert server.spec_config == {
        "method": "draft_model", "model": str(fake_models / "draft-good"), "num_speculative_tokens": 4,
        "num_speculative_tokens_per_batch_size": [[1, 4, 4], [5, 16, 0]],
    }
    argv = server.argv()
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--per-request-spec-decode-metrics" in argv
    env = server.env()
    assert server.workdir is not None
    assert env["VLLM_CACHE_ROOT"].startswith(str(server.workdir))
    # vLLM's IPC sockets live in TMPDIR: its path must leave room for a uuid within sun_path's 107 bytes.
    assert len(env["TMPDIR"]) + 37 <= 107
    server.stop()  # removes a private TMPDIR if one was made
    m = server.manifest
    assert speculative_config(m, "ngram", 3)["method"] == "ngram"  # type: ignore[index]
    assert speculative_config(m, "none", 3) is None
    with pytest.raises(LabUsageError, match="raise --k"):
        speculative_config(m, "good", 2, [[1, 16, 3]])


def test_kv_bytes_per_token() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128}
    assert kv_bytes_per_token(cfg) == 2 * 2 * 2 * 64 * 4
    cfg_gqa = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "hidden_size": 4096}
    assert kv_bytes_per_token(cfg_gqa, dtype_bytes=2) == 32 * 2 * 8 * 128 * 2
