"""``spectuner report``: a self-contained HTML page (PNG plots embedded) plus ``report.json``.

``write_report(store, out_dir, since=..., until=...)`` reads the store (``tuner.report.data``), draws
the figures (``tuner.report.plots``, matplotlib Agg) and writes ``index.html`` (``tuner.report.html``)
and ``report.json`` (the numbers each figure was drawn from) into ``out_dir``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from tuner.report.data import ReportData, gather
from tuner.store import Store
from tuner.store.url import render_url

__all__ = ["ReportData", "ReportResult", "gather", "write_report"]


@dataclass(frozen=True)
class ReportResult:
    out_dir: Path
    index_html: Path
    report_json: Path
    images: tuple[str, ...]  # sections that have a figure
    missing: dict[str, str]  # sections without one, and why
    data: ReportData


def write_report(
    store: Store,
    out_dir: str | os.PathLike[str],
    *,
    since: datetime | None = None,
    until: datetime | None = None,
    now: datetime | None = None,
) -> ReportResult:
    """Write ``index.html`` and ``report.json`` into ``out_dir`` (created if needed). Files are written
    to a temporary name and renamed, so a reader never sees half a page."""
    from tuner.report.html import render
    from tuner.report.plots import FIGURES

    data = gather(store, since=since, until=until, now=now, db_label=render_url(store.url))
    images = {name: draw(data) for name, draw in FIGURES.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = out / "index.html"
    report_json = out / "report.json"
    _write_atomic(index, render(data, images))
    _write_atomic(report_json, json.dumps(data.to_json(), indent=2, ensure_ascii=False) + "\n")
    drawn = tuple(name for name, png in images.items() if png is not None)
    missing = {name: data.missing.get(name, "nothing to plot") for name, png in images.items() if png is None}
    return ReportResult(out, index, report_json, drawn, missing, data)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
