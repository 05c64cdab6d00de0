"""`spectuner run --check` refuses what `spectuner run` would refuse, with exit 2 and one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tuner.cli.main import app
from tuner.store import upgrade

pytestmark = pytest.mark.integration

HEAD = '[engine]\nmetrics_url = "http://127.0.0.1:9"\n'
NGRAM = '[speculative]\nmethod = "ngram"\nnum_speculative_tokens = 3\n'


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            NGRAM + '[alerts]\nenabled = true\n[[alerts.sinks]]\nname = "ops"\nkind = "webhook"\n'
            'url = "http://127.0.0.1:9/x"\nsecret_env = "SPT_CHECK_UNSET_KEY"\n',
            "SPT_CHECK_UNSET_KEY",
        ),
        (
            '[speculative]\nmethod = "draft_model"\nmodel = "./no/such/draft"\nnum_speculative_tokens = 3\n',
            "does not exist",
        ),
        (NGRAM + '[plugin]\ningest_listen = "127.0.0.1:8766"\ntoken_file = "empty.token"\n', "is empty"),
        (NGRAM + '[exporters.prometheus]\nenabled = true\nhost = "0.0.0.0"\n', "allow_remote"),
    ],
    ids=["unset secret_env", "missing draft path", "empty token file", "exporter on 0.0.0.0"],
)
def test_run_check_refuses_what_run_refuses(
    tmp_path: Path, body: str, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPT_CHECK_UNSET_KEY", raising=False)
    db = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db)
    (tmp_path / "empty.token").write_text("")
    config = tmp_path / "spectuner.toml"
    config.write_text(HEAD + body)
    for args in (["run", "--config", str(config), "--check"], ["run", "--config", str(config)]):
        result = CliRunner().invoke(app, [*args, "--db", db])
        assert result.exit_code == 2, (args, result.output)
        [line] = result.stderr.splitlines()
        assert needle in line and "Traceback" not in result.output


def test_run_check_passes_a_good_config(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'spectuner.db'}"
    upgrade(db)
    config = tmp_path / "spectuner.toml"
    config.write_text(HEAD + NGRAM + '[exporters.prometheus]\nenabled = true\nhost = "0.0.0.0"\nallow_remote = true\n')
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--check", "--db", db])
    assert result.exit_code == 0, result.output
