"""The report's figures as PNG bytes (matplotlib, Agg, no pyplot: no global state, no display needed).

Each function takes the :class:`~tuner.report.data.ReportData` and returns PNG bytes, or ``None``
when it has nothing to draw (the page then says what is missing).
"""

from __future__ import annotations

import io
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

import matplotlib

matplotlib.use("Agg")  # before any backend is touched: never look for a display

from matplotlib import dates as mdates
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tuner.report.data import AlphaBucket, ConfigSpan, DecisionPoint, KPoint, ReportData

_DPI = 100
_STATUS_COLOURS = {
    "verified": "#2ca02c",
    "applied": "#1f77b4",
    "applying": "#1f77b4",
    "rolled_back": "#d62728",
    "failed": "#8c1a1a",
    "blocked": "#7f7f7f",
    "advisory": "#9467bd",
    "proposed": "#17becf",
}
_DEFAULT_COLOUR = "#ff7f0e"


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    return buf.getvalue()


def _time_axis(ax: Axes) -> None:
    locator = mdates.AutoDateLocator(minticks=4, maxticks=10)
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    ax.set_xlabel("time (UTC)")
    ax.grid(True, alpha=0.3)


_NAN = float("nan")


def _num(value: float | None) -> float:
    return _NAN if value is None else float(value)


def _t(when: datetime) -> float:
    """matplotlib's date number for an aware UTC datetime (typed, unlike passing datetimes through)."""
    return float(mdates.date2num(when))


def _status_colour(status: str) -> str:
    return _STATUS_COLOURS.get(status, _DEFAULT_COLOUR)


def _decision_lines(ax: Axes, decisions: Iterable[DecisionPoint], label_them: bool) -> None:
    ymin, ymax = ax.get_ylim()
    for n, d in enumerate(decisions):
        ax.axvline(_t(d.created_at), color=_status_colour(d.status), linestyle=":", linewidth=1.2, alpha=0.9)
        if label_them:
            ax.text(
                _t(d.created_at),
                ymax - (0.02 + 0.09 * (n % 3)) * (ymax - ymin),  # three heights: close decisions stay legible
                f" #{d.id} {d.action}\n {d.status}",
                fontsize=7,
                va="top",
                ha="left",
                color=_status_colour(d.status),
            )


def alpha_png(data: ReportData) -> bytes | None:
    """α̂ per bucket with its interval band, vLLM's draft acceptance rate, and the 0.4 line."""
    buckets = [b for b in data.alpha if b.alpha is not None or b.draft_acceptance_rate is not None]
    if not buckets:
        return None
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_subplot()
    by_engine: dict[str, list[AlphaBucket]] = defaultdict(list)
    for b in buckets:
        by_engine[b.engine].append(b)
    palette = matplotlib.colormaps["tab10"]
    for i, (engine, items) in enumerate(sorted(by_engine.items())):
        colour = palette(i % 10)
        # NaN between buckets that are not adjacent: a gap in the data (idle, restart) is not a slope.
        xs: list[float] = []
        lows: list[float] = []
        mids: list[float] = []
        highs: list[float] = []
        rates: list[float] = []
        for j, b in enumerate(items):
            if j and b.start > items[j - 1].end:
                xs.append(_t(items[j - 1].end + (b.start - items[j - 1].end) / 2))
                for series in (lows, mids, highs, rates):
                    series.append(_NAN)
            xs.append(_t(b.start + (b.end - b.start) / 2))
            lows.append(_num(b.alpha_lower))
            mids.append(_num(b.alpha))
            highs.append(_num(b.alpha_upper))
            rates.append(_num(b.draft_acceptance_rate))
        if any(b.alpha is not None for b in items):
            ax.fill_between(xs, lows, highs, color=colour, alpha=0.2, step="mid",
                            label=f"{engine}: α̂ {data.confidence:.0%} interval")
            ax.plot(xs, mids, color=colour, marker="o", markersize=3, label=f"{engine}: α̂")
        ax.plot(xs, rates, color=colour, linestyle="--", linewidth=1,
                label=f"{engine}: draft acceptance rate A/T (vLLM)")
    ax.axhline(data.alpha_threshold, color="#d62728", linewidth=1.5,
               label=f"threshold {data.alpha_threshold:g} (swap when α̂'s upper end stays below)")
    ax.set_ylim(0.0, 1.02)
    ax.set_ylabel("acceptance")
    ax.set_title(f"α̂ (per-token acceptance) per {data.bucket_s} s bucket")
    _time_axis(ax)
    _decision_lines(ax, data.decisions, label_them=False)
    # Below the axes: inside, the legend hides the low-acceptance stretches that matter most.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=2)
    return _png(fig)


def positions_png(data: ReportData) -> bytes | None:
    """Per config: a_i / D (share of drafts accepting position i) and conditional c_i."""
    if not data.positions:
        return None
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    groups = data.positions
    width = 0.8 / len(groups)
    for j, group in enumerate(groups):
        label = f"{group.engine} {group.config} ({group.drafts:,} drafts)"
        xs = [i + (j - (len(groups) - 1) / 2) * width for i in range(group.k)]
        left.bar(xs, group.rate_by_position, width=width, label=label)
        cond = [c if c is not None else 0.0 for c in group.conditional_by_position]
        right.bar(xs, cond, width=width, label=label)
    k_max = max(g.k for g in groups)
    for ax, title in (
        (left, "share of drafts accepted up to position i (a_i / D)"),
        (right, "conditional acceptance c_i = a_i / a_{i−1}"),
    ):
        ax.set_xticks(range(k_max))
        ax.set_xlabel("position i (0-based)")
        ax.set_ylim(0.0, 1.05)
        ax.axhline(data.alpha_threshold, color="#d62728", linewidth=1, linestyle="--")
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    left.set_ylabel("acceptance")
    # Below both panels: inside, the legend would cover the bars.
    fig.legend(*left.get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=min(3, len(groups)), fontsize=8)
    return _png(fig)


def timeline_png(data: ReportData) -> bytes | None:
    """K over time (step line), the draft in force (shaded spans), decisions (dotted lines)."""
    if not data.configs and not data.k_points:
        return None
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_subplot()
    end_of_range = data.last or data.until or data.generated_at
    palette = matplotlib.colormaps["Pastel1"]
    draft_colour: dict[str, tuple[float, ...]] = {}
    shaded: set[str] = set()
    by_engine: dict[str, list[ConfigSpan]] = defaultdict(list)
    for c in data.configs:
        by_engine[c.engine].append(c)
    top_k = 1
    for i, (engine, spans) in enumerate(sorted(by_engine.items())):
        xs: list[datetime] = []
        ys: list[int] = []
        for span in spans:
            end = span.end or end_of_range
            end = max(end, span.start)
            colour = draft_colour.setdefault(span.draft, palette(len(draft_colour) % 9))
            ax.axvspan(_t(span.start), _t(end), color=colour, alpha=0.6,
                       label=None if span.draft in shaded else f"draft {span.draft}")
            shaded.add(span.draft)
            k = span.k if span.k is not None else 0
            xs += [span.start, end]
            ys += [k, k]
            top_k = max(top_k, k)
        ax.plot([_t(x) for x in xs], ys, color=matplotlib.colormaps["tab10"](i % 10), linewidth=2, label=f"{engine}: K")
    points: dict[str, list[KPoint]] = defaultdict(list)
    for p in data.k_points:
        points[p.engine].append(p)
    for i, (engine, items) in enumerate(sorted(points.items())):
        ax.step([_t(p.at) for p in items], [p.k for p in items], where="post", linewidth=2,
                color=matplotlib.colormaps["tab10"]((i + len(by_engine)) % 10), label=f"{engine}: K (from windows)")
        top_k = max([top_k, *(p.k for p in items)])
    ax.set_ylim(-0.2, top_k + 1.8)
    ax.set_ylabel("K (speculative tokens)")
    ax.set_title("K, draft and decisions over time")
    _time_axis(ax)
    _decision_lines(ax, data.decisions, label_them=True)
    statuses = sorted({d.status for d in data.decisions})
    for status in statuses:
        ax.plot([], [], color=_status_colour(status), linestyle=":", label=f"decision: {status}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    return _png(fig)


def goodput_png(data: ReportData) -> bytes | None:
    """Mean generated tokens/s of busy windows per K, ± standard error, the K in force marked."""
    if not data.goodput:
        return None
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_subplot()
    engines = sorted({g.engine for g in data.goodput})
    ks = sorted({g.k for g in data.goodput})
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        items = [g for g in data.goodput if g.engine == engine]
        xs = [ks.index(g.k) + (j - (len(engines) - 1) / 2) * width for g in items]
        colours = ["#ff7f0e" if g.chosen else "#1f77b4" for g in items]
        ax.bar(xs, [g.mean_tokens_per_s for g in items], width=width, color=colours,
               yerr=[g.stderr_tokens_per_s or 0.0 for g in items], capsize=4, label=engine)
        for x, g in zip(xs, items, strict=True):
            ax.annotate(f"{g.mean_tokens_per_s:,.0f}\n({g.windows} w)", (x, g.mean_tokens_per_s),
                        textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
            if g.chosen:
                ax.annotate("★ in force", (x, 0), textcoords="offset points", xytext=(0, 6), ha="center",
                            fontsize=9, color="white", fontweight="bold")
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"K={k}" for k in ks])
    ax.set_ylabel("goodput (generated tokens / s)")
    ax.set_title("Goodput against K (busy windows; orange = K in force at the end of the range)")
    ax.grid(True, axis="y", alpha=0.3)
    ax.margins(y=0.2)
    return _png(fig)


def gains_png(data: ReportData) -> bytes | None:
    """Predicted against realized gain per decision, with the y = x line and the no-change line."""
    points = data.gains
    if not points:
        return None
    xs = [float(p.predicted_gain or 0.0) for p in points]
    ys = [float(p.realized_gain or 0.0) for p in points]
    fig = Figure(figsize=(7, 5.5))
    ax = fig.add_subplot()
    pad = 0.05 + 0.05 * (max(*xs, *ys, 1.0) - min(*xs, *ys, 1.0))
    lo = min(*xs, *ys, 1.0) - pad
    hi = max(*xs, *ys, 1.0) + pad
    ax.plot([lo, hi], [lo, hi], color="#7f7f7f", linestyle="--", linewidth=1, label="realized = predicted")
    ax.axhline(1.0, color="#d62728", linewidth=1, label="no change (1.0×)")
    for status in sorted({p.status for p in points}):
        idx = [i for i, p in enumerate(points) if p.status == status]
        ax.scatter([xs[i] for i in idx], [ys[i] for i in idx], s=60, color=_status_colour(status), label=status,
                   zorder=3)
    for p, x, y in zip(points, xs, ys, strict=True):
        ax.annotate(f"#{p.id}", (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted gain (× goodput)")
    ax.set_ylabel("realized gain (× goodput)")
    ax.set_title("Predicted against realized gain per decision")
    ax.grid(True, alpha=0.3)
    # Below the axes: points may lie anywhere in the square.
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    return _png(fig)


FIGURES = {
    "alpha": alpha_png,
    "positions": positions_png,
    "timeline": timeline_png,
    "goodput": goodput_png,
    "gains": gains_png,
}
