"""Step-cost physics on a real GPU: Llama-shaped decoder layers in bf16, replayed as CUDA graphs.

Why: the simulator's GPU scenarios (``bench/scenarios/gpu_*.toml``) and the gpu-like CPU lab
(docs/lab.md) stand in for the trade-off users face on GPUs — a draft costing a small fraction of the
target, speculation winning at low load and losing at high load. This measures that trade-off on
the accelerator itself, side by side in one run, for published model shapes (Llama 3.2 1B, Llama 3.1
8B and 70B; random weights: the cost does not depend on their values):

- T(B, q): one forward of ``q`` new tokens for each of ``B`` sequences against a KV cache of
  ``context_tokens`` — q = 1 is a decode step, q = K + 1 a verification. A few real layers are timed
  as one CUDA graph (launch overhead gone, as in vLLM's graphs) and scaled to the model's depth; the
  LM head is timed at full size. Sampling, rejection and the engine's scheduling are not included.
- c(B) = T_draft(B, 1) / T_target(B, 1), the draft's cost ratio;
- speculation's gain at α and K: E(α, K) · T_t(B, 1) / (T_t(B, K + 1) + K · T_d(B, 1)) with
  E = (1 − α^(K+1)) / (1 − α) tokens per step, and the batch size where it falls below 1.

The 70B runs on one GPU layer by layer (a deployment shards it over 4–8 GPUs with tensor parallel,
which divides the per-layer time and adds all-reduces): read it as the shape of the curve.

    python bench/bench_gpu_step_cost.py [--out bench/results/gpu_step_cost.json]

Without a CUDA device it says so and exits 0 (``--device cpu --smoke`` runs the same code on tiny
shapes, for tests).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def params(self) -> int:
        attn = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim + self.heads * self.head_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


# Published configs (Hugging Face config.json of each model).
LLAMA_1B = ModelShape("llama-3.2-1b", 2048, 16, 32, 8, 64, 8192, 128256)
LLAMA_8B = ModelShape("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256)
LLAMA_70B = ModelShape("llama-3.1-70b", 8192, 80, 64, 8, 128, 28672, 128256)
SMOKE_TARGET = ModelShape("smoke-target", 64, 4, 4, 2, 16, 128, 97)
SMOKE_DRAFT = ModelShape("smoke-draft", 32, 2, 2, 1, 16, 64, 97)


# -- the analysis (pure) ---------------------------------------------------------------------------------
def tokens_per_step(alpha: float, k: int) -> float:
    """Expected tokens a sequence gains per verification step: (1 − α^(K+1)) / (1 − α)."""
    if k == 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculation_gain(
    target_ms: dict[tuple[int, int], float], draft_ms: dict[int, float], batch: int, k: int, alpha: float
) -> float:
    """Tokens/s with draft/K over tokens/s without speculation, at ``batch`` sequences."""
    step = target_ms[(batch, k + 1)] + k * draft_ms[batch]
    return tokens_per_step(alpha, k) * target_ms[(batch, 1)] / step


def crossover_batch(gains: Sequence[tuple[int, float]]) -> int | None:
    """The first batch size (ascending) where the gain falls below 1; None if it never does."""
    for batch, gain in sorted(gains):
        if gain < 1.0:
            return batch
    return None


# -- the measurement (torch) -----------------------------------------------------------------------------
class _Layers:
    """``n`` decoder layers of ``shape`` with random bf16 weights and a static KV cache."""

    def __init__(self, torch: Any, shape: ModelShape, n: int, batch: int, q: int, context: int, device: str) -> None:
        self.t, self.s, self.q, self.ctx = torch, shape, q, context
        dt_ = torch.bfloat16 if device == "cuda" else torch.float32
        g = torch.Generator(device=device).manual_seed(0)

        def w(*dims: int) -> Any:
            return torch.randn(*dims, generator=g, device=device, dtype=dt_) * (1.0 / math.sqrt(dims[0]))

        qkv_out = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        self.layers = [
            {"qkv": w(shape.hidden, qkv_out), "o": w(shape.heads * shape.head_dim, shape.hidden),
             "gate": w(shape.hidden, shape.intermediate), "up": w(shape.hidden, shape.intermediate),
             "down": w(shape.intermediate, shape.hidden),
             "k": torch.randn(batch, shape.kv_heads, context + q, shape.head_dim, generator=g, device=device,
                              dtype=dt_),
             "v": torch.randn(batch, shape.kv_heads, context + q, shape.head_dim, generator=g, device=device,
                              dtype=dt_)}
            for _ in range(n)
        ]
        self.x = torch.randn(batch, q, shape.hidden, generator=g, device=device, dtype=dt_)

    def forward(self) -> Any:
        t, s = self.t, self.s
        f = t.nn.functional
        x = self.x
        b = x.shape[0]
        for lay in self.layers:
            h = f.rms_norm(x, (s.hidden,))
            qkv = h @ lay["qkv"]
            nq, nkv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            q = qkv[..., :nq].view(b, self.q, s.heads, s.head_dim).transpose(1, 2)
            k = qkv[..., nq:nq + nkv].view(b, self.q, s.kv_heads, s.head_dim).transpose(1, 2)
            v = qkv[..., nq + nkv:].view(b, self.q, s.kv_heads, s.head_dim).transpose(1, 2)
            lay["k"][:, :, self.ctx:] = k  # the new tokens' keys and values join the cache
            lay["v"][:, :, self.ctx:] = v
            att = f.scaled_dot_product_attention(q, lay["k"], lay["v"], enable_gqa=True)
            x = x + att.transpose(1, 2).reshape(b, self.q, nq) @ lay["o"]
            h = f.rms_norm(x, (s.hidden,))
            x = x + (f.silu(h @ lay["gate"]) * (h @ lay["up"])) @ lay["down"]
        return x


class _Head:
    def __init__(self, torch: Any, shape: ModelShape, batch: int, q: int, device: str) -> None:
        dt_ = torch.bfloat16 if device == "cuda" else torch.float32
        g = torch.Generator(device=device).manual_seed(1)
        self.t, self.s = torch, shape
        self.w = torch.randn(shape.hidden, shape.vocab, generator=g, device=device, dtype=dt_) * 0.01
        self.x = torch.randn(batch, q, shape.hidden, generator=g, device=device, dtype=dt_)

    def forward(self) -> Any:
        h = self.t.nn.functional.rms_norm(self.x, (self.s.hidden,))
        return (h @ self.w).argmax(-1)


def _time_ms(torch: Any, fn: Any, device: str, replays: int) -> float:
    """Mean wall time of one call, ms: replayed as a CUDA graph on a GPU, plain calls on the CPU."""
    if device != "cuda":
        fn()
        t0 = time.perf_counter()
        for _ in range(replays):
            fn()
        return (time.perf_counter() - t0) * 1000 / replays
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / replays


def step_ms(
    shape: ModelShape, batch: int, q: int, context: int, device: str, timed_layers: int, replays: int
) -> float:
    """One forward of the whole model, ms: ``timed_layers`` real layers scaled to its depth, plus its head."""
    import torch

    with torch.no_grad():
        layers = _Layers(torch, shape, timed_layers, batch, q, context, device)
        per_layer = _time_ms(torch, layers.forward, device, replays) / timed_layers
        del layers
        head = _Head(torch, shape, batch, q, device)
        head_ms = _time_ms(torch, head.forward, device, replays)
        del head
        if device == "cuda":
            torch.cuda.empty_cache()
    return per_layer * shape.layers + head_ms


def measure(
    pairs: Sequence[tuple[ModelShape, ModelShape]], batches: Sequence[int], ks: Sequence[int], context: int,
    device: str, replays: int, alphas: Sequence[float],
) -> dict[str, Any]:
    shapes = {s.name: s for pair in pairs for s in pair}
    targets = {t.name for t, _ in pairs}
    ms: dict[str, dict[tuple[int, int], float]] = {}
    t0 = time.monotonic()
    for name, shape in shapes.items():
        qs = sorted({1, *(k + 1 for k in ks)}) if name in targets else [1]
        timed = 2 if shape.layers >= 64 else 4
        ms[name] = {}
        for b in batches:
            for q in qs:
                ms[name][(b, q)] = step_ms(shape, b, q, context, device, min(timed, shape.layers), replays)
        print(f"  timed {name}: {len(batches) * len(qs)} cells ({time.monotonic() - t0:.0f} s)", flush=True)

    out_pairs = []
    for target, draft in pairs:
        t_ms, d_ms = ms[target.name], {b: ms[draft.name][(b, 1)] for b in batches}
        rows = []
        for b in batches:
            row: dict[str, Any] = {
                "batch": b,
                "target_ms": {str(q): round(v, 4) for (bb, q), v in t_ms.items() if bb == b},
                "draft_ms": round(d_ms[b], 4),
                "cost_ratio": round(d_ms[b] / t_ms[(b, 1)], 4),
                "verify_over_decode": {str(k): round(t_ms[(b, k + 1)] / t_ms[(b, 1)], 3) for k in ks},
            }
            row["gain"] = {f"a{a}_k{k}": round(speculation_gain(t_ms, d_ms, b, k, a), 3) for a in alphas for k in ks}
            rows.append(row)
        crossover = {
            f"a{a}_k{k}": crossover_batch([(b, speculation_gain(t_ms, d_ms, b, k, a)) for b in batches])
            for a in alphas for k in ks
        }
        out_pairs.append({"target": target.name, "draft": draft.name, "rows": rows, "crossover_batch": crossover})
    return {"shapes": {n: {**asdict(s), "params": s.params} for n, s in shapes.items()}, "pairs": out_pairs,
            "measure_s": round(time.monotonic() - t0, 1)}


def _print(result: dict[str, Any], ks: Sequence[int], alphas: Sequence[float]) -> None:
    for pair in result["pairs"]:
        print(f"\n{pair['target']} verified, {pair['draft']} drafting "
              f"(context {result['context_tokens']} tokens, {result['device_name']})")
        head = ["B", "T_t(B,1) ms", "c(B)", *(f"T(K+1={k + 1})/T(1)" for k in ks),
                *(f"gain a={a} K={k}" for a in alphas for k in ks)]
        print(" | ".join(head))
        for r in pair["rows"]:
            cells = [str(r["batch"]), f"{r['target_ms']['1']:.3f}", f"{r['cost_ratio']:.3f}",
                     *(f"{r['verify_over_decode'][str(k)]:.2f}" for k in ks),
                     *(f"{r['gain'][f'a{a}_k{k}']:.2f}" for a in alphas for k in ks)]
            print(" | ".join(cells))
        print("speculation stops paying at batch: " + ", ".join(
            f"α={a} K={k}: {pair['crossover_batch'][f'a{a}_k{k}']}" for a in alphas for k in ks))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and batches (tests; any device)")
    ap.add_argument("--context-tokens", type=int, default=1024)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS / "gpu_step_cost.json")
    args = ap.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu_step_cost: no CUDA device here; skipped (run it on a GPU machine)")
        return 0
    if args.smoke:
        pairs = [(SMOKE_TARGET, SMOKE_DRAFT)]
        batches, ks, alphas, context = [1, 4], [1, 3], [0.75], 32
    else:
        pairs = [(LLAMA_8B, LLAMA_1B), (LLAMA_70B, LLAMA_8B), (LLAMA_70B, LLAMA_1B)]
        batches, ks, alphas, context = [1, 2, 4, 8, 16, 32, 64, 128, 256], [1, 3, 5], [0.6, 0.75, 0.9], \
            args.context_tokens
    result = measure(pairs, batches, ks, context, args.device, args.replays, alphas)
    result.update(
        measured_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        device=args.device,
        device_name=torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        torch=torch.__version__,
        context_tokens=context,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        note="random weights; a few layers timed as one CUDA graph and scaled to the depth, plus the LM head; "
             "no sampling, rejection or scheduling; the 70B on one GPU (no tensor parallel)",
    )
    _print(result, ks, alphas)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
