"""Save real /metrics pages from the CPU lab engine into tests/data/lab_*.prom.

The unit tests, the fuzzer and bench/bench_scrape.py read them. Needs the lab models
(``spectuner lab build-models``); starts its own engines on free loopback ports (~3 GB RAM each,
one at a time). Run: ``.venv/bin/python tests/data/save_lab_pages.py``.

Pages written:
- lab_good_k3_idle.prom            just started, no traffic (spec counters all zero)
- lab_good_k3_loaded.prom          after predictable and hard load
- lab_good_k3_loaded_more.prom     the same engine after more load (a delta pair with the above)
- lab_good_k3_restarted.prom       the same engine restarted, then a little load
- lab_weak_k5.prom                 a weak draft at K=5 after load
- lab_nospec.prom                  no speculation, after load
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tuner.lab.load import run_load  # noqa: E402
from tuner.lab.prompts import HARD, PREDICTABLE  # noqa: E402
from tuner.lab.serve import LabServer  # noqa: E402

HERE = Path(__file__).parent
WORK = REPO / ".lab" / "save-pages"


def save(server: LabServer, name: str) -> None:
    text = httpx.get(server.metrics_url, timeout=30).text
    (HERE / name).write_text(text)
    print(f"{name}: {len(text)} bytes")


def main() -> None:
    good = LabServer(draft="good", k=3, workdir=WORK / "good")
    good.start()
    try:
        save(good, "lab_good_k3_idle.prom")
        run_load(good.base_url, good.model_name, PREDICTABLE, concurrency=4, count=16, max_tokens=64)
        run_load(good.base_url, good.model_name, HARD, concurrency=4, count=8, max_tokens=32)
        save(good, "lab_good_k3_loaded.prom")
        run_load(good.base_url, good.model_name, PREDICTABLE + HARD, concurrency=4, count=12, max_tokens=48)
        save(good, "lab_good_k3_loaded_more.prom")
        good.stop()
        good.start()
        run_load(good.base_url, good.model_name, PREDICTABLE, concurrency=2, count=4, max_tokens=32)
        save(good, "lab_good_k3_restarted.prom")
    finally:
        good.stop()
    for name, draft, k in (("lab_weak_k5.prom", "weak", 5), ("lab_nospec.prom", "none", 0)):
        with LabServer(draft=draft, k=k, workdir=WORK / draft) as server:
            run_load(server.base_url, server.model_name, PREDICTABLE + HARD, concurrency=4, count=12, max_tokens=48)
            save(server, name)


if __name__ == "__main__":
    main()
