"""Write synthetic vLLM /metrics pages for cases the one-engine CPU lab cannot produce.

The lab engine gives real single-engine pages (``lab_*.prom``). Data-parallel pages (two
``engine`` labels), a no-speculation page and a restarted engine are built here with
prometheus_client and the same metric names, label sets and bucket bounds vLLM 0.32 uses
(vllm/v1/metrics/loggers.py, vllm/v1/spec_decode/metrics.py, vllm/v1/metrics/buckets.py).
Deterministic: fixed creation times and seeded values. Run: ``python tests/data/make_synthetic_pages.py``.
"""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

HERE = Path(__file__).parent
MODEL = "target"
REQUEST_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500]
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N = [1, 2, 5, 10, 20]
TTFT = [
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
]
ITL = [
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
]
LATENCY = [
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
]
PREEMPTIONS = [1, 2, 3, 4, 5, 10, 20]
LABELS = ["model_name", "engine"]


def build_page(
    engines: list[str], k: int | None, requests: int, seed: int, created_s: float, alpha: float = 0.7
) -> str:
    """A page after ``requests`` finished requests per engine; ``k`` None means no speculation."""
    # Every child's _created is stamped from time.time(); pin it so pages are reproducible.
    with mock.patch("time.time", return_value=created_s):
        return _build_page(engines, k, requests, seed, created_s, alpha)


def _build_page(
    engines: list[str], k: int | None, requests: int, seed: int, created_s: float, alpha: float = 0.7
) -> str:
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", LABELS, registry=reg)
    waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", LABELS, registry=reg)
    kv = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", LABELS, registry=reg)
    prefix_q = Counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        LABELS,
        registry=reg,
    )
    prefix_h = Counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        LABELS,
        registry=reg,
    )
    preempt = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", LABELS, registry=reg)
    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=reg)
    gen = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS, registry=reg)
    success = Counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [*LABELS, "finished_reason"],
        registry=reg,
    )
    hists = {
        "prompt": Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            LABELS,
            buckets=REQUEST_TOKENS,
            registry=reg,
        ),
        "gen": Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            LABELS,
            buckets=REQUEST_TOKENS,
            registry=reg,
        ),
        "iter": Histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            LABELS,
            buckets=ITERATION_TOKENS,
            registry=reg,
        ),
        "maxgen": Histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            LABELS,
            buckets=REQUEST_TOKENS,
            registry=reg,
        ),
        "n": Histogram(
            "vllm:request_params_n",
            "Histogram of the n request parameter.",
            LABELS,
            buckets=PARAMS_N,
            registry=reg,
        ),
        "maxtok": Histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            LABELS,
            buckets=REQUEST_TOKENS,
            registry=reg,
        ),
        "ttft": Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            LABELS,
            buckets=TTFT,
            registry=reg,
        ),
        "itl": Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            LABELS,
            buckets=ITL,
            registry=reg,
        ),
        "tpot": Histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            LABELS,
            buckets=ITL,
            registry=reg,
        ),
        "e2e": Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            LABELS,
            buckets=LATENCY,
            registry=reg,
        ),
        "queue": Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            LABELS,
            buckets=LATENCY,
            registry=reg,
        ),
        "infer": Histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            LABELS,
            buckets=LATENCY,
            registry=reg,
        ),
        "prefill": Histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            LABELS,
            buckets=LATENCY,
            registry=reg,
        ),
        "decode": Histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            LABELS,
            buckets=LATENCY,
            registry=reg,
        ),
        "preempt": Histogram(
            "vllm:request_num_preemptions",
            "Number of preemptions per request.",
            LABELS,
            buckets=PREEMPTIONS,
            registry=reg,
        ),
    }
    spec: dict[str, Counter] = {}
    if k is not None:
        spec["drafts"] = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", LABELS, registry=reg)
        spec["draft_tokens"] = Counter(
            "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", LABELS, registry=reg
        )
        spec["accepted"] = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", LABELS, registry=reg
        )
        spec["per_pos"] = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*LABELS, "position"],
            registry=reg,
        )
    info = Gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        [
            "block_size",
            "cache_dtype",
            "enable_prefix_caching",
            "engine",
            "gpu_memory_utilization",
            "num_cpu_blocks",
            "num_gpu_blocks",
            "swap_space_bytes",
        ],
        registry=reg,
    )
    children = {}
    for e in engines:
        lv = (MODEL, e)
        children[e] = [h.labels(*lv) for h in hists.values()]
        for reason in ("abort", "error", "length", "repetition", "stop"):
            success.labels(*lv, reason)
        if k is not None:
            for p in range(k):
                spec["per_pos"].labels(*lv, str(p))
        info.labels(
            block_size="16",
            cache_dtype="auto",
            enable_prefix_caching="True",
            engine=e,
            gpu_memory_utilization="0.9",
            num_cpu_blocks="None",
            num_gpu_blocks="2048",
            swap_space_bytes="0",
        ).set(1)

    for e in engines:
        lv = (MODEL, e)
        rng = random.Random(seed * 1000 + int(e))  # per engine, so a longer run extends a shorter one
        for _ in range(requests):
            n_prompt = rng.randint(5, 60)
            n_out = rng.randint(8, 64)
            prompt.labels(*lv).inc(n_prompt)
            gen.labels(*lv).inc(n_out)
            prefix_q.labels(*lv).inc(n_prompt)
            prefix_h.labels(*lv).inc(rng.randint(0, n_prompt // 2))
            success.labels(*lv, "length").inc()
            hists["prompt"].labels(*lv).observe(n_prompt)
            hists["gen"].labels(*lv).observe(n_out)
            hists["maxgen"].labels(*lv).observe(64)
            hists["n"].labels(*lv).observe(1)
            hists["maxtok"].labels(*lv).observe(64)
            hists["ttft"].labels(*lv).observe(rng.uniform(0.01, 0.3))
            e2e = rng.uniform(0.2, 2.0)
            hists["e2e"].labels(*lv).observe(e2e)
            hists["queue"].labels(*lv).observe(rng.uniform(0.0, 0.05))
            hists["infer"].labels(*lv).observe(e2e * 0.95)
            hists["prefill"].labels(*lv).observe(rng.uniform(0.01, 0.1))
            hists["decode"].labels(*lv).observe(e2e * 0.9)
            hists["preempt"].labels(*lv).observe(0)
            emitted = 1
            while emitted < n_out:
                hists["itl"].labels(*lv).observe(rng.uniform(0.005, 0.05))
                hists["tpot"].labels(*lv).observe(rng.uniform(0.005, 0.05))
                hists["iter"].labels(*lv).observe(rng.randint(1, 16))
                if k is None:
                    emitted += 1
                    continue
                accepted = 0
                while accepted < k and rng.random() < alpha:
                    accepted += 1
                spec["drafts"].labels(*lv).inc()
                spec["draft_tokens"].labels(*lv).inc(k)
                spec["accepted"].labels(*lv).inc(accepted)
                for p in range(accepted):
                    spec["per_pos"].labels(*lv, str(p)).inc()
                emitted += accepted + 1
        running.labels(*lv).set(rng.randint(0, 8))
        waiting.labels(*lv).set(rng.randint(0, 2))
        kv.labels(*lv).set(round(rng.uniform(0.0, 0.5), 4))
        preempt.labels(*lv).inc(0)
    return generate_latest(reg).decode()


def main() -> None:
    t0 = 1_765_000_000.0
    pages = {
        "synthetic_dp2_k3_a.prom": build_page(["0", "1"], 3, 40, seed=1, created_s=t0),
        # Same engines later: the first 40 requests replayed by the same seed, then 60 more.
        "synthetic_dp2_k3_b.prom": build_page(["0", "1"], 3, 100, seed=1, created_s=t0),
        # Both engines restarted (new creation time, fewer requests so far).
        "synthetic_dp2_k3_restarted.prom": build_page(["0", "1"], 3, 10, seed=2, created_s=t0 + 3600),
        "synthetic_nospec.prom": build_page(["0"], None, 30, seed=3, created_s=t0),
        "synthetic_k5.prom": build_page(["0"], 5, 50, seed=4, created_s=t0, alpha=0.8),
    }
    for name, text in pages.items():
        (HERE / name).write_text(text)
        print(f"{name}: {len(text)} bytes")


if __name__ == "__main__":
    main()
