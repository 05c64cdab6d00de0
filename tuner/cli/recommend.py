"""`spectuner recommend`: the best K from α and the draft/target cost ratio (CLI contract, docs/architecture.md).

    spectuner recommend --alpha 0.8 --cost-ratio 0.05 --k-max 16 --json

At batch 1 this is Leviathan et al.'s model, E(α, K) / (K·c + 1). Options add batch sizes (and then
the per-batch-size K table for vLLM), a per-token target cost that makes large batches expensive, a
fitted step-cost model as JSON (``policies.step_cost.StepCostModel.to_dict``), and a memory budget with
the draft's footprint. Fitting the step-cost model from a database is the store's job; its output is
what ``--step-cost-json`` reads.
"""

from __future__ import annotations

import json
import math
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import typer
from rich.table import Table

from policies.acceptance_model import ConstantAlphaModel
from policies.choose_k import KChoiceSnapshot, KDecision, choose_k
from policies.k_table import KTableSnapshot, k_table
from policies.memory import FREE_METHODS, DraftFootprint, MemoryBudget, kv_bytes_per_token, weight_bytes
from policies.spec_config import K_TABLE_KEY
from policies.step_cost import StepCostModel
from tuner.cli.common import fail_usage, out_console, print_json
from tuner.config import BATCH_SIZE_LIMIT, K_LIMIT

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str, option: str) -> int:
    """``2GiB``, ``512MB``, ``1000`` → bytes; anything else is a usage error naming the option."""
    m = _SIZE.match(text)
    if not m:
        fail_usage(f"{option} must be a size such as 1073741824, 512MiB or 2GiB but got {text!r}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()])


def parse_batch_sizes(text: str) -> list[int]:
    """``1,2,4,8`` or ``1-16`` (or a mix, ``1,4-8``) → sorted distinct batch sizes in
    ``1..BATCH_SIZE_LIMIT`` (checked before a range is expanded)."""
    sizes: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise ValueError
                _check_batch_size(hi, text)
                sizes.update(range(lo, hi + 1))
            elif part:
                sizes.add(_check_batch_size(int(part), text))
        except ValueError:
            fail_usage(f"--batch-sizes must list integers or ranges such as 1,2,4,8 or 1-16 but got {text!r}")
    if not sizes or min(sizes) < 1:
        fail_usage(f"--batch-sizes must list batch sizes ≥ 1 but got {text!r}")
    return sorted(sizes)


def _check_batch_size(size: int, text: str) -> int:
    if size > BATCH_SIZE_LIMIT:
        fail_usage(
            f"--batch-sizes goes up to {size} in {text!r} but batch sizes stop at {BATCH_SIZE_LIMIT} "
            "(vLLM --max-num-seqs); list the sizes your engine runs"
        )
    return size


def _check_inputs(alpha: float, cost_ratio: float | None, k_max: int, alpha_ci: tuple[float, float] | None) -> None:
    if not (math.isfinite(alpha) and 0.0 < alpha < 1.0):
        fail_usage(
            f"--alpha must lie strictly between 0 and 1 but got {alpha}: it is the draft's per-token "
            "acceptance probability (`spectuner estimate` prints it)."
        )
    if cost_ratio is not None and not math.isfinite(cost_ratio):
        fail_usage(
            f"--cost-ratio must be a finite number but got {cost_ratio}: it is the draft's step time divided by "
            "the target's (e.g. 0.05)."
        )
    if cost_ratio is not None and cost_ratio < 0.0:
        fail_usage(
            f"--cost-ratio cannot be negative but got {cost_ratio}: it is the draft's step time divided by "
            "the target's (e.g. 0.05)."
        )
    if k_max < 0:
        fail_usage(f"--k-max cannot be negative but got {k_max}; use 0 to consider speculation off only.")
    if k_max > K_LIMIT:
        fail_usage(f"--k-max must be at most {K_LIMIT} but got {k_max}: no draft pays beyond a few tokens.")
    if alpha_ci is not None and not (0.0 <= alpha_ci[0] <= alpha <= alpha_ci[1] <= 1.0):
        fail_usage(f"--alpha-ci must be LO,HI with 0 ≤ LO ≤ alpha ≤ HI ≤ 1 but got {alpha_ci[0]},{alpha_ci[1]}.")


def _parse_ci(text: str | None) -> tuple[float, float] | None:
    if text is None:
        return None
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        fail_usage(f"--alpha-ci must be two numbers LO,HI such as 0.75,0.83 but got {text!r}")
    return (lo, hi)


def _load_step_cost(path: Path) -> StepCostModel:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        fail_usage(f"--step-cost-json {path}: no such file.")
    except (OSError, json.JSONDecodeError) as exc:
        fail_usage(f"--step-cost-json {path} is not readable JSON: {exc}")
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        data = data["model"]
    if not isinstance(data, dict):
        fail_usage(f"--step-cost-json {path} must hold a JSON object with the step-cost parameters.")
    try:
        return StepCostModel.from_dict(data)
    except ValueError as exc:
        fail_usage(f"--step-cost-json {path}: {exc}")


def _draft_footprint(
    method: str, draft_params: int | None, draft_dtype: str, draft_config: Path | None, draft_kv: int | None
) -> DraftFootprint:
    if method in FREE_METHODS:
        return DraftFootprint(method)
    if draft_params is None:
        fail_usage(f"a memory budget for a {method} draft needs --draft-params (the draft's parameter count).")
    kv = draft_kv
    if kv is None and draft_config is not None:
        try:
            config = json.loads(draft_config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            fail_usage(f"--draft-config {draft_config} is not a readable config.json: {exc}")
        try:
            kv = kv_bytes_per_token(config, None if draft_dtype == "auto" else draft_dtype)
        except ValueError as exc:
            fail_usage(f"--draft-config {draft_config}: {exc}")
    if kv is None:
        fail_usage(
            "a memory budget needs the draft's KV size: --draft-config config.json or --draft-kv-bytes-per-token."
        )
    try:
        return DraftFootprint(method, weight_bytes(draft_params, draft_dtype), kv)
    except ValueError as exc:
        fail_usage(str(exc))


def _by_k(decision: KDecision, with_memory: bool) -> list[dict[str, Any]]:
    rows = []
    for o in decision.by_k:
        row: dict[str, Any] = {
            "k": o.k,
            "speedup": o.speedup,
            "expected_tokens_per_step": o.expected_tokens_per_step,
        }
        if with_memory:
            row["fits_memory"] = o.fits_memory
        rows.append(row)
    return rows


def register(app: typer.Typer) -> None:
    @app.command("recommend")
    def recommend(
        alpha: float = typer.Option(..., "--alpha", help="Per-token acceptance α of the draft, in (0, 1)."),
        k_max: int = typer.Option(..., "--k-max", help="Largest K to consider (K = 0 is always considered)."),
        cost_ratio: float | None = typer.Option(
            None,
            "--cost-ratio",
            help="Draft step time / target step time c (≥ 0). Required without --step-cost-json.",
        ),
        alpha_ci: str | None = typer.Option(None, "--alpha-ci", help="α's interval LO,HI: adds speedup intervals."),
        batch_sizes: str | None = typer.Option(
            None,
            "--batch-sizes",
            help="Batch sizes to evaluate, e.g. 1,4,16 or 1-64; adds the per-batch-size K table.",
        ),
        per_token_cost: float = typer.Option(
            0.0,
            "--per-token-cost",
            help="Target cost per scored token per sequence, relative to a target step (0: memory-bound).",
        ),
        step_cost_json: Path | None = typer.Option(
            None,
            "--step-cost-json",
            help="A fitted step-cost model (StepCostModel JSON) instead of --cost-ratio.",
        ),
        budget: str | None = typer.Option(None, "--budget-bytes", help="Extra memory speculation may use (e.g. 2GiB)."),
        min_kv_concurrency: float | None = typer.Option(
            None, "--min-kv-concurrency", help="Sequences of --tokens-per-seq the KV pool must still hold."
        ),
        method: str = typer.Option("draft_model", "--method", help="draft_model, eagle, mtp, ngram, suffix…"),
        draft_params: int | None = typer.Option(None, "--draft-params", help="Draft parameter count."),
        draft_dtype: str = typer.Option("bfloat16", "--draft-dtype", help="Draft weight dtype."),
        draft_config: Path | None = typer.Option(None, "--draft-config", help="The draft's config.json."),
        draft_kv: int | None = typer.Option(None, "--draft-kv-bytes-per-token", help="Draft KV bytes per token."),
        target_kv: int = typer.Option(0, "--target-kv-bytes-per-token", help="Target KV bytes per token."),
        kv_pool: str | None = typer.Option(None, "--kv-pool-bytes", help="KV pool without speculation (e.g. 40GiB)."),
        tokens_per_seq: int = typer.Option(2048, "--tokens-per-seq", help="Context tokens per running sequence."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Recommend K (and a per-batch-size K table) from α and the cost of drafting."""
        ci = _parse_ci(alpha_ci)
        _check_inputs(alpha, cost_ratio, k_max, ci)
        if step_cost_json is not None:
            model = _load_step_cost(step_cost_json)
        elif cost_ratio is None:
            fail_usage("give --cost-ratio (draft step / target step, e.g. 0.05) or --step-cost-json FILE.")
        else:
            if not (math.isfinite(per_token_cost) and per_token_cost >= 0):
                fail_usage(f"--per-token-cost cannot be negative but got {per_token_cost}.")
            model = StepCostModel.from_cost_ratio(cost_ratio, 1.0, per_token_cost)
        acceptance = ConstantAlphaModel(alpha, *ci) if ci else ConstantAlphaModel.exact(alpha)
        draft: DraftFootprint | None = None
        memory: MemoryBudget | None = None
        if budget is not None or min_kv_concurrency is not None:
            draft = _draft_footprint(method, draft_params, draft_dtype, draft_config, draft_kv)
            if tokens_per_seq < 1:
                fail_usage(f"--tokens-per-seq must be ≥ 1 but got {tokens_per_seq}.")
            try:
                memory = MemoryBudget(
                    budget_bytes=parse_bytes(budget, "--budget-bytes") if budget is not None else None,
                    min_kv_concurrency=min_kv_concurrency,
                    kv_pool_bytes=parse_bytes(kv_pool, "--kv-pool-bytes") if kv_pool is not None else None,
                    target_kv_bytes_per_token=target_kv,
                    tokens_per_seq=tokens_per_seq,
                )
            except ValueError as exc:
                fail_usage(f"{exc} (options --min-kv-concurrency, --kv-pool-bytes, --target-kv-bytes-per-token).")
        now = datetime.now(UTC)
        decision = choose_k(KChoiceSnapshot(now, acceptance, model, 1, k_max, draft, memory))
        with_memory = memory is not None
        out: dict[str, Any] = {
            "best_k": decision.k,
            "speedup": decision.speedup,
            "expected_tokens_per_step": decision.expected_tokens_per_step,
            "by_k": _by_k(decision, with_memory),
            "batch_size": 1,
            "reason": decision.reason.value,
            "message": decision.message,
        }
        if ci:
            out["speedup_ci"] = list(decision.speedup_ci)
        sizes = parse_batch_sizes(batch_sizes) if batch_sizes is not None else []
        if sizes:
            table = k_table(KTableSnapshot(now, acceptance, model, max(sizes), k_max, draft, memory))
            out["per_batch_size"] = [
                {
                    "batch_size": b,
                    "best_k": table.decisions[b - 1].k,
                    "speedup": table.decisions[b - 1].speedup,
                    "expected_tokens_per_step": table.decisions[b - 1].expected_tokens_per_step,
                    "reason": table.decisions[b - 1].reason.value,
                }
                for b in sizes
            ]
            out[K_TABLE_KEY] = table.as_vllm()  # vLLM's key: the row list pastes into --speculative-config
            out["table_message"] = table.message
        if as_json:
            print_json(out)
            return
        _print_human(out)


def _print_human(out: dict[str, Any]) -> None:
    out_console.print(out["message"], highlight=False)
    grid = Table("K", "tokens/step", "speedup", title="At batch 1")
    for row in out["by_k"]:
        mark = " ←" if row["k"] == out["best_k"] else ""
        grid.add_row(str(row["k"]), f"{row['expected_tokens_per_step']:.3f}", f"{row['speedup']:.3f}×{mark}")
    out_console.print(grid)
    if "per_batch_size" in out:
        per_b = Table("batch", "best K", "speedup", title="Per batch size")
        for row in out["per_batch_size"]:
            per_b.add_row(str(row["batch_size"]), str(row["best_k"]), f"{row['speedup']:.3f}×")
        out_console.print(per_b)
        rows = json.dumps(out[K_TABLE_KEY])
        out_console.print(f"{K_TABLE_KEY}: {rows}", highlight=False)
        out_console.print(out["table_message"], highlight=False)
