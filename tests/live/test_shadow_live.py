"""Shadow evaluation against serving, on the real lab engine.

Traffic is recorded once (the lab engine running the ``good`` draft, greedy, through the traffic
recorder); `spectuner shadow run` measures every lab candidate on that record, and `spectuner drafts
list --json` shows each one's α̂ and interval before any restart. Then each of good, medium, weak and
ngram is actually served on the same prompts, and its α̂ from the engine's own per-request,
per-step counts (``per_step_accepted`` / ``per_step_drafted``) is compared: the shadow α̂ must lie
inside the served interval. Both figures are printed (``-s``) for the docs.

Streamed traffic is recorded through the tap in front of the engine: each streamed answer (completions
with and without ``return_token_ids``, chat with them) must give the sample its non-streamed answer gives.
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
from collectors.tap import TapProxy, create_tap_app
from collectors.traffic_record import RecorderSettings, SampleStore, TrafficRecorder, load_tokenizer
from policies.acceptance import alpha_interval, evidence_from_draft_steps
from tests.integration.test_tap_proxy import ThreadedServer
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


def test_a_streamed_answer_records_the_sample_its_non_streamed_answer_records(
    lab_models: Manifest, lab_engine: LabServer, tmp_path: Path
) -> None:
    store = SampleStore(RecorderSettings(tmp_path / "record", sample_rate=1.0))
    recorder = TrafficRecorder(store, load_tokenizer(Path(lab_models.target.path)))
    proxy = TapProxy(lab_engine.base_url, None, traffic=recorder)
    kinds = {
        "completions+ids": ("/v1/completions", {"return_token_ids": True}),
        "completions": ("/v1/completions", {}),
        "chat+ids": ("/v1/chat/completions", {"return_token_ids": True}),
    }
    prompts = [PREDICTABLE[0], HARD[0]]
    sent: list[tuple[str, int, bool]] = []
    with ThreadedServer(create_tap_app(proxy)) as tap:
        # one request at a time: the same batch for the streamed and the non-streamed answer
        for kind, (path, extra) in kinds.items():
            for i, prompt in enumerate(prompts):
                body: dict[str, Any] = {"model": lab_engine.model_name, "max_tokens": 24, "temperature": 0, **extra}
                if path.startswith("/v1/chat"):
                    body["messages"] = [{"role": "user", "content": prompt}]
                else:
                    body["prompt"] = prompt
                for stream in (False, True):
                    with httpx.stream("POST", f"{tap.url}{path}", json={**body, "stream": stream},
                                      timeout=120) as r:
                        r.read()
                        assert r.status_code == 200, r.text
                    sent.append((kind, i, stream))
        stats = httpx.get(f"{tap.url}/_spectuner/tap").json()["traffic_record"]
    recorder.drain()
    assert stats["seen"] == len(sent)
    samples = sorted(store, key=lambda s: s.ts)
    assert len(samples) == len(sent), recorder.stats_dict()
    by_key = dict(zip(sent, samples, strict=True))
    for kind, i, _ in sent[::2]:
        whole, streamed = by_key[(kind, i, False)], by_key[(kind, i, True)]
        assert streamed.output_ids, kind
        assert (streamed.prompt_ids, streamed.output_ids, streamed.ids_source, streamed.endpoint) == (
            whole.prompt_ids, whole.output_ids, whole.ids_source, whole.endpoint), (kind, i)
    assert {s.ids_source for s in samples} == {"response", "tokenized"}
