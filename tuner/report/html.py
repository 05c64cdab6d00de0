"""One self-contained HTML page: inline CSS, PNGs as base64 ``data:`` URIs, no script, no external URL."""

from __future__ import annotations

import base64
from datetime import datetime
from html import escape

from tuner.report.data import ReportData, describe_config
from tuner.report.fleet import FleetEngineRow, FleetPending

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 1180px; color: #222; line-height: 1.45; padding: 0 1rem; }
h1 { margin-bottom: 0.2rem; } h2 { margin-top: 2.2rem; border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
.meta { color: #555; font-size: 0.92rem; }
img.figure { max-width: 100%; border: 1px solid #eee; }
p.note { color: #555; font-size: 0.9rem; }
p.missing { background: #fff6e0; border-left: 4px solid #f0a000; padding: 0.6rem 0.8rem; }
table { border-collapse: collapse; font-size: 0.85rem; margin-top: 0.6rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.5rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.status-verified { color: #2ca02c; } .status-rolled_back, .status-failed { color: #c00; }
tr.outlier td.engine, span.outlier { color: #c00; font-weight: bold; }
.sev-critical { color: #c00; font-weight: bold; } .sev-warning { color: #b36b00; }
"""

# (section id, heading, what it shows) in page order.
SECTIONS = (
    ("alpha", "Acceptance and α̂ over time",
     "α̂ is the draft's per-token acceptance probability (MLE A / (A + D − a<sub>K−1</sub>)) per time bucket, "
     "with its 95% interval (Jeffreys); the dashed line is vLLM's draft acceptance rate A / T, which "
     "depends on K and is not α. The red line is the 0.4 threshold: a draft is swapped when the upper "
     "end of α̂'s interval stays below it. Dotted verticals are decisions."),
    ("positions", "Per-position acceptance",
     "Per config: the share of drafts whose first i+1 tokens were accepted (a<sub>i</sub> / D, vLLM's "
     "per-position acceptance rate) and the conditional acceptance c<sub>i</sub> = a<sub>i</sub> / "
     "a<sub>i−1</sub>. Under the i.i.d. model every c<sub>i</sub> equals α; real drafts decay with i."),
    ("timeline", "K, draft and decisions over time",
     "K in force (line; for a per-batch-size table its largest K, as the exporter's K gauge), the "
     "draft in force (shaded), and each decision (dotted, coloured by status)."),
    ("goodput", "Goodput against K",
     "Mean generated tokens per second of the busy windows that ran at each K (± standard error; "
     "the count of windows in brackets). Offered load differs between periods, so compare with care. "
     "K is the config's, as in the timeline. The K in force at the end of the range is marked."),
    ("gains", "Predicted against realized gain",
     "Each decision that was applied and verified: the gain the controller predicted against the gain "
     "verification measured (after / before per-window throughput). Points below the red line lost "
     "throughput; rolled-back changes are red."),
)


def _fmt_time(t: datetime | None) -> str:
    return "—" if t is None else t.strftime("%Y-%m-%d %H:%M:%S UTC")


def _fmt_range(since: datetime | None, until: datetime | None) -> str:
    if since is None and until is None:
        return "everything stored"
    return f"{_fmt_time(since) if since else 'the start'} → {_fmt_time(until) if until else 'now'}"


def _fmt_gain(g: float | None) -> str:
    return "—" if g is None else f"{g:.3f}×"


def render(data: ReportData, images: dict[str, bytes | None]) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>spectuner report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>spectuner report</h1>",
        '<p class="meta">',
        f"Database <code>{escape(data.db)}</code> · range {_fmt_range(data.since, data.until)} · "
        f"windows from {_fmt_time(data.first)} to {_fmt_time(data.last)} · "
        f"generated {_fmt_time(data.generated_at)}",
        "</p>",
        _engines_table(data),
    ]
    for section, heading, blurb in SECTIONS:
        parts.append(f'<h2 id="{section}">{escape(heading)}</h2>')
        parts.append(f"<p>{blurb}</p>")
        png = images.get(section)
        if png is not None:
            encoded = base64.b64encode(png).decode("ascii")
            parts.append(
                f'<img class="figure" id="fig-{section}" alt="{escape(heading)}" '
                f'src="data:image/png;base64,{encoded}">'
            )
            if section in data.notes:
                parts.append(f'<p class="note" id="note-{section}">{escape(data.notes[section])}</p>')
        else:
            reason = data.missing.get(section, "Nothing to plot.")
            parts.append(f'<p class="missing" id="missing-{section}">{escape(reason)}</p>')
        if section == "gains":
            parts.append(_decisions_table(data))
    parts.append(_fleet_table(data))
    parts.append(_lengths_table(data))
    parts.append(_shadow_table(data))
    parts.append(_events_table(data))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _engines_table(data: ReportData) -> str:
    if not data.engines:
        return '<p class="missing" id="missing-engines">The database has no engine series yet.</p>'
    rows = "".join(
        f"<tr><td>{escape(e.label)}</td><td><code>{escape(e.url)}</code></td>"
        f'<td class="num">{e.windows:,}</td><td class="num">{e.rollup_minutes:,}</td></tr>'
        for e in data.engines
    )
    return (
        '<table id="engines"><tr><th>engine series</th><th>metrics URL</th><th>windows in range</th>'
        f"<th>older minutes from rollups (raw windows pruned)</th></tr>{rows}</table>"
    )


def _decisions_table(data: ReportData) -> str:
    if not data.decisions:
        return f'<p class="missing" id="missing-decisions">{escape(data.missing.get("decisions", ""))}</p>'
    head = (
        "<tr><th>#</th><th>created</th><th>action</th><th>reason</th><th>proposed</th><th>status</th>"
        "<th>predicted</th><th>realized</th><th>message</th></tr>"
    )
    rows = "".join(
        f"<tr><td>{d.id}</td><td>{_fmt_time(d.created_at)}</td><td>{escape(d.action)}</td>"
        f"<td>{escape(d.reason)}</td><td>{escape(d.proposed or '—')}</td>"
        f'<td class="status-{escape(d.status)}">{escape(d.status)}</td>'
        f'<td class="num">{_fmt_gain(d.predicted_gain)}</td><td class="num">{_fmt_gain(d.realized_gain)}</td>'
        f"<td>{escape(d.message)}</td></tr>"
        for d in data.decisions
    )
    return f'<h3>Decisions</h3><table id="decisions">{head}{rows}</table>'


def _ci(ci: list[float] | None) -> str:
    return "—" if not ci else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def _alpha_ci(alpha: float | None, lo: float | None, hi: float | None) -> str:
    if alpha is None:
        return "—"
    return f"{alpha:.3f}" + ("" if lo is None or hi is None else f" [{lo:.3f}, {hi:.3f}]")


def _engine_cell(e: FleetEngineRow) -> str:
    flag = ' <span class="outlier">OUTLIER</span>' if e.verdict == "outlier" else ""
    return f"{escape(e.engine)}: {_alpha_ci(e.alpha, e.alpha_lower, e.alpha_upper)}{flag}"


def _pending_text(p: FleetPending) -> str:
    what = describe_config(p.proposed_config)
    return (
        f"#{p.id} {escape(p.action)} {escape(p.status)}" + (f" → {escape(what)}" if what else "")
        + (f" on {escape(p.engine)}" if p.engine else "")
    )


def _fleet_table(data: ReportData) -> str:
    fleet = data.fleet
    parts = [
        '<h2 id="fleet">Fleet: engines grouped by (target, draft, config)</h2>',
        f"<p>Engines that run the same config on the same target model should accept alike. Per group: the "
        f"pooled α̂ over every window of the range under the config each engine had at its end, with its "
        f"{data.confidence:.0%} interval widened by √φ (φ: the quasi-binomial dispersion between the "
        "engines; replicas behind one router still see different prompts); each engine's own α̂ and "
        "interval; outliers — an engine whose α̂ is far from the rest of its group (a two-proportion test "
        "against the others, Bonferroni over the group, and at least 0.05 apart), judged with 3 or more "
        "engines; and the changes in flight on its engines when the report was generated.</p>",
    ]
    if not fleet.groups:
        parts.append(f'<p class="missing" id="missing-fleet">{escape(data.missing.get("fleet", ""))}</p>')
    else:
        engines = sum(len(g.engines) for g in fleet.groups)
        if engines == 1:
            parts.append(
                '<p class="note" id="fleet-one-engine">One engine: its group\'s α̂ is its own, and there is '
                "no other engine to call it an outlier against.</p>"
            )
        head = (
            "<tr><th>target</th><th>draft</th><th>config</th><th>engines (α̂ [interval])</th>"
            "<th>pooled α̂ [interval]</th><th>φ</th><th>outliers</th><th>pending changes</th></tr>"
        )
        rows = []
        for g in fleet.groups:
            members = "<br>".join(_engine_cell(e) for e in g.engines)
            outliers = "<br>".join(
                f'<span class="outlier">{escape(e.engine)}</span>: {escape(e.reason)}' for e in g.outliers
            )
            pending = "<br>".join(_pending_text(p) for p in g.pending)
            rows.append(
                f"<tr><td>{escape(g.target)}</td><td>{escape(g.draft_model or g.method)}</td>"
                f"<td>{escape(g.config.removeprefix('config '))}</td><td>{len(g.engines)}: {members}</td>"
                f'<td class="num">{_alpha_ci(g.alpha, g.alpha_lower, g.alpha_upper)}</td>'
                f'<td class="num">{g.dispersion:.2f}</td><td>{outliers or "none"}</td>'
                f"<td>{pending or '—'}</td></tr>"
            )
        parts.append(f'<table id="fleet-table">{head}{"".join(rows)}</table>')
    if fleet.pending_for_all:
        items = "; ".join(_pending_text(p) for p in fleet.pending_for_all)
        parts.append(f'<p id="fleet-pending-all">Pending for every engine: {items}</p>')
    if fleet.ungrouped:
        names = ", ".join(escape(n) for n in fleet.ungrouped)
        parts.append(f'<p class="note" id="fleet-ungrouped">Not grouped (no config recorded yet): {names}</p>')
    return "".join(parts)


def _lengths_table(data: ReportData) -> str:
    if not data.context_length:
        return ""
    parts = ['<h2 id="context-length">Acceptance by context length</h2>']
    for label, view in data.context_length.items():
        rows = "".join(
            f"<tr><td>{b['lo_tokens']:,}–{'' if b['hi_tokens'] is None else format(b['hi_tokens'], ',')}</td>"
            f'<td class="num">{b["requests"]}</td><td class="num">{b["drafts"]:,}</td>'
            f'<td class="num">{"—" if b["alpha"] is None else format(b["alpha"], ".3f")}</td>'
            f'<td class="num">{_ci(b["alpha_ci"])}</td></tr>'
            for b in view["bands"]
            if b["requests"]
        )
        parts.append(
            f"<h3>{escape(label)}</h3><p>{escape(str(view['message']))}</p>"
            '<table class="context-length"><tr><th>context tokens</th><th>requests</th><th>drafts</th>'
            f"<th>α̂</th><th>interval</th></tr>{rows}</table>"
        )
    return "".join(parts)


def _shadow_table(data: ReportData) -> str:
    if not data.shadow:
        return ""
    rows = "".join(
        f"<tr><td>{escape(r['candidate'])}</td><td>{escape(r['method'])}</td>"
        f'<td class="num">{"—" if r["alpha"] is None else format(r["alpha"], ".3f")}</td>'
        f'<td class="num">{_ci(r["alpha_ci"])}</td><td class="num">{r["drafts"]:,}</td>'
        f"<td>{escape(r['computed_at'])}</td><td>{'greedy-only' if r['greedy_only'] else ''}</td></tr>"
        for r in sorted(data.shadow, key=lambda r: -(r["alpha"] or 0.0))
    )
    return (
        '<h2 id="shadow">Draft candidates measured on recorded traffic (shadow)</h2><table id="shadow-table">'
        "<tr><th>candidate</th><th>method</th><th>α̂</th><th>interval</th><th>drafts</th><th>computed</th>"
        f"<th></th></tr>{rows}</table>"
    )


def _events_table(data: ReportData) -> str:
    if not data.events:
        return ""
    rows = "".join(
        f"<tr><td>{_fmt_time(e.ts)}</td><td>{escape(e.engine or '—')}</td><td>{escape(e.kind)}</td>"
        f'<td class="sev-{escape(e.severity)}">{escape(e.severity)}</td><td>{escape(e.message)}</td></tr>'
        for e in data.events
    )
    return (
        '<h2 id="events">Events</h2><table id="events-table"><tr><th>time</th><th>engine</th><th>kind</th>'
        f"<th>severity</th><th>message</th></tr>{rows}</table>"
    )
