"""Shadow evaluation against serving, on the real lab engine.

Traffic is recorded once (the lab engine running the ``good`` draft, greedy, through the traffic
recorder); `spectuner shadow run` measures every lab candidate on that record, and `spectuner drafts
list --json` shows each one's α̂ and interval before any restart. Then each of good, medium, weak and
ngram is actually served on the same prompts, and its α̂ from the engine's own per-request,
per-step counts (``per_step_accepted`` / ``per_step_drafted``) is compared: the shadow α̂ must lie
inside the served interval. Both figures are printed (``-s``) for the docs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from collectors.request_metrics import ResponseContext, record_from_json_body
from collectors.traffic_record import RecorderSettings, SampleStore, TrafficRecorder
from policies.acceptance import alpha_interval, evidence_from_draft_steps
from tuner.cli.main import app
from tuner.lab.models import Manifest
from tuner.lab.prompts import HARD, PREDICTABLE
from tuner.lab.serve import LabServer
from tuner.store import upgrade

pytestmark = pytest.mark.live
runner = CliRunner()
PROMPTS = list(PREDICTABLE[:16]) + list(HARD[:16])
MAX_TOKENS = 48
COMPARED = ("good", "medium", "weak", "ngram")
NGRAM_EXTRA = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}  # as the lab serves ngram


def exchange(base_url: str, model: str, prompt: str) -> tuple[bytes, bytes]:
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    ).encode()
    resp = httpx.post(f"{base_url}/v1/completions", content=body, headers={"content-type": "application/json"},
                      timeout=120)
    resp.raise_for_status()
    return body, resp.content


def serve_all(server: LabServer) -> list[tuple[bytes, bytes]]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: exchange(server.base_url, server.model_name, p), PROMPTS))


def served_alpha(exchanges: list[tuple[bytes, bytes]]) -> tuple[float, tuple[float, float], int]:
    acc: list[int] = []
    drf: list[int] = []
    ctx = ResponseContext(datetime.now(UTC), 0.0, "", 200, False)
    for _, resp in exchanges:
        rec = record_from_json_body(resp, ctx)
        if rec.per_step_accepted is None or rec.per_step_drafted is None:
            assert rec.num_spec_steps == 0  # nothing drafted (ngram found no match): no trials
            continue
        acc += rec.per_step_accepted
        drf += rec.per_step_drafted
    ev = evidence_from_draft_steps(acc, drf)
    return ev.successes / ev.trials, alpha_interval(ev), int(ev.drafts)


def cli(*args: str) -> Any:
    result = runner.invoke(app, [*args, "--json"], env={"SPECTUNER_USER": "lab", "SPECTUNER_DB": ""})
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_shadow_alpha_lies_within_the_served_interval(
    lab_models: Manifest, lab_engine: LabServer, start_lab_server: Callable[..., LabServer], tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'shadow.db'}"
    upgrade(db)
    record = SampleStore(RecorderSettings(tmp_path / "record", sample_rate=1.0))
    recorder = TrafficRecorder(record, None)

    served: dict[str, list[tuple[bytes, bytes]]] = {}
    # the session's shared engine serves good at K = 3: recorded there, not on a start of its own
    assert (lab_engine.draft, lab_engine.k) == (COMPARED[0], 3)
    served[COMPARED[0]] = serve_all(lab_engine)
    for req, resp in served[COMPARED[0]]:
        recorder.observe(req, resp)
    recorder.drain()
    assert recorder.stats.recorded == len(PROMPTS), recorder.stats_dict()

    for name, info in lab_models.drafts.items():
        args = ["drafts", "add", name, "--method", info.method, "--db", db]
        args += ["--model", info.path] if info.path else ["--extra-json", json.dumps(NGRAM_EXTRA)]
        cli(*args)
    run = cli("shadow", "run", "--samples", str(record.dir), "--target", lab_models.target.path, "--k", "3",
              "--max-model-len", "512", "--nice", "0", "--db", db)
    listed = {d["name"]: d for d in cli("drafts", "list", "--db", db)["drafts"]}
    # Every lab candidate is measured before any restart, with an interval.
    for name in lab_models.drafts:
        m = listed[name]["measured"]
        assert m is not None and m["alpha"] is not None and m["alpha_ci"][0] <= m["alpha"] <= m["alpha_ci"][1], name
    shadow = {row["candidate"]: row for row in run["candidates"]}
    assert shadow["copy"]["alpha"] > 0.97  # the target itself proposes the target's tokens
    assert shadow["random"]["alpha"] < 0.2

    for name in COMPARED[1:]:
        server = start_lab_server(draft=name, k=3)
        served[name] = serve_all(server)
        server.stop()  # one engine at a time on the shared box
    lines = []
    for name in COMPARED:
        alpha, (lo, hi), drafts = served_alpha(served[name])
        s = shadow[name]
        lines.append(
            f"{name:7s} shadow α̂ {s['alpha']:.3f} [{s['alpha_ci'][0]:.3f}, {s['alpha_ci'][1]:.3f}] "
            f"({s['drafts']} drafts) | served α̂ {alpha:.3f} [{lo:.3f}, {hi:.3f}] ({drafts} drafts)"
        )
    print("\n" + "\n".join(lines))
    for name, line in zip(COMPARED, lines, strict=True):
        alpha, (lo, hi), _ = served_alpha(served[name])
        assert lo <= shadow[name]["alpha"] <= hi, line
