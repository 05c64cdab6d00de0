"""A fleet written through the store's own API, as five "sidecars" sharing one database would write it:
four healthy replicas of one config, one whose draft is broken, one on ngram, one scraped engine
without a recorded config, and a change in flight. Shared by the fleet status and report tests."""

from __future__ import annotations

from datetime import datetime, timedelta

import numpy as np

from bench.research.simulate import simulate_counters
from collectors.records import EngineKey, WindowRecord
from policies.counters import SpecCounters
from policies.spec_config import SpecConfig
from tuner.store import AppliedBy, DecisionRecord, EngineConfigRecord, Store

TARGET = "lab-target"
K3 = SpecConfig.from_vllm({"method": "draft_model", "model": "/drafts/good", "num_speculative_tokens": 3})
NGRAM = SpecConfig.from_vllm({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
# replica → (config, true α): four healthy replicas, one whose draft is broken, one on ngram
REPLICAS = {
    "10.0.0.1": (K3, 0.72),
    "10.0.0.2": (K3, 0.70),
    "10.0.0.3": (K3, 0.71),
    "10.0.0.4": (K3, 0.69),
    "10.0.0.5": (K3, 0.40),
    "10.0.0.6": (NGRAM, 0.30),
}
BROKEN = "10.0.0.5"
CHANGING = "10.0.0.2"  # the replica with a change in flight
UNCONFIGURED = "10.0.0.9"


def key(host: str) -> EngineKey:
    return EngineKey(f"http://{host}:8000/metrics", TARGET, "0")


def write_fleet(store: Store, now: datetime, seed: int = 23) -> dict[str, list[SpecCounters]]:
    """Each replica's sidecar records its config and 20 windows of 10 s (the 200 s before ``now``); a
    change K 3 → 4 is applied on CHANGING and not yet verified; UNCONFIGURED was scraped but has no
    config yet. Returns each replica's window counters."""
    rng = np.random.default_rng(seed)
    start = now - timedelta(seconds=200)
    written: dict[str, list[SpecCounters]] = {}
    for host, (spec, alpha) in REPLICAS.items():
        config_id = store.record_config(
            key(host), EngineConfigRecord.of(spec, start - timedelta(seconds=30), AppliedBy.STARTUP)
        )
        counters = [simulate_counters(rng, alpha, spec.k or 1, 400) for _ in range(20)]
        written[host] = counters
        store.write_windows(
            [
                WindowRecord(
                    key=key(host),
                    start=start + timedelta(seconds=10 * i),
                    end=start + timedelta(seconds=10 * (i + 1)),
                    spec=c,
                    generation_tokens=1000.0,
                    config_id=config_id,
                )
                for i, c in enumerate(counters)
            ]
        )
    store.write_windows(
        [WindowRecord(key(UNCONFIGURED), start, start + timedelta(seconds=10), spec=None, generation_tokens=5.0)]
    )
    store.record_decision(
        DecisionRecord(
            created_at=now - timedelta(seconds=20),
            action="change",
            reason="change_k",
            message="K 3 → 4",
            inputs={},
            mode="auto",
            engine=key(CHANGING),
            proposed_config=K3.with_k(4).to_vllm(),
            status="applied",
        )
    )
    return written
