"""What the stat-logger plugin POSTs to the sidecar's ingest endpoint (stdlib only; both sides use it).

One POST carries a batch::

    {"v": 1,
     "source": {"model": "lab-target", "pid": 1234, "vllm": "0.32.0"},
     "counters": {"sent": 900, "dropped_queue_full": 0, "dropped_send_failed": 0, "unconfirmed": 0},
     "steps": [{...}, ...]}

Each step (short keys: hundreds of steps a second; times are Unix seconds, durations seconds)::

    t   frontend wall time the step's stats arrived           float
    e   engine index (data-parallel rank)                     int
    b   batch size: requests scheduled in the step            int
    dt  step time (s), or null when unknown (first after idle) float | null
    bs  how b/dt were measured: "details" (vLLM iteration details, exact) or "frontend"
    k   K_max the engine drafts up to (SpecDecodingStats.num_spec_tokens)  int
    d   drafts verified in the step                           int
    dn  draft tokens verified                                 int
    a   accepted draft tokens                                 int
    ap  accepted tokens per position, len k                   [int]
    dp  draft tokens per position, len k (not in /metrics)    [int]
    g   tokens generated in the step                          int
    s   tokens scheduled in the step, or null                 int | null
    r   requests running after the step                       int
    w   requests waiting after the step                       int

The drafted K of a step is the number of positions with a draft: ``sum(1 for x in dp if x)``.
"""

from __future__ import annotations

from typing import Any

WIRE_VERSION = 1
STEPS_PATH = "/v1/steps"
STATS_PATH = "/v1/steps/stats"
TOKEN_HEADER = "X-Spectuner-Token"


def drafted_k(step: dict[str, Any]) -> int:
    """K the step's drafts were made with: the last position any draft reached (0: no drafts)."""
    per_pos = step.get("dp") or []
    k = 0
    for i, n in enumerate(per_pos):
        if n:
            k = i + 1
    return k
